"""A job's artifacts as the API serves them: the files under ``<TLAB_STORAGE>/<job>/artifacts/`` that its
driver wrote (``workers/artifacts.py``), plus its last Ray Train checkpoint as ``checkpoint.pt`` when the
driver could not export it (killed before it could). Storage is a local or shared filesystem path
(``TLAB_STORAGE``), or a bucket behind a local working copy: what the copy lacks is pulled first
(``service.storage``).

A name never leaves the job's directory: absolute names, ``..``, backslashes and NUL are refused (422), and
a name that resolves elsewhere (a symlink out) is not found (404).
"""

from __future__ import annotations

import hashlib
from pathlib import Path, PurePosixPath

from api_schemas.artifacts import ArtifactView
from service import storage
from service.errors import InvalidInput, JobNotFound
from service.settings import Settings

ARTIFACTS = "artifacts"  # workers.artifacts.ARTIFACTS (the service does not import workers/)
CHECKPOINT = "checkpoint.pt"
CHUNK = 1 << 20
_digests: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: a listing reads a file once


def run_dir(settings: Settings, job_id: str) -> Path:
    return Path(settings.storage_path).resolve() / job_id


def sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
        _digests[key] = h.hexdigest()
    return _digests[key]


def view(name: str, path: Path) -> ArtifactView:
    st = path.stat()
    return ArtifactView(name=name, bytes=st.st_size, sha256=sha256(path), modified_at=st.st_mtime)


def inside(path: Path, root: Path) -> bool:
    """Whether ``path`` (symlinks resolved) is ``root`` or under it."""
    return path.resolve().is_relative_to(root.resolve())


def last_checkpoint(settings: Settings, job_id: str) -> Path | None:
    """The newest ``checkpoint_*/checkpoint.pt`` Ray Train kept for the job (names carry the time)."""
    root = run_dir(settings, job_id)
    found = sorted(root.glob(f"checkpoint_*/{CHECKPOINT}"), key=lambda p: p.parent.name, reverse=True)
    return next((p for p in found if p.is_file() and inside(p, root)), None)


def listing(settings: Settings, job_id: str) -> list[ArtifactView]:
    """Every artifact, sorted by name (hidden files, half-written ones among them, left out)."""
    storage.sync_artifacts(settings, job_id)
    root = run_dir(settings, job_id) / ARTIFACTS
    items = {}
    if root.is_dir():
        for path in root.rglob("*"):
            name = path.relative_to(root).as_posix()
            if path.is_file() and not any(part.startswith(".") for part in PurePosixPath(name).parts) \
                    and inside(path, root):
                items[name] = view(name, path)
    if CHECKPOINT not in items and (ckpt := last_checkpoint(settings, job_id)) is not None:
        items[CHECKPOINT] = view(CHECKPOINT, ckpt)
    return [items[k] for k in sorted(items)]


def check_name(name: str) -> PurePosixPath:
    """A relative '/'-separated name without ``..``: else 422 naming ``name``."""
    rel = PurePosixPath(name)
    if not name or "\x00" in name or "\\" in name or rel.is_absolute() or ".." in rel.parts:
        raise InvalidInput(f"artifact name {name[:80]!r}: give a name from the job's artifact list (relative, "
                           "no '..', no backslash)", field="name")
    return rel


def resolve(settings: Settings, job_id: str, name: str) -> Path:
    """The file behind an artifact name, inside the job's directory; 404 if there is none."""
    rel = check_name(name)
    storage.sync_artifacts(settings, job_id)
    root = run_dir(settings, job_id) / ARTIFACTS
    path = root / rel
    if path.is_file() and inside(path, root) and not any(p.startswith(".") for p in rel.parts):
        return path.resolve()
    if name == CHECKPOINT and (ckpt := last_checkpoint(settings, job_id)) is not None:
        return ckpt
    raise JobNotFound(f"experiment {job_id} has no artifact {name[:80]!r}: GET /v1/experiments/{job_id}/artifacts "
                      "lists them", field="name")
