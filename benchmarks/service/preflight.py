"""``python -m benchmarks.service.preflight [--quick]``: what the preflight costs a job that runs the user's code.

On an idle local stack (Redis, a Ray head with 2 CPUs, API, scheduler ticking every 0.2 s), side by side in one run:
a built-in job (digits MLP, 1 worker) and a job with a ~1 MB code package (``examples/tiny_lm`` plus 1 MiB of
incompressible bytes: its model, data and loss factories; 1 worker), one after another. Times come from the jobs'
Redis stream ids (the server's clock): submit -> preflight verdict (the scheduler's "preflight passed" event),
verdict -> starting, starting -> first epoch, submit -> first epoch. Also the package's first upload and the
second upload of the unchanged directory (the CLI zips it and asks for the id first: no bytes are sent again;
on localhost the zipping dominates both), and the preflight's own work as it measured it (its `seconds`).
Writes ``benchmarks/results/preflight.json``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import print_table, write_result
from benchmarks.service.common import ms
from benchmarks.service.startup import E2E_SPEC, _wait_ready, follow_job
from service.cli.client import Client
from service.cli.code_zip import upload
from service.stack.embedded import Stack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_lm"
CODE_SPEC = {
    "model": {"kind": "custom", "factory": "tiny_lm.model:gpt", "args": {"d": 16, "heads": 2, "max_len": 16}},
    "dataset": {"name": "custom", "factory": "tiny_lm.data:python_source",
                "args": {"seq_len": 16, "stride": 16, "max_chars": 4000}},
    "training": {"epochs": 2, "batch_size": 32, "loss": "tiny_lm.loss:next_token"},
    "optimizer": {"name": "adam", "lr": 0.003},
    "teleport": {"epochs": [0], "batches": 1, "batch_size": 1, "steps": 2, "cap": 50.0},
}
SEGMENTS = [("submit -> preflight verdict", "submit", "verdict"), ("verdict -> starting", "verdict", "starting"),
            ("submit -> starting", "submit", "starting"), ("starting -> first epoch", "starting", "first_metric"),
            ("submit -> first epoch", "submit", "first_metric")]


def make_package(root: Path) -> Path:
    """The example LM package and 1 MiB of random bytes (a zip cannot shrink them): a ~1 MB package."""
    pkg = root / "pkg"
    shutil.copytree(EXAMPLE, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "tiny_lm" / "weights.bin").write_bytes(os.urandom(1 << 20))
    return pkg


def one_job(c: Client, spec: dict[str, Any], name: str) -> dict[str, Any]:
    sent = time.time()
    job_id = c.json("POST", "/v1/experiments", json={"spec": spec, "name": name})["id"]
    f = follow_job(c.http, job_id, timeout_s=180.0)
    marks = {"submit": sent, **{k: v for k, v in f["marks"].items() if k in ("starting", "first_metric")}}
    for t, event, d in f["timeline"]:
        if event == "log" and str(d.get("message", "")).startswith("preflight passed"):
            marks["verdict"] = t
            break
    seg = {label: marks[b] - marks[a] if a in marks and b in marks else None for label, a, b in SEGMENTS}
    seg["  the preflight's own work (import, build, step, teleport)"] = (c.get(job_id).get("preflight") or {}).get(
        "seconds")
    return {"job_id": job_id, "final": f["final"], "segments": seg}


def medians(jobs: list[dict[str, Any]]) -> dict[str, float | None]:
    labels = dict.fromkeys(label for j in jobs for label in j["segments"])
    return {label: statistics.median(vals) if (vals := [j["segments"][label] for j in jobs
                                                        if j["segments"].get(label) is not None]) else None
            for label in labels}


def run(jobs: int, home: Path) -> dict[str, Any]:
    stack = Stack(home / "stack", num_cpus=2, tick_s=0.2)
    load_before = os.getloadavg()[0]  # a shared machine: how far from idle these timings are
    try:
        stack.start()
        with Client(stack.url, stack.admin_token) as c:
            _wait_ready(c.http)
            pkg = make_package(home)
            t = time.perf_counter()
            first = upload(c, str(pkg))
            first_s = time.perf_counter() - t
            t = time.perf_counter()
            again = upload(c, str(pkg))
            again_s = time.perf_counter() - t
            code_spec = {**CODE_SPEC, "code": {"package": first["package"]}}
            runs: dict[str, list[dict[str, Any]]] = {"built-in": [], "1 MB package": []}
            for i in range(jobs):  # alternating, so both see the same machine
                for label, spec in (("built-in", E2E_SPEC), ("1 MB package", code_spec)):
                    job = one_job(c, spec, f"{label}-{i}")
                    runs[label].append(job)
                    print(f"   {label} {i + 1}/{jobs} {job['job_id']}: {job['final']}, submit -> first epoch "
                          f"{ms(job['segments']['submit -> first epoch'])} ms", flush=True)
    finally:
        stack.stop()
    upload_row = {"bytes": first["bytes"], "first_upload_s": first_s, "first_uploaded": first["uploaded"],
                  "second_upload_s": again_s, "second_uploaded": again["uploaded"]}
    return {"jobs_per_kind": jobs, "upload": upload_row, "load_1min": [load_before, os.getloadavg()[0]],
            "medians_s": {k: medians(v) for k, v in runs.items()}, "runs": runs,
            "all_succeeded": all(j["final"] == "succeeded" for v in runs.values() for j in v)}


def report(result: dict[str, Any]) -> None:
    up = result["upload"]
    print(f"\npackage of {up['bytes'] / 2**20:.2f} MiB: first upload {ms(up['first_upload_s'])} ms "
          f"(sent: {up['first_uploaded']}), second upload of the unchanged directory {ms(up['second_upload_s'])} ms "
          f"(sent: {up['second_uploaded']}); ratio {up['first_upload_s'] / up['second_upload_s']:.1f}x")
    kinds = list(result["medians_s"])
    labels = dict.fromkeys(label for k in kinds for label in result["medians_s"][k])
    print_table(["segment (median ms)", *kinds],
                [[label, *(ms(result["medians_s"][k].get(label)) for k in kinds)] for label in labels])
    print(f"1-min load average before/after: {result['load_1min']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one job per kind (default 3)")
    args = parser.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="tlab-preflight-bench-"))
    try:
        result = run(1 if args.quick else 3, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report(result)
    write_result("preflight", {**result, "quick": args.quick})
    return 0 if result["all_succeeded"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
