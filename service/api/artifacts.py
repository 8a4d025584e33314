"""A job's artifacts as the API serves them: the files under ``<TLAB_STORAGE>/<job>/artifacts/`` that its
driver wrote (``workers/job/artifacts.py``), plus its last Ray Train checkpoint as ``checkpoint.pt`` when the
driver could not export it (killed before it could). Storage is a local or shared filesystem path
(``TLAB_STORAGE``), or a bucket behind a local working copy: what the copy lacks is pulled first
(``service.core.storage``).

A name never leaves the job's directory: absolute names, ``..``, backslashes and NUL are refused (422). The job
writes this directory, so every file is opened under the storage root without following a link on any component
(``service.core.safe_files``): a link (``artifacts/`` itself one, or a file) or a special file is left out of the list,
and asked for by name it is 404 with one line, logged; a download is served from the descriptor that was checked.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import PurePosixPath

from api_schemas.artifacts import ArtifactView
from service.core import safe_files, storage
from service.core.checkpoints import checkpoint_dirs
from service.core.errors import InvalidInput, JobNotFound
from service.core.settings import Settings

ARTIFACTS = "artifacts"  # workers.job.artifacts.ARTIFACTS (the service does not import workers/)
CHECKPOINT = "checkpoint.pt"
CHUNK = 1 << 20
_digests: dict[tuple[str, str, int, int], str] = {}  # (root, name, size, mtime_ns) -> sha256: a file read once


def sha256(root: str, rel: str, st: os.stat_result) -> str:
    """The file's sha256, read through a descriptor opened without following links (cached by size and mtime)."""
    key = (root, rel, st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with os.fdopen(safe_files.open_file(root, rel), "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        _digests[key] = h.hexdigest()
    return _digests[key]


def view(name: str, root: str, rel: str, st: os.stat_result) -> ArtifactView:
    return ArtifactView(name=name, bytes=st.st_size, sha256=sha256(root, rel, st), modified_at=st.st_mtime)




def last_checkpoint(settings: Settings, job_id: str) -> tuple[str, os.stat_result] | None:
    """The newest ``checkpoint_*/checkpoint.pt`` Ray Train kept for the job (names carry the time): its name under
    the storage root and its stat; no link followed."""
    root = settings.storage_path
    for folder in reversed(checkpoint_dirs(settings, job_id)):
        rel = f"{job_id}/{folder}/{CHECKPOINT}"
        try:
            fd = safe_files.open_file(root, rel)
        except (FileNotFoundError, NotADirectoryError, safe_files.UnsafeFile):
            continue
        st = os.fstat(fd)
        os.close(fd)
        return rel, st
    return None


def hidden(name: str) -> bool:
    return any(part.startswith(".") for part in PurePosixPath(name).parts)


def listing(settings: Settings, job_id: str) -> list[ArtifactView]:
    """Every artifact, sorted by name (hidden files, half-written ones among them, and links left out)."""
    storage.sync_artifacts(settings, job_id)
    root, base = settings.storage_path, f"{job_id}/{ARTIFACTS}"
    try:
        found = list(safe_files.files(root, base))
    except safe_files.UnsafeFile:  # artifacts/ itself a link: logged, nothing listed
        found = []
    items = {name: view(name, root, f"{base}/{name}", st) for name, st in found if not hidden(name)}
    if CHECKPOINT not in items and (ckpt := last_checkpoint(settings, job_id)) is not None:
        items[CHECKPOINT] = view(CHECKPOINT, root, *ckpt)
    return [items[k] for k in sorted(items)]


def check_name(name: str) -> PurePosixPath:
    """A relative '/'-separated name without ``..``: else 422 naming ``name``."""
    rel = PurePosixPath(name)
    if not name or "\x00" in name or "\\" in name or rel.is_absolute() or ".." in rel.parts:
        raise InvalidInput(f"artifact name {name[:80]!r}: give a name from the job's artifact list (relative, "
                           "no '..', no backslash)", field="name")
    return rel


def open_artifact(settings: Settings, job_id: str, name: str) -> int:
    """A descriptor of the regular file behind an artifact name, opened without following links; 404 if there is
    none (or it is a link: ``safe_files.UnsafeFile``, a 404 too)."""
    rel = check_name(name)
    storage.sync_artifacts(settings, job_id)
    root = settings.storage_path
    if not hidden(name):
        try:
            return safe_files.open_file(root, f"{job_id}/{ARTIFACTS}/{rel.as_posix()}")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            pass
        except safe_files.UnsafeFile:
            if name != CHECKPOINT:
                raise
    if name == CHECKPOINT and (ckpt := last_checkpoint(settings, job_id)) is not None:
        return safe_files.open_file(root, ckpt[0])
    raise JobNotFound(f"experiment {job_id} has no artifact {name[:80]!r}: GET /v1/experiments/{job_id}/artifacts "
                      "lists them", field="name")
