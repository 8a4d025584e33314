"""The trusted side of a job's process: it starts the job's training as a payload in a sandbox
(``workers.payload`` under ``workers.job.sandbox``) and keeps what the payload must not have: the Ray connection, the
job's ticket, every other job's files.

- ``supervise``: what a Ray job's driver does for an experiment (``workers.run``): each try is one payload (rank 0,
  which leads a gang as ``workers.on_ray.gang`` does); a gang's other ranks are Ray tasks started here
  (``workers.on_ray.gang_start.Ranks``), watched while the payload runs: one that fails ends the try. A failure worth a
  retry goes on from the last checkpoint, at most ``max_failures`` times, as ``workers.on_ray.tries.run_in_driver``.
- ``supervise_rank``: what a gang rank's Ray task does: one payload that joins the gang.

No torch here: the payload is started before anything imports it (start-up stays as it was: one import of torch,
in the payload). A SIGTERM (Ray's stop) reaches the payload from Ray too; the supervisor forwards it (a payload takes
one stop) and waits for the payload to save and export, within Ray's grace period.

Fencing (``workers.job.fence``): each try carries the job's attempt this process pinned. While the payload runs, a
``Keepalive`` kills it once the attempt ended (or Redis was lost for ``TLAB_ATTEMPT_LEASE_S``); the payload's
records and its checkpoints' renames pass the attempt's check; its export is staged and promoted into ``artifacts/``
only after the check passed (``workers.job.artifacts.promote``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from api_schemas import ExperimentSpec
from api_schemas.reasons import killed_by, one_line
from workers.job import job_user, sandbox
from workers.job.artifacts import record_digests, remove_own_partials
from workers.job.fence import AttemptEnded, Keepalive, attempt_ended, attempt_fence, clear_staged, kill_tree, pinned
from workers.job.fence import promote_export as promote_export_of
from workers.job.logs import StderrTail
from workers.job.memory_limit import MemoryLimit, first_to_go
from workers.job.orders import Orders, Outcome, split_result
from workers.job.pipe_sink import start_relay
from workers.job.redis_sink import RedisSink

# (gang_start's rank task imports this module back, when it runs on its node: the declared trampoline)
from workers.on_ray.gang_start import Ranks
from workers.train.failure import JobFailed
from workers.train.startup import adopt

WATCH_S = 0.2  # how often the supervisor looks at the gang's other ranks while its payload runs
MAX_ACCOUNT = 4 << 20  # bytes of a payload's account of how it ended (its summary) the supervisor reads
MAX_REPORT_LINE = 1 << 20  # bytes of one trial report (metrics and a checkpoint's name)
RECORDS_WAIT_S = 30.0  # how long the supervisor waits, after its payload ended, to write the records it sent
PUSH_EVERY_S = 10.0  # with a bucket: the job directory is uploaded this often while the payload runs


def user_code(spec: ExperimentSpec) -> bool:
    return bool(spec.user_code_fields())


def refuse_unsandboxed(spec: ExperimentSpec) -> None:
    """A job whose code would run outside a sandbox (Ray Train's workers: ``TLAB_IN_DRIVER=0``) fails at start,
    with one line, unless the admin turned the sandbox off."""
    if user_code(spec) and not sandbox.turned_off():
        raise sandbox.SandboxRefused("TLAB_IN_DRIVER=0 trains in Ray Train's workers, where no sandbox holds your "
                                     f"code: unset it, or the admin sets {sandbox.SETTING}=off, knowingly")


def mounts(spec: ExperimentSpec, job_dir: Path, start_from: str | None) -> sandbox.Mounts:
    """The job directory (read-write); its code, data and start checkpoint, each checked again here (the API
    checked the data at submit): data only under the data roots, nothing that holds the service's home or the
    storage root (``sandbox.allowed``)."""
    hidden = sandbox.hidden_dirs()
    code = [sandbox.allowed(p, "the job's code directory", hidden) for p in code_dirs(spec)]
    data = [sandbox.allowed(Path(p), f"dataset.{name}", hidden, sandbox.data_roots())
            for name, p in (("root", spec.dataset.root), ("path", spec.dataset.path)) if p and Path(p).is_absolute()]
    readable = [*code, *data, *([Path(start_from)] if start_from else [])]
    return sandbox.Mounts(writable=job_dir, readable=readable, hidden=hidden, workdir=code[0] if code else None)


def code_dirs(spec: ExperimentSpec) -> list[Path]:
    """Where the job's package is: what Ray put on ``PYTHONPATH`` (its ``working_dir``, first; a Tune trial runs in
    its trial's directory, not there), else this directory."""
    if spec.code is None or not spec.code.package:
        return []
    on_path = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.isdir(p)]
    return on_path or [Path.cwd()]


def payload_argv(spec: ExperimentSpec, job_dir: Path, start_from: str | None) -> tuple[list[str], dict[str, str]]:
    """The payload's command line (in bwrap when ``sandbox.required``, as the uid of the directory's name: the job's,
    or a sweep trial's) and the environment to start it with; the job directory made the payload's, its code and
    start checkpoint readable by it."""
    command = [sys.executable, "-m", "workers.payload"]
    box = mounts(spec, job_dir, start_from)
    env = sandbox.payload_env(os.pathsep.join(str(p) for p in code_dirs(spec)))
    job_dir.mkdir(parents=True, exist_ok=True)
    if not sandbox.required(user_code(spec)):
        return command, {**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    uid, gid = job_user.payload_ids(job_dir.name)
    job_user.own_job_dir(job_dir, uid, gid)
    job_user.readable_code([*code_dirs(spec), *([Path(start_from)] if start_from else [])])
    return sandbox.bwrap_argv(command, env, box, uid), {}  # bwrap's own, none: the sandbox reads its /proc/1/environ


def before_payload(procs: int) -> Callable[[], None]:
    """What the payload's process does before it starts: SIGTERM ignored (bwrap dies of one and takes the payload
    with it: Ray's stop), the kernel's first OOM victim (``workers.job.memory_limit``), at most ``procs`` processes
    for its uid, the umask that keeps its files its own (``workers.job.job_user``), and SIGKILL when its supervisor
    dies (a Ray worker ended with its node: fencing; bwrap's ``--die-with-parent`` does the same inside)."""

    def before() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        die_with_parent()
        first_to_go()
        job_user.limit_processes(procs)

    return before


def die_with_parent() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)`` for this process (Linux; elsewhere nothing)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_payload(orders: Orders, argv: list[str], env: dict[str, str], ranks: Ranks | None = None,
                relay: Callable[[bytes], None] | None = None) -> Outcome:
    """Start the payload, hand it its orders, wait (watching ``ranks``; ``relay``: each line it reports, answered
    once handled: ``workers.on_ray.trial_bridge``), and read how it ended."""
    read_fd, orders.result_fd = os.pipe()
    lines = answers = records = None
    if relay is not None:
        (lines, orders.report_fd), (orders.answer_fd, answers) = os.pipe(), os.pipe()
    fence = attempt_fence(orders)
    if orders.rank == 0 and orders.redis_url:  # its records, written by this process (``workers.job.pipe_sink``)
        orders.records_fd, orders.answers_fd, records = start_relay(
            RedisSink(orders.redis_url, orders.job_id, trial=orders.trial, attempt=orders.attempt),
            fence.check if fence else None)
    theirs = [fd for fd in (orders.result_fd, orders.report_fd, orders.answer_fd, orders.records_fd,
                            orders.answers_fd) if fd is not None]
    shared = [orders.listen_fd] if orders.listen_fd is not None else []  # (the gang's socket stays its Ranks')
    err_read, err_write = os.pipe()
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stderr=err_write, pass_fds=theirs + shared,
                            preexec_fn=before_payload(job_user.process_cap()))
    os.close(err_write)
    said = StderrTail(err_read)
    memory = MemoryLimit(json.loads(orders.spec)["resources"].get("memory_gb")).start(proc.pid)
    keepalive = Keepalive(fence, lambda why: kill_tree(proc, why)).start() if fence else None
    for fd in theirs:
        os.close(fd)
    try:
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps({**asdict(orders), "redis_url": ""}).encode())  # (no Redis login for it)
            proc.stdin.close()
        except BrokenPipeError:  # it ended before it read its orders (it never started): how it ended says why
            with contextlib.suppress(OSError):
                proc.stdin.close()
        if relay is not None and lines is not None and answers is not None:
            relayed(relay, lines, answers)
        rank_ended = wait(proc, ranks, orders)
    except BaseException:  # a stop (SIGTERM raised here): the payload saves and exports, then ends
        stop(proc)
        raise
    finally:
        memory.close()
        if keepalive is not None:
            keepalive.close()
        with os.fdopen(read_fd, "rb") as result:  # (job-written: read within a bound)
            raw = result.read(MAX_ACCOUNT).decode(errors="replace")
        if records is not None:  # its last records written (a child of it still holding the pipe: not waited for)
            records.join(timeout=RECORDS_WAIT_S)
        orders.records_fd = orders.answers_fd = None
        job_user.strip_setid(Path(orders.scratch or Path(orders.storage) / orders.job_id))
        if fence is not None and orders.rank == 0 and orders.artifacts:
            promote_export_of(orders.job_id, Path(orders.artifacts), orders.attempt, fence)
    ended = attempt_ended(fence, keepalive)
    if ended and orders.rank == 0 and orders.attempt is not None and orders.kind == "train":
        remove_own_partials(Path(orders.storage) / orders.job_id, orders.attempt)  # killed mid-write: its own only
    if ended:  # whatever the payload said: nothing more of this attempt is written, nor retried
        return Outcome(error=ended, ended=True)
    if memory.error:  # killed over resources.memory_gb: the job's own failure, not retried
        return Outcome(error=memory.error)
    started, raw = split_result(raw)
    done = outcome(raw, rank_ended)
    return done if done is not None else unreported(proc.returncode, said.last_line(), started)


def relayed(relay: Callable[[bytes], None], lines: int, answers: int) -> None:
    """Each line the payload reports, handled and answered, until it closes its end; a line over
    ``MAX_REPORT_LINE`` ends the try (job-written: never read whole)."""
    with os.fdopen(lines, "rb") as reports, os.fdopen(answers, "wb") as out:
        while line := reports.readline(MAX_REPORT_LINE + 1):
            if len(line) > MAX_REPORT_LINE:
                raise JobFailed(f"the training process reported a line over {MAX_REPORT_LINE} bytes")
            relay(line)
            out.write(b"ok\n")
            out.flush()


def wait(proc: subprocess.Popen, ranks: Ranks | None, orders: Orders) -> Outcome | None:
    """Until the payload ends; a rank of its gang that fails first ends it, and how it ended is returned."""
    from workers.job.bucket import push

    pushed = time.monotonic()
    while proc.poll() is None:
        if ranks is not None and ranks.refs:
            failed = rank_failure(ranks)
            if failed:
                stop(proc)
                return failed
        try:
            proc.wait(timeout=WATCH_S)
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() - pushed > PUSH_EVERY_S:  # (nothing without a bucket)
            push(orders.storage, orders.job_id)
            pushed = time.monotonic()
    return None


def rank_failure(ranks: Ranks) -> Outcome | None:
    """How a rank that ended with an error ended (None while none did): retried unless the error was the job's
    own (``JobFailed``: a retry would meet it again)."""
    import ray

    done, ranks.refs = ray.wait(ranks.refs, num_returns=len(ranks.refs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as err:
            from workers.train.failure import failure_reason

            return Outcome(error=f"a rank of the gang failed: {failure_reason(err)}",
                           retried=not isinstance(err, JobFailed))  # (Ray's error is an instance of its cause's)
    return None


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the payload (bwrap's child), then SIGKILL after ``grace_s`` (Ray's own stop comes first)."""
    import psutil

    try:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.send_signal(signal.SIGTERM)
    except psutil.Error:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def outcome(raw: str, rank_ended: Outcome | None) -> Outcome | None:
    """The payload's own account, or the gang rank's that ended it; None: neither (``unreported``)."""
    if raw:
        done = Outcome(**json.loads(raw))
        adopt(done.startup)  # the start-up timeline: the payload's phases are the job's
        return rank_ended if rank_ended and done.summary is None else done
    return rank_ended


def unreported(code: int | None, said: str, started: bool = True) -> Outcome:
    """A payload that ended without its account: its exit status in words and the last line it wrote to stderr
    (``said``: a Python that could not start it, say); killed by SIGKILL: its memory, likely, whatever it said last.
    Retried unless it exited before it ``started`` (bwrap refused, an import failed): a retry would meet the same."""
    how = f"signal {-code}" if code is not None and code < 0 else f"exit status {code}"
    said = one_line(said)
    if killed_by(code) == signal.SIGKILL:
        why = " (killed: out of memory?)" + (f"; its last line: {said}" if said else "")
    else:
        why = f": {said}" if said else " and said nothing"
    if not started and killed_by(code) is None:
        return Outcome(error=f"the training process could not start, exit status {code}{why}; not retried (a retry "
                             "would meet the same)", retried=False)
    return Outcome(error=f"the training process ended with {how}{why}", retried=True)


def supervise(spec: ExperimentSpec, job_id: str, redis_url: str, storage: str, max_failures: int,
              artifacts: Path | None, start_from: Path | None, placement: list[str],
              ranks: Ranks | None = None) -> dict[str, Any]:
    """Train ``spec``: a payload per try, retried from the last checkpoint; the summary (see the module). A gang's
    ranks start from what its first ranks were given (``Ranks.start_from``: decided once, in this driver), rank 0
    too."""
    start_from = ranks.start_from if ranks is not None else start_from
    argv, env = payload_argv(spec, Path(storage) / job_id, str(start_from) if start_from else None)
    failures, attempt = 0, pinned(job_id)
    clear_staged(Path(storage) / job_id, attempt)
    while True:
        if spec.resources.workers > 1 and ranks is None:  # a retry starts its own
            ranks = Ranks(spec, job_id, redis_url, storage, placement, artifacts, start_from)
        orders = Orders(spec.model_dump_json(), job_id, redis_url, storage, -1, str(artifacts) if artifacts else None,
                        str(start_from) if start_from else None, attempt=attempt)
        if ranks is not None:
            orders.host, orders.port, orders.listen_fd = ranks.host, ranks.port, ranks.sock.fileno()
        try:
            done = run_payload(orders, argv, env, ranks)
        finally:
            if ranks is not None:
                ranks.stop()
            ranks = None
        if done.ended:
            raise AttemptEnded(done.error)
        if done.summary is not None:
            if artifacts is not None and artifacts.is_dir() and not artifacts.is_symlink():
                record_digests(artifacts)  # the service's own digests of what the job exported (bounded)
            return done.summary
        failures += 1
        if done.stopped:
            raise KeyboardInterrupt(done.error)  # (not reached: the supervisor's own SIGTERM raised first)
        if not done.retried or failures > max_failures:
            raise JobFailed(done.error)
        retry_note(redis_url, job_id, failures, max_failures, done.error)


def retry_note(redis_url: str, job_id: str, failures: int, max_failures: int, error: str) -> None:
    note = f"retry {failures} of TLAB_MAX_FAILURES={max_failures} from the last checkpoint after: {error}"
    print(note, file=sys.stderr, flush=True)
    sink = RedisSink(redis_url, job_id)
    sink.emit({"kind": "log", "level": "warning", "message": note})
    sink.close()


def supervise_rank(spec_json: str, job_id: str, redis_url: str, storage: str, rank: int, world: int, host: str,
                   port: int, artifacts: str | None, start_from: str | None = None) -> None:
    """A gang rank's Ray task: its payload joins the gang (``workers.on_ray.gang``); its log kept as ``rank-<k>``.
    ``start_from``: the checkpoint the driver decided the job starts from (never read from the job's own keys),
    checked again on this node (``workers.job.start_from.resolve_start``)."""
    from workers.job.fence import pin
    from workers.job.logs import capture
    from workers.job.record import attempt_of
    from workers.job.start_from import resolve_start

    attempt = attempt_of(redis_url, job_id)
    pin(job_id, attempt, redis_url)
    with capture(storage, job_id, f"rank-{rank}", attempt):
        spec = ExperimentSpec.model_validate_json(spec_json)
        start = resolve_start(storage, job_id, start_from)
        argv, env = payload_argv(spec, Path(storage) / job_id, str(start) if start else None)
        orders = Orders(spec_json, job_id, redis_url, storage, -1, artifacts, str(start) if start else None,
                        rank=rank, host=host, port=port, attempt=attempt)
        done = run_payload(orders, argv, env)
        if done.summary is None:  # the job's own error (its memory, its code) fails the job; anything else a try
            raise (JobFailed if not done.retried and not done.stopped else RuntimeError)(done.error)


def supervise_preflight(job_id: str, redis_url: str, storage: str) -> int:
    """A preflight's Ray job: ``workers.job.preflight_check.run_preflight`` (the user's code: import, build, one
    step) as a payload in the job's sandbox; 0 when it wrote a verdict, as before."""
    import redis

    from workers.job.harness import load_job_spec
    from workers.job.preflight_check import record_verdict
    from workers.job.record import job_field

    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        spec, sweep = load_job_spec(client, job_id), job_field(client, job_id, "sweep")
    argv, env = payload_argv(spec, Path(storage) / job_id, None)
    done = run_payload(Orders(spec.model_dump_json(), job_id, redis_url, storage, -1, kind="preflight",
                              sweep=sweep or None), argv, env)
    if done.summary is None:
        print(f"preflight: {done.error}", file=sys.stderr, flush=True)
        return 1
    record_verdict(redis_url, job_id, done.summary.get("preflight"))  # checked, then written by this process
    return 0
