"""A job's artifacts as the API serves them: the files under ``<TLAB_STORAGE>/<job>/artifacts/`` that its
driver wrote (``workers/job/artifacts.py``), plus its last Ray Train checkpoint as ``checkpoint.pt`` when the
driver could not export it (killed before it could). Storage is a local or shared filesystem path
(``TLAB_STORAGE``), or a bucket behind a local working copy: what the copy lacks is pulled first
(``service.core.storage``).

A name never leaves the job's directory: absolute names, ``..``, backslashes and NUL are refused (422). The job
writes this directory, so every file is opened under the storage root without following a link on any component
(``service.core.safe_files``): a link (``artifacts/`` itself one, or a file) or a special file is left out of the list,
and asked for by name it is 404 with one line, logged; a download is served from the descriptor that was checked.

Listing reads no file but ``SHA256SUMS`` (at most ``SUMS_MAX_BYTES``): each file's sha256 is the one recorded there
(``workers.job.artifacts.record_digests``, bounded): written by the job's supervisor, on the trusted side, once its
payload has ended; a job whose supervisor was killed before that keeps its payload's own list, and the job's code
may rewrite the directory until it ends, so each item says where its digest comes from: it lets ``tlab pull`` check
what it downloaded, and the service decides nothing on it. A file it does not name (over the export's bound,
written after it, no export yet) is listed with no sha256 and a note why; the list's own digest is taken from the
bytes just read.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import PurePosixPath

from api_schemas.artifacts import HASH_EXPORT_MAX, HASH_FILE_MAX, SUMS, ArtifactView
from service.core import safe_files, storage
from service.core.checkpoints import checkpoint_dirs
from service.core.errors import InvalidInput, JobNotFound
from service.core.settings import Settings

ARTIFACTS = "artifacts"  # workers.job.artifacts.ARTIFACTS (the service does not import workers/)
CHECKPOINT = "checkpoint.pt"
SUMS_MAX_BYTES = 8 << 20  # a SHA256SUMS line per file: far more than TLAB_MAX_JOB_FILES lines of names
SUMS_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")
RECORDED = "in SHA256SUMS, by the job's supervisor once it ended (before that, the job's own): checks a download"
NOT_EXPORTED = "none: the job has not exported its artifacts (SHA256SUMS)"
STAND_IN = "none: the job did not export its artifacts; this is its newest checkpoint as Ray Train kept it"
OVER = f"none: over the {HASH_FILE_MAX >> 30} GiB the export hashes per file"
NOT_NAMED = f"none recorded at export (written after it, or past the {HASH_EXPORT_MAX >> 30} GiB an export hashes)"


class Digests:
    """What ``SHA256SUMS`` records (name -> sha256), read once per listing, bounded, no link followed."""

    def __init__(self, root: str, rel: str) -> None:
        self.by_name: dict[str, str] = {}
        self.own: str | None = None  # the list's own digest; None: no list
        try:
            data = safe_files.read_bytes(root, rel, SUMS_MAX_BYTES)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, safe_files.UnsafeFile):
            return
        self.own = hashlib.sha256(data).hexdigest()
        for line in data.decode("utf-8", "replace").splitlines():
            if match := SUMS_LINE.fullmatch(line):
                self.by_name[match[2]] = match[1]

    def view(self, name: str, st: os.stat_result) -> ArtifactView:
        """The item for ``name``: the digest recorded for it, or none and why (never a file read here)."""
        if name == SUMS and self.own is not None:
            digest, note = self.own, "of the list itself, as the API read it"
        elif name in self.by_name:
            digest, note = self.by_name[name], RECORDED
        else:
            digest, note = None, OVER if st.st_size > HASH_FILE_MAX else NOT_EXPORTED if self.own is None else NOT_NAMED
        return ArtifactView(name=name, bytes=st.st_size, sha256=digest, sha256_note=note, modified_at=st.st_mtime)


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
    """Every artifact, sorted by name (hidden files, half-written ones among them, and links left out), with the
    sha256 its export recorded (``Digests``): no file is read to list it."""
    storage.sync_artifacts(settings, job_id)
    root, base = settings.storage_path, f"{job_id}/{ARTIFACTS}"
    try:
        found = list(safe_files.files(root, base))
    except safe_files.UnsafeFile:  # artifacts/ itself a link: logged, nothing listed
        found = []
    digests = Digests(root, f"{base}/{SUMS}")
    items = {name: digests.view(name, st) for name, st in found if not hidden(name)}
    if CHECKPOINT not in items and (ckpt := last_checkpoint(settings, job_id)) is not None:
        items[CHECKPOINT] = ArtifactView(name=CHECKPOINT, bytes=ckpt[1].st_size, sha256_note=STAND_IN,
                                         modified_at=ckpt[1].st_mtime)
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
