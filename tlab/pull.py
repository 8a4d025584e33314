"""An experiment's artifacts into a directory, each checked against the sha256 the API lists (recorded at export;
a file it has none for, e.g. one over the export's bound, against its size only). A file already there with that
sha256 is skipped; a ``.part`` left by an interrupted pull is continued with a Range request."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from tlab.http import ApiError

if TYPE_CHECKING:
    from tlab.http import Http

CHUNK = 1 << 20
Progress = Callable[[int], Any]  # called with each chunk's byte count


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def target(out: Path, name: str) -> Path:
    """Where artifact ``name`` goes under ``out``; a name that would leave it is refused."""
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise ApiError(0, f"the API listed an artifact named {name!r}, which would be written outside {out}: "
                          "not pulled", field=name)
    return out.joinpath(*rel.parts)


def to_fetch(items: list[dict[str, Any]], out: Path) -> list[tuple[dict[str, Any], Path]]:
    """The listed items and where each goes, less those already there with their listed sha256."""
    todo = [(i, target(out, i["name"])) for i in items]
    return [(i, d) for i, d in todo if not (i.get("sha256") and d.is_file() and file_sha256(d) == i["sha256"])]


def fetch(c: Http, job_id: str, item: dict[str, Any], dest: Path, progress: Progress = lambda n: None) -> None:
    """One artifact into ``dest`` (through ``dest.part``, continued if one is there), its sha256 checked."""
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > item["bytes"]:
        part.unlink()
        have = 0
    headers = {"Range": f"bytes={have}-"} if 0 < have < item["bytes"] else {}
    progress(have)
    if have < item["bytes"] or item["bytes"] == 0:
        with c.http.stream("GET", f"/v1/experiments/{job_id}/artifacts/{item['name']}", headers=headers) as r:
            if r.status_code >= 400:
                r.read()
                raise ApiError.from_response(r)
            with part.open("ab" if r.status_code == 206 else "wb") as f:
                for chunk in r.iter_bytes(CHUNK):
                    f.write(chunk)
                    progress(len(chunk))
    for what, wrong in (("size", item.get("sha256") is None and part.stat().st_size != item["bytes"]),
                        ("sha256", item.get("sha256") is not None and file_sha256(part) != item["sha256"])):
        if wrong:
            part.unlink()
            raise ApiError(0, f"{item['name']}: its {what} does not match the API's listing (changed while pulling?): "
                              "pull again", field=item["name"])
    part.replace(dest)


def pull(c: Http, job_id: str, out: Path, progress: Progress = lambda n: None) -> list[Path]:
    """Every artifact of ``job_id`` (a sweep's: its best trial's) under ``out``: the paths, in the API's order."""
    items = c.json("GET", f"/v1/experiments/{job_id}/artifacts")["items"]
    for item, dest in to_fetch(items, out):
        fetch(c, job_id, item, dest, progress)
    return [target(out, i["name"]) for i in items]
