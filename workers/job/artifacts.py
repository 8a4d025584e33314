"""A job's artifacts: what its owner takes home, under ``<TLAB_STORAGE>/<job>/artifacts/``.

Written by the job's driver once training ends, however it ends (succeeded, failed, or stopped by a cancel or
its time limit: SIGTERM gives it the grace period), from the last checkpoint Ray Train kept:

- ``model.safetensors``: the model's state_dict as safetensors (data, never code; tied weights stored once
  per name, so ``safetensors.torch.load_file`` then ``model.load_state_dict`` gives the model back);
- ``checkpoint.pt``: that checkpoint (``torch.load(..., weights_only=True)``), to go on from;
- ``metrics.csv``: one row per epoch; ``summary.json``: the run's summary (``workers.train.loop.summarize``);
- whatever the training code wrote to ``ctx.artifacts_dir`` (the same directory);
- ``SHA256SUMS``: every file's SHA-256, written last (``record_digests``), which the API lists so that it never
  reads a file to list it. Bounded: a file over ``HASH_FILE_MAX`` bytes, or past ``HASH_EXPORT_MAX`` in all, is
  not hashed (a comment line names it); no link is followed, only regular files are read. An experiment's
  export runs in its sandbox; its supervisor, on the trusted side, then writes SHA256SUMS again from the files as
  they are once the payload has ended (``workers.on_ray.supervisor``), so the digests the API lists are the
  service's own.

Each file is written to a hidden temporary name and renamed, so a reader never sees half a file. A job's attempt
exports from the checkpoints it wrote (an earlier attempt's only while it wrote none, a later one's never) into a
staging directory of its own, ``<job>/.export-<attempt>``; its supervisor promotes the files into ``artifacts/`` only
while the attempt is still the job's current one (``promote``, ``workers.job.fence``).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from api_schemas import ExperimentSpec
from api_schemas.artifacts import HASH_EXPORT_MAX, HASH_FILE_MAX, SUMS

ARTIFACTS = "artifacts"
CHECKPOINT_FILE = "checkpoint.pt"  # workers.train.context writes it; torch is imported only when exporting
EXPORTED = (CHECKPOINT_FILE, "model.safetensors", "metrics.csv", "summary.json")
CHUNK = 1 << 20
NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def artifacts_dir(storage: str | Path, run_name: str) -> Path:
    """``<storage>/<run>/artifacts``: inside the run's own Ray Train directory."""
    return Path(storage) / run_name / ARTIFACTS


def checkpoints(run_dirs: list[Path]) -> list[Path]:
    """The runs' Ray Train checkpoint directories, newest first (their names carry the time)."""
    found = [p for d in run_dirs for p in d.glob("checkpoint_*") if (p / CHECKPOINT_FILE).is_file()]
    return sorted(found, key=lambda p: p.name, reverse=True)


def checkpoint_attempt(path: Path) -> int:
    """The job's attempt that wrote the checkpoint ``path`` (its ``meta.json``; 0 when it says none)."""
    try:
        with os.fdopen(os.open(path / "meta.json", NOFOLLOW), "rb") as f:
            found = json.loads(f.read(1 << 16)).get("attempt")
    except (OSError, ValueError, AttributeError):
        return 0
    return found if isinstance(found, int) else 0


def of_attempt(found: list[Path], attempt: int | None) -> list[Path]:
    """Of ``found`` (newest first), what ``attempt`` may go on from or export: its own checkpoints first, then those of
    earlier attempts; never a later attempt's. All of them, as they are, when ``attempt`` is None."""
    if attempt is None:
        return found
    by = {p: checkpoint_attempt(p) for p in found}
    return [p for p in found if by[p] == attempt] + [p for p in found if by[p] < attempt]


def last_training_state(run_dirs: list[Path], attempt: int | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that holds a model (a diverged run's last one holds only its failure), of those
    ``attempt`` may take (``of_attempt``)."""
    from workers.train.context import read_checkpoint

    for path in of_attempt(checkpoints(run_dirs), attempt):
        state = read_checkpoint(path)
        if "model" in state:
            return path, state
    return None


def _write(path: Path, data: bytes) -> None:
    """``data`` to a hidden name beside ``path``, then renamed over it, relative to its directory opened without
    following a link (the supervisor writes SHA256SUMS into a directory its job could have turned into one)."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        tmp = f".{path.name}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def save_weights(state_dict: dict[str, Any], path: Path) -> None:
    """The state_dict as safetensors; each tensor cloned, since safetensors refuses tensors sharing memory
    (tied weights) and a checkpoint loaded back keeps the sharing."""
    from safetensors.torch import save_file
    from torch import Tensor

    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items() if isinstance(v, Tensor)}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def metrics_csv(history: list[dict[str, Any]]) -> str:
    """One row per epoch record; columns in the order they first appear."""
    columns = list(dict.fromkeys(k for row in history for k in row if k != "kind"))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def export(spec: ExperimentSpec, run_dirs: list[Path], out: Path, extra: dict[str, Any] | None = None,
           attempt: int | None = None) -> list[str]:
    """Write the artifacts of the run whose checkpoints are in ``run_dirs`` (a PBT trial trains in several) to
    ``out``, then their digests (``record_digests``); returns the names written ([] with no checkpoint yet: the
    digests of what the run's code wrote there are recorded all the same). ``extra`` goes into summary.json.
    ``attempt``: the job's attempt exporting (``of_attempt``: from its own checkpoints)."""
    from workers.train.shared import summarize

    found = last_training_state(run_dirs, attempt)
    if found is None:
        if out.is_dir():
            record_digests(out)
        return []
    path, state = found
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{CHECKPOINT_FILE}.tmp"
    shutil.copyfile(path / CHECKPOINT_FILE, tmp)
    os.replace(tmp, out / CHECKPOINT_FILE)
    save_weights(state["model"], out / "model.safetensors")
    history = list(state.get("history", []))
    _write(out / "metrics.csv", metrics_csv(history).encode())
    summary = summarize(history, spec.training.target_loss, int(state.get("teleport_batches", 0)))
    summary.update(complete=len(history) >= spec.training.epochs, epochs_planned=spec.training.epochs,
                   **(extra or {}))
    _write(out / "summary.json", (json.dumps(summary, indent=2, default=float) + "\n").encode())
    record_digests(out)
    return [*EXPORTED, SUMS]


def staging_dir(out: Path, attempt: int) -> Path:
    """Where ``attempt`` exports before its supervisor promotes the files into ``out`` (beside it, hidden)."""
    return out.parent / f".export-{int(attempt)}"


def promote(staging: Path, out: Path, check: Callable[[], None]) -> list[str]:
    """Move the export's files from ``staging`` into ``out`` once ``check`` passed (it raises ``AttemptEnded`` for
    an attempt that ended: nothing is moved), then write ``out``'s digests; ``staging`` removed either way. The
    names moved."""
    moved: list[str] = []
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # (job-written: no link followed)
    try:
        src = os.open(staging, flags)
    except OSError:
        return moved
    try:
        check()
        out.mkdir(parents=True, exist_ok=True)
        dst = os.open(out, flags)
        try:
            for name in (*EXPORTED, SUMS):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.stat(name, dir_fd=src, follow_symlinks=False).st_mode):
                        os.replace(name, name, src_dir_fd=src, dst_dir_fd=dst)  # each whole, at once
                        moved.append(name)
        finally:
            os.close(dst)
        if moved:
            record_digests(out)
        return moved
    finally:
        os.close(src)
        remove_staged(staging)


PARTIAL_PREFIX = ".tmp-checkpoint_"  # a checkpoint being written: never matches ``checkpoint_*``, so never read


def partial_prefix(attempt: int | None) -> str:
    """The name a checkpoint being written starts with: an attempt's own (``.tmp-checkpoint_a<attempt>-``), so that
    its supervisor can remove what its killed payload left half-written, and nothing of another attempt."""
    return PARTIAL_PREFIX if attempt is None else f"{PARTIAL_PREFIX}a{int(attempt)}-"


def remove_own_partials(run_dir: Path, attempt: int) -> None:
    """Remove the half-written checkpoints ``attempt`` left in ``run_dir`` (its payload killed as it wrote one)."""
    for partial in run_dir.glob(f"{partial_prefix(attempt)}*"):
        remove_staged(partial)


def remove_staged(staging: Path) -> None:
    """Delete a staging directory without following a link in it (what an ended attempt left, too)."""
    from api_schemas.gate import Refused, remove_tree

    with contextlib.suppress(OSError, Refused):
        remove_tree(staging.parent, staging.name)


def record_digests(out: Path) -> list[str]:
    """Write ``out/SHA256SUMS`` (sha256sum's format) for the regular files below ``out``, the export's own first,
    hidden names left out; returns the names left unhashed (each named in a comment line, with why)."""
    lines = ["# SHA-256 of the artifacts as exported: `sha256sum -c SHA256SUMS` checks a pull"]
    skipped, budget = [], HASH_EXPORT_MAX
    for name, size in sorted(regular_files(out), key=lambda f: (f[0] not in EXPORTED, f[0])):
        odd = any(c in name for c in "\n\r\\")  # sha256sum would need its escapes: not listed
        why = ("its name holds a line break or backslash" if odd else f"over {HASH_FILE_MAX >> 30} GiB"
               if size > HASH_FILE_MAX else f"past the {HASH_EXPORT_MAX >> 30} GiB an export hashes"
               if size > budget else "")
        digest = None if why else _sha256(out, name, min(budget, HASH_FILE_MAX))
        if digest is None:
            skipped.append(name)
            shown = "a name with a line break" if "\n" in name or "\r" in name else name
            lines.append(f"# not hashed: {shown} ({size} bytes): {why or 'gone, or grew while it was hashed'}")
            continue
        budget -= size
        lines.append(f"{digest}  {name}")
    _write(out / SUMS, ("\n".join(lines) + "\n").encode())
    return skipped


def _sha256(out: Path, name: str, limit: int) -> str | None:
    """The SHA-256 of the regular file ``out/name`` (no link followed), or None: gone, no longer a regular file,
    or more than ``limit`` bytes read."""
    try:
        fd = _open_under(out, name)
    except OSError:
        return None
    h, seen = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.set_blocking(fd, True)
        while chunk := f.read(CHUNK):
            seen += len(chunk)
            if seen > limit:
                return None
            h.update(chunk)
    return h.hexdigest()


def _open_under(out: Path, name: str) -> int:
    """``out/name`` opened one component at a time from ``out``'s descriptor, none of them followed if a link
    (``OSError``: ELOOP or ENOTDIR)."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    *dirs, last = PurePosixPath(name).parts
    try:
        for part in dirs:
            fd, parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd), fd
            os.close(parent)
        return os.open(last, NOFOLLOW, dir_fd=fd)
    finally:
        os.close(fd)


def regular_files(out: Path, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(name under ``out``, size) of each regular file below ``out`` (its SHA256SUMS and hidden names left out),
    found without following a link: a linked directory is not entered, a link or special file not listed (a
    directory swapped for a link meanwhile: ``_open_under`` refuses its files)."""
    if not prefix and (out.is_symlink() or not out.is_dir()):
        return
    try:
        with os.scandir(out / prefix) as entries:
            found = sorted((e.name, e.stat(follow_symlinks=False)) for e in entries)
    except OSError:
        return
    for entry, st in found:
        name = f"{prefix}/{entry}" if prefix else entry
        if entry.startswith(".") or name == SUMS:
            continue
        if stat.S_ISDIR(st.st_mode):
            yield from regular_files(out, name)
        elif stat.S_ISREG(st.st_mode):
            yield name, st.st_size
