"""schemathesis (``--checks all``, every phase: examples, coverage, fuzzing and the stateful phase) over the routes
``test_fuzz`` leaves out, the streams, and over an ended experiment's lineage: 0 failures, 0 errors.

The API on a real Redis (``api_only``). The fuzzing user owns one ended experiment (cancelled through the API, its run
directory holding checkpoints after epochs 2 and 3, as a run that pruned epoch 1's keeps them): its events and logs
streams end, so every ``Last-Event-ID`` their schemas allow is tried on them (a resume past the end included); it
can be continued, forked (from a pruned epoch: 409, the same error body) and deleted. The user may queue nothing more
(``max_queued_jobs=0``: a submit is 429), so every stream the fuzzer opens belongs to an ended job. The other routes
are ``test_fuzz``'s.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.service.api.test_fuzz import REPO
from tests.service.api.test_lineage_api import ended_parent
from tests.service.conftest import Api

EXAMPLES = 3  # per operation and phase
# a schema-valid submit, continue or fork may still be refused by what the schema cannot say: the user's quota (429),
# the parent's state (409), admission's cross-field rules (422: test_fuzz says which)
# the ended experiment's id stands for every {job_id}. schemathesis 4.32's coverage phase sends `Last-Event-ID: 0` to
# the logs stream whatever the header's pattern says (^[0-9]{1,6}:[0-9]{1,15}$, "0" matches it not): that phase is off
# there, its fuzzing and stateful phases on
CONFIG = """
[parameters]
job_id = "{job}"

[[operations]]
include-path-regex = "^/v1/(experiments|sweeps)(/[^/]+/(continue|fork|rerun))?$"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = ["2XX", "401", "403", "404", "409", "422", "429"]

[[operations]]
include-path = "/v1/experiments/{{job_id}}/logs/stream"
phases.coverage.enabled = false
"""
# the routes test_fuzz leaves out (the streams) and those an ended experiment opens (its lineage, its deletion)
ROUTES = r"(/events|/logs/stream|/fork|/continue)$|^/v1/experiments/\{job_id\}$"


@pytest.fixture()
def api_env() -> dict[str, str]:
    return {"TLAB_USER_CODE": "off"}


def test_schemathesis_stateful_over_an_ended_experiment_and_its_streams(api_only: Api, tmp_path: Path) -> None:
    token = api_only.add_user("fuzzer")
    with api_only.client("fuzzer") as c:
        job = ended_parent(api_only, c, [2, 3])
        assert c.post(f"/v1/experiments/{job}/fork", json={"from_epoch": 1}).status_code == 409
    with api_only.client() as admin:
        admin.patch("/v1/users/fuzzer", json={"quotas": {"max_queued_jobs": 0}}).raise_for_status()
    (tmp_path / "schemathesis.toml").write_text(CONFIG.format(job=job))
    exe = str(Path(sys.executable).parent / "schemathesis")
    t0 = time.monotonic()
    try:
        out = subprocess.run(
            [exe, "--config-file", str(tmp_path / "schemathesis.toml"), "run", f"{api_only.url}/openapi.json",
             "--checks", "all", "--header", f"Authorization: Bearer {token}", "--max-examples", str(EXAMPLES),
             "--seed", "7", "--request-timeout", "20", "--no-color", "--include-path-regex", ROUTES],
            capture_output=True, text=True, timeout=240, cwd=tmp_path,
            env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.service.api.fuzz_zip", "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"schemathesis ran past 240 s: {(late.stdout or b'')[-6000:]!r}")
    report = out.stdout[-8000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    assert not re.search(r"found \d+ unique failure|\d+ errors?\b", out.stdout), report
    assert "Stateful" in out.stdout and "401 Unauthorized (" not in out.stdout, report
    print(f"schemathesis, stateful phase included: {time.monotonic() - t0:.0f} s; "
          + " ".join(re.findall(r"\d+ generated|\d+ passed|\d+ skipped", out.stdout)))
