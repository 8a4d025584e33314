"""schemathesis (``--checks all``) over the API's own OpenAPI, as a normal user and as the admin: 0 failures.

The API alone on a real Redis (``api_only``, no Ray). Each user gets a run over every operation but one, then a
run over that one (``POST /v1/users/{name}/token``): a rotation of the caller's own token, which the fuzzer finds
through the links from ``/v1/me``, ends its session, so every case after it would be a 401. The user goes first:
the admin's run may disable them.

Left out, on purpose, and each for a reason:
- ``/readyz`` answers 503 by design here (no scheduler in this fixture), which ``not_a_server_error`` fails;
- the SSE routes (``/events``, ``/logs/stream``) stream a live job until it ends, and no job ends here (no
  scheduler): each case would wait for its request timeout. The streams have their own tests (test_api.py,
  test_admission.py, tests/workers/test_job_logs.py).
- ``positive_data_acceptance`` takes a 422 as an answer on the two submit routes only: admission refuses, naming
  the field, specs that match the JSON Schema but can never run, which a JSON Schema cannot say (cross-field rules
  such as "some teleport epoch < training.epochs", data files under the data roots, service limits, quotas, a gang
  that fits the cluster); and on ``POST /v1/code``, whose body the schema can only call binary while only a safe
  zip is one. Everywhere else a schema-valid request must be accepted.
- ``use_after_free`` is off: the only DELETEs are on an experiment or a sweep, where DELETE cancels and, by design
  (docs/rest.md), the record stays readable (GET 200, state ``cancelled``), while the check expects a 404.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.service.conftest import Api, tiny

ROTATE = "/v1/users/{name}/token"
SKIPPED = ("/readyz", "/v1/experiments/{job_id}/events", "/v1/sweeps/{sweep_id}/events",
           "/v1/experiments/{job_id}/logs/stream")
CONFIG = """
[[operations]]
include-path-regex = "^/v1/(experiments|sweeps|code)$"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2XX", "401", "403", "404", "409", "422", "429"]
"""
EXAMPLES = 15  # per operation and phase: about 2,600 cases per user, 20-60 s on 2 cores


def fuzz(api: Api, token: str, workdir: Path, *only_or_not: str, rotates: bool = False) -> int:
    """One schemathesis run with ``token``: the cases it generated; asserts it found nothing and, unless the run
    rotates the token away, that the token worked throughout."""
    exe = str(Path(sys.executable).parent / "schemathesis")
    skips = [a for path in SKIPPED for a in ("--exclude-path", path)]
    out = subprocess.run(
        [exe, "--config-file", str(workdir / "schemathesis.toml"), "run", f"{api.url}/openapi.json",
         "--checks", "all", "--exclude-checks", "use_after_free", "--header", f"Authorization: Bearer {token}",
         "--max-examples", str(EXAMPLES), "--seed", "7", "--request-timeout", "20", "--no-color", *skips,
         *only_or_not],
        capture_output=True, text=True, timeout=280, cwd=workdir)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert not re.search(r"found \d+ unique failure", out.stdout), report
    assert rotates or "401 Unauthorized (" not in out.stdout, report  # schemathesis's "only 401s" warning
    generated = re.search(r"(\d+) generated", out.stdout)
    assert generated, report
    return int(generated.group(1))


def test_openapi_fuzz_all_checks_two_users(api_only: Api, tmp_path: Path) -> None:
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    user = api_only.add_user("fuzzer")
    for who in ("fuzzer", "admin"):  # something to find: a queued job of each
        with api_only.client(who) as c:
            assert c.post("/v1/experiments", json={"spec": tiny()}).status_code == 201
    cases = []
    for token in (user, api_only.stack.admin_token):  # the user first: the admin's run may disable them
        cases.append(fuzz(api_only, token, tmp_path, "--exclude-path", ROTATE))
        cases.append(fuzz(api_only, token, tmp_path, "--include-path", ROTATE, rotates=True))
    print(f"schemathesis cases per run (user, user rotate, admin, admin rotate): {cases}")
    assert sum(cases) >= 1000, cases
