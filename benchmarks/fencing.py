"""What fencing costs and what it stops, side by side in one run (docs/security.md, "Fencing").

- ``writes``: one event batch through the job's bounded script, unfenced and fenced to its attempt (the record read in
  the same step), and the attempt's check alone (what a checkpoint's rename, an export's promotion and a bucket push
  wait for): median microseconds over interleaved rounds, on a real Redis as the job's own ACL user.
- ``stale``: a 1-worker job's driver (``python -m workers.run``, no Ray) frozen mid-run (SIGSTOP), the job requeued,
  its next attempt run to the end and the job marked succeeded; then the frozen driver continued: seconds until it
  exits, and whether the artifacts (sha256), the summary or the stream changed after the success. This checkout's
  code, and another's with ``--before DIR``.

Results: ``benchmarks/results/fencing.json``; the current figures are in docs/results.md.

    python -m benchmarks.fencing --before /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from api_schemas import build_spec, keys
from api_schemas.redis_scripts import fence_check, write_caps, xadd_once
from benchmarks.common import print_table, write_result
from benchmarks.sandbox_startup import start_redis

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"model": {"kind": "mlp", "hidden": [32]}, "dataset": {"name": "digits", "max_train": 300, "max_test": 50},
        "training": {"epochs": 100, "batch_size": 32}, "teleport": {"enabled": False},
        "resources": {"workers": 1, "cpus_per_worker": 0.5}}


def writes(url: str, rounds: int = 2000) -> dict[str, float]:
    """Median µs of an event batch unfenced, fenced, and of the check alone (the job's run copy as its record)."""
    r = redis.Redis.from_url(url)
    job = "1a24b0000000-000000"
    r.hset(keys.job_run(job), mapping={keys.JOB_RUN_MARK: job, "attempts": "1", "state": "running"})
    own, caps = keys.own_keys(job), write_caps()
    scripts = {"unfenced": r.register_script(xadd_once(caps)), "fenced": r.register_script(xadd_once(caps, 1)),
               "check": r.register_script(fence_check(1))}
    event = ["", "metric", json.dumps({"kind": "epoch", "epoch": 1, "train_loss": 0.5})]
    times: dict[str, list[float]] = {k: [] for k in scripts}
    for _ in range(rounds):
        for name, script in scripts.items():
            t = time.perf_counter()
            script(keys=own, args=[] if name == "check" else [1000, *event])
            times[name].append((time.perf_counter() - t) * 1e6)
    r.delete(*own)
    return {k: statistics.median(v) for k, v in times.items()}


def epochs(r: redis.Redis, job: str) -> int:
    return sum(1 for _, f in r.xrange(keys.events(job)) if f[b"kind"] == b"metric")


def sums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*")) if p.is_file()}


def stale(url: str, code: Path, tmp: Path) -> dict[str, object]:
    """The frozen driver of attempt 1 continued after attempt 2 succeeded (module doc)."""
    r = redis.Redis.from_url(url)
    job = f"1a24b{os.getpid():07x}-{int(time.time()) % 16**6:06x}"
    spec = build_spec(SPEC).model_dump_json(exclude_defaults=True)
    env = {**os.environ, "REDIS_URL": url, "TLAB_STORAGE": str(tmp), "TLAB_SANDBOX": "off",
           "TLAB_CHECKPOINT_EVERY_S": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}

    def run(attempt: int) -> subprocess.Popen:
        r.hset(keys.job(job), mapping={"spec": spec, "state": "running", "attempts": str(attempt)})
        with (tmp / f"attempt-{attempt}.log").open("wb") as out:
            return subprocess.Popen([sys.executable, "-m", "workers.run", "--job", job], env=env, cwd=code,
                                    start_new_session=True, stdout=out, stderr=subprocess.STDOUT)

    old = run(1)
    while epochs(r, job) < 3:
        assert old.poll() is None, "attempt 1 ended before it could be frozen"
        time.sleep(0.05)
    os.killpg(old.pid, signal.SIGSTOP)
    r.hset(keys.job(job), "state", "queued")
    assert run(2).wait(600) == 0, (tmp / "attempt-2.log").read_text()[-2000:]
    r.hset(keys.job(job), "state", "succeeded")
    before = sums(tmp / job / "artifacts"), r.hget(keys.job(job), "summary"), r.xlen(keys.events(job))
    t = time.monotonic()
    os.killpg(old.pid, signal.SIGCONT)
    code_ = old.wait(600)
    after = sums(tmp / job / "artifacts"), r.hget(keys.job(job), "summary"), r.xlen(keys.events(job))
    return {"exit": code_, "seconds_to_exit": round(time.monotonic() - t, 2),
            "artifacts_changed": before[0] != after[0], "summary_changed": before[1] != after[1],
            "events_added": after[2] - before[2]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout whose code runs the stale case too")
    parser.add_argument("--rounds", type=int, default=2000, help="event batches per variant")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            print(f"writes: {args.rounds} rounds of each ...", flush=True)
            cost = writes(url, args.rounds)
            cases = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
            runs = {}
            for name, code in cases.items():
                (Path(tmp) / name).mkdir()
                print(f"stale attempt, {name} code ({code}): two drivers, one frozen ...", flush=True)
                runs[name] = stale(url, code, Path(tmp) / name)
        finally:
            proc.kill()
    print_table(["write", "median µs"], [[k, f"{v:.0f}"] for k, v in cost.items()])
    print_table(["code", "exit", "s to exit", "artifacts changed", "summary changed", "events added"],
                [[k, v["exit"], v["seconds_to_exit"], v["artifacts_changed"], v["summary_changed"], v["events_added"]]
                 for k, v in runs.items()])
    write_result("fencing", {"writes_us": cost, "stale_after_success": runs, "load": os.getloadavg()[0]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
