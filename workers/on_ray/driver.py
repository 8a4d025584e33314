"""A job trains in its Ray job's driver: the same loop, no Ray Train controller or worker group (several
workers: the driver is rank 0 of a gang it leads, ``workers.on_ray.gang``).

A single rank needs no process group, so ``run_in_driver`` runs ``workers.train.loop.train`` right in the
driver process (Ray gives the entrypoint the job's CPUs and GPUs: ``service.launch.ray_cluster.RayJobs.submit``)
and does by hand the three things Ray Train did for it:

- checkpoints: ``DriverContext.save`` writes ``<storage>/<job>/checkpoint_<time>/`` in Ray Train's own layout
  and naming (``checkpoint.pt`` + ``meta.json``; written to a hidden directory, then renamed, so a kill never
  leaves half a checkpoint) and keeps the last ``TLAB_KEEP_CHECKPOINTS``; ``restore`` reads the newest, so
  ``workers.job.artifacts`` exports them and a job that changes path on a retry goes on from where it was;
- retries: a failure other than a deterministic one goes on from the last checkpoint, at most
  ``max_failures`` times (Ray Train's ``FailureConfig``); a diverged run ends as failed, as ``train_worker``;
- the summary: the loop's own, which is what its last checkpoint reported (Ray Train's ``result.metrics``).

Each epoch and teleport batch still reaches the job's stream once: the ``RedisSink`` deduplicates them
(``workers.train.sinks.identity``), so a retry that redoes an epoch does not report it twice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from api_schemas import ExperimentSpec
from workers.job.artifacts import PARTIAL_PREFIX, checkpoint_attempt, checkpoints, last_training_state, partial_prefix
from workers.job.bucket import pull_checkpoint, push_later
from workers.job.fence import AttemptEnded
from workers.job.redis_sink import RedisSink
from workers.job.start_from import start_checkpoint  # noqa: F401 (its old home: ``workers.job.start_from``)
from workers.train.context import (
    CheckpointRefused,
    RunContext,
    checkpoint_every_s,
    detached_copy,
    keep_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from workers.train.failure import JobFailed, out_of_space
from workers.train.gpu_share import device_report, oom_named
from workers.train.sinks import MetricSink
from workers.train.startup import mark

# errors that a retry from the checkpoint would only repeat: a bad spec, the user's code not importing, a refused
# checkpoint, a failure already explained; anything else (a lost connection, a full disk, a CUDA error) is retried
NOT_RETRIED: tuple[type[BaseException], ...] = (
    ValueError, TypeError, LookupError, AttributeError, NameError, ImportError, SyntaxError, NotImplementedError,
    CheckpointRefused, JobFailed, AttemptEnded,
)


def checkpoint_name() -> str:
    """Ray Train's own name for a checkpoint (``checkpoint_<date>_<time>.<µs>``): the two kinds sort together."""
    return f"checkpoint_{datetime.today().strftime('%Y-%m-%d_%H-%M-%S.%f')}"


class CheckpointWriter:
    """One background thread that writes checkpoints in the order they were saved, one at a time.

    Measured (benchmarks/ray_overhead.py, digits MLP [512, 512], 51-ms epochs): writing each epoch's checkpoint
    in the loop cost ~3 ms an epoch (6 %), and an upload to a bucket 60-200 ms. Here the loop pays a copy of the
    state (``detached_copy``) and waits only when the previous write has not finished. A write's error is raised
    by the next ``submit`` or by ``flush``; a stop (SIGTERM raises in the main thread, maybe while it waits) does
    not interrupt a write, which stays pending until a ``flush`` has seen it end, so the flush before the process
    ends leaves the last one on disk. Bucket uploads run on a thread of their own (``workers.job.bucket.push_later``).
    A kill leaves at most a hidden half-written directory, dropped by the next run (``DriverContext.drop_partial``)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tlab-checkpoint")
        self._pending: Future[None] | None = None

    def submit(self, write: Callable[[Any], None], item: Any) -> None:
        self.flush()
        self._pending = self._pool.submit(write, item)

    def flush(self) -> None:
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:  # a stop raised while waiting leaves the write pending: the next flush waits for it again
            if pending.done():
                self._pending = None


@dataclass
class HeldCheckpoint:
    """A saved epoch's state (a copy), named by its save time, and whether it went to the writer yet."""

    name: str
    state: dict[str, Any]
    submitted: bool = False


class DriverContext(RunContext):
    """One rank in the driver process: checkpoints under ``run_dir``, kept ``keep`` at a time."""

    def __init__(self, sink: MetricSink, run_dir: str | Path, *, device: torch.device | None = None,
                 artifacts_dir: str | Path | None = None, keep: int | None = None,
                 start_from: Path | None = None, rank: int = 0, world_size: int = 1, attempt: int | None = None,
                 fence: Callable[[], None] | None = None) -> None:
        """``start_from``: another run's checkpoint directory to start from while this run has none of its own
        (a continued or forked job: ``start_checkpoint``). ``rank``/``world_size``: a rank of a driver-led gang
        (``workers.on_ray.gang``); rank 0 is the run directory's only writer. ``attempt``: the job's attempt this
        run is, stamped on its checkpoints; ``fence``: raises ``AttemptEnded`` once it is no longer the job's
        current one (``workers.job.fence``), asked before each checkpoint is renamed into place."""
        super().__init__(device=device or torch.device("cpu"), sink=sink, rank=rank, world_size=world_size)
        self.run_dir = Path(run_dir)
        self.start_from = start_from
        self.attempt, self.fence = attempt, fence
        self.keep = keep_checkpoints() if keep is None else keep
        self.every_s = checkpoint_every_s()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._writer: CheckpointWriter | None = None
        self._recent: deque[HeldCheckpoint] = deque(maxlen=self.keep)  # the last saves (``save``)
        self._last_write = -float("inf")
        if self.is_chief:
            if fence is not None:  # an ended attempt touches nothing here, not even what another left staged
                fence()
            self.drop_partial()  # what a kill left mid-write (and what an ended attempt staged: fencing)
        if artifacts_dir is not None:
            self.artifacts_dir = Path(artifacts_dir)
            self.artifacts_dir.mkdir(parents=True, exist_ok=True)

    def checkpoints(self) -> list[Path]:
        """This run's complete checkpoints, newest first (``workers.job.artifacts.checkpoints``)."""
        return checkpoints([self.run_dir])

    def rotated(self) -> list[Path]:
        """The checkpoints past the last ``keep`` that this run may delete: never a later attempt's."""
        mine = [p for p in self.checkpoints() if self.attempt is None or checkpoint_attempt(p) <= self.attempt]
        return mine[self.keep:]

    def drop_partial(self) -> None:
        """Remove half-written checkpoints (this process is the run directory's only writer)."""
        for partial in self.run_dir.glob(f"{PARTIAL_PREFIX}*"):
            shutil.rmtree(partial, ignore_errors=True)

    def save(self, state: dict[str, Any], metrics: dict[str, Any]) -> None:
        """Write the checkpoint in the background (``CheckpointWriter``): the loop goes on with the next epoch
        while a copy of ``state`` is written, rotated and (with a bucket) uploaded; one write at a time, in order.

        Within ``every_s`` of the last write (``TLAB_CHECKPOINT_EVERY_S``) the copy is only held: the last ``keep``
        copies are, each named by its save time, and ``flush`` (the run's end, a stop, a failure) writes those not
        written yet, so an ended run keeps its last ``keep`` epochs as before (what continue and fork name); only a
        kill loses the interval. Measured (digits MLP [512, 512], 1 CPU, 60-ms epochs): writing its 1.2-MB state
        costs ~1.5-2 ms of CPU (torch.save, the file, the rotation), the copy 0.13 ms. A failure's marker
        (``{"failed": ...}``) is written at once, after the copies held before it."""
        entry = HeldCheckpoint(checkpoint_name(), detached_copy(state))
        self._recent.append(entry)
        if "failed" in state:
            self._write_held()
        elif time.monotonic() - self._last_write >= self.every_s:
            self._submit(entry)  # the copies held before it are written only if a flush still holds them

    def flush(self) -> None:
        """Write the held copies, if any, and wait until every checkpoint saved so far is on disk."""
        self._write_held()
        if self._writer is not None:
            self._writer.flush()

    def _write_held(self) -> None:
        for entry in self._recent:  # oldest first (their names sort the same way whenever they are written)
            if not entry.submitted:
                self._submit(entry)

    def _submit(self, entry: HeldCheckpoint) -> None:
        if self._writer is None:
            self._writer = CheckpointWriter()
        self._last_write = time.monotonic()
        self._writer.submit(self._write, entry)
        entry.submitted = True  # marked once submitted: a stop raised in ``submit`` leaves it to the next flush

    def _write(self, entry: HeldCheckpoint) -> None:
        tmp: Path | None = None  # (a stop between mkdtemp's mkdir and its return leaves one to the next run's start)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=partial_prefix(self.attempt), dir=self.run_dir))
            tmp.chmod(0o750)  # (mkdtemp's 0700) a child run, another uid of the jobs' group, may start from it
            write_checkpoint(entry.state, tmp, self.attempt)
            if self.fence is not None:  # an ended attempt's checkpoint is never renamed into place
                self.fence()
            final = self.run_dir / entry.name  # the save's time: a copy held, then written, sorts in epoch order
            while final.exists():  # two saves within one microsecond
                final = self.run_dir / checkpoint_name()
            os.rename(tmp, final)  # atomic on one filesystem: readers see all of it or none
            mark("checkpoint")  # the first one: the start-up timeline (``workers.train.startup``)
        except Exception as err:  # a full disk: the previous checkpoint stays, and the job ends saying so
            full = out_of_space(err, self.run_dir, self.checkpoints())  # (before the partial one goes)
            drop(tmp)  # its own only: another attempt's may be in flight beside it
            if full is None:
                raise
            raise full from err
        except BaseException:  # a stop in the middle: leave nothing half-written (a kill leaves it to the next run)
            drop(tmp)
            raise
        for old in self.rotated():
            shutil.rmtree(old, ignore_errors=True)
        if self.is_chief:  # with a bucket: uploaded on a thread no flush waits for (``workers.job.bucket``)
            push_later(self.run_dir.parent, self.run_dir.name)

    def restore(self) -> dict[str, Any] | None:
        """The newest checkpoint of this run that holds a model (a diverged run's last one holds only its
        failure; with none here, the bucket's newest when storage is one); with none, the one it was told to start
        from (if any)."""
        pull_checkpoint(self.run_dir.parent, self.run_dir.name)  # the bucket's, when newer than any here
        found = last_training_state([self.run_dir], self.attempt)
        if found is None and self.start_from is not None:
            return read_checkpoint(self.start_from)
        return None if found is None else found[1]


def drop(partial: Path | None) -> None:
    if partial is not None:
        shutil.rmtree(partial, ignore_errors=True)


def retried(err: BaseException, never: tuple[type[BaseException], ...] = ()) -> bool:
    """Whether a failure is worth another try from the last checkpoint (``never``: more types that are not)."""
    return isinstance(err, Exception) and not isinstance(err, (*NOT_RETRIED, *never))


def attempt(spec: ExperimentSpec, ctx: DriverContext) -> dict[str, Any]:
    """One try of the loop: its summary, which is what its last checkpoint reported (even when a retry had no
    epoch left to do); a diverged run's is ``{"failed": True, "reason": ...}``, as ``train_worker`` reports it."""
    from workers.train.loop import train
    from workers.train.shared import TrainingDiverged

    try:
        with oom_named(spec.resources):
            summary = train(spec, ctx)
    except TrainingDiverged as err:
        # it would diverge again from its last checkpoint: end the run as failed instead of a retry
        failed = {"failed": True, "reason": str(err)}
        ctx.save({"failed": str(err)}, failed)
        ctx.flush()
        return failed
    summary.pop("params")
    return {**summary, **device_report(ctx.device)}  # the device, the GPUs it saw, its peak GPU memory


def close_quietly(sink: RedisSink, record: dict[str, Any] | None = None) -> None:
    """Emit ``record`` and close the sink while another exception is on its way: a stop that arrived in the
    middle of a write can leave the connection unusable, and that must not hide why the run ended."""
    try:
        if record is not None:
            sink.emit(record)
        sink.close()
    except Exception:
        traceback.print_exc()


