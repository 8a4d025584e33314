"""``code=DIR`` (the CLI's ``--code DIR``): zip a package directory the same way every time, upload it once,
point the spec at it.

The zip is deterministic (names sorted, fixed timestamps and modes), so an unchanged directory has the same
``sha256:<hex>`` id and is uploaded once: ``upload`` asks the service whether it has the id before sending any
bytes. Left out: what ``.gitignore`` and ``.tlabignore`` at DIR's root match (the common gitignore forms: ``#``
comments, ``!`` negation, a trailing ``/`` for directories, a leading or inner ``/`` anchoring to DIR, ``*``,
``?``, ``**``, ``[...]``), and always ``.git/``, ``__pycache__/``, ``*.pyc``. A symbolic link whose target
leaves DIR is refused; one inside DIR to a file is stored as that file (a linked directory is not followed).
The zip is capped at ``TLAB_MAX_CODE_MB`` (default 50), with a message that names the largest files.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tlab.client import Client

MB = 1 << 20
ALWAYS_IGNORED = [".git/", "__pycache__/", "*.pyc"]
IGNORE_FILES = (".gitignore", ".tlabignore")
FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest a zip can say: the same bytes on every machine


class CodeDirError(ValueError):
    """The directory cannot be packed: the message says which file and what to do."""


@dataclass(frozen=True)
class Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    anchored: bool


def _glob_regex(pattern: str) -> str:
    """A gitignore glob as a regex over a '/'-separated path: ``*`` and ``?`` stay within a name, ``**`` spans."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif c == "*":
            out, i = out + "[^/]*", i + 1
        elif c == "?":
            out, i = out + "[^/]", i + 1
        elif c == "[" and "]" in pattern[i + 1:]:
            end = pattern.index("]", i + 1)
            body = pattern[i + 1:end].replace("\\", "\\\\")
            out, i = out + "[" + ("^" + body[1:] if body.startswith("!") else body) + "]", end + 1
        else:
            out, i = out + re.escape(c), i + 1
    return out


def parse_rules(lines: list[str]) -> list[Rule]:
    rules = []
    for raw in lines:
        line = raw.rstrip("\n").rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        line = line.lstrip("/")
        if line:
            rules.append(Rule(re.compile(_glob_regex(line) + r"\Z"), negate, dir_only, anchored))
    return rules


def ignored(rules: list[Rule], rel: str, is_dir: bool) -> bool:
    """Whether ``rel`` (posix, relative to DIR) is left out: the last rule that matches decides."""
    name = rel.rsplit("/", 1)[-1]
    verdict = False
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.regex.match(rel if rule.anchored else name):
            verdict = not rule.negate
    return verdict


def load_rules(root: Path) -> list[Rule]:
    lines = list(ALWAYS_IGNORED)
    for name in IGNORE_FILES:
        if (root / name).is_file():
            lines += (root / name).read_text(errors="replace").splitlines()
    return parse_rules(lines)


def package_files(root: Path) -> list[tuple[str, Path]]:
    """(name in the zip, file to read) for every file of DIR that is not ignored, sorted by name."""
    rules, found = load_rules(root), []
    real_root = root.resolve()
    for here, dirs, files in os.walk(root):
        base = Path(here)
        keep = []
        for d in sorted(dirs):
            rel = (base / d).relative_to(root).as_posix()
            if (base / d).is_symlink():
                _check_link(base / d, real_root, rel)
                continue  # a linked directory inside DIR: its target is packed where it lies
            if not ignored(rules, rel, True):
                keep.append(d)
        dirs[:] = keep
        for f in files:
            path, rel = base / f, (base / f).relative_to(root).as_posix()
            if ignored(rules, rel, False):
                continue
            if path.is_symlink():
                _check_link(path, real_root, rel)
            if path.is_file():
                found.append((rel, path))
    return sorted(found)


def _check_link(path: Path, real_root: Path, rel: str) -> None:
    if not path.resolve().is_relative_to(real_root):
        raise CodeDirError(f"--code: {rel} is a link to {os.readlink(path)}, outside the directory: copy the file "
                           "in, or list it in .tlabignore")


def zip_dir(root: Path, max_bytes: int) -> bytes:
    """The deterministic zip of DIR's package files; CodeDirError past ``max_bytes`` naming the largest files."""
    if not root.is_dir():
        raise CodeDirError(f"--code {root}: no such directory")
    files = package_files(root)
    if not files:
        raise CodeDirError(f"--code {root}: no files to pack (all ignored?)")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as archive:
        for rel, path in files:
            info = zipfile.ZipInfo(rel, date_time=FIXED_TIME)
            info.create_system, info.compress_type = 3, zipfile.ZIP_DEFLATED
            info.external_attr = (0o100755 if os.access(path, os.X_OK) else 0o100644) << 16
            archive.writestr(info, path.read_bytes())
            if buf.tell() > max_bytes:
                raise CodeDirError(too_big(root, files, max_bytes))
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise CodeDirError(too_big(root, files, max_bytes))
    return data


def too_big(root: Path, files: list[tuple[str, Path]], max_bytes: int) -> str:
    sizes = sorted(((p.stat().st_size, rel) for rel, p in files), reverse=True)[:3]
    largest = ", ".join(f"{rel} ({size / MB:.1f} MiB)" for size, rel in sizes)
    return (f"--code {root}: the package is over TLAB_MAX_CODE_MB={max_bytes / MB:g} MiB; the largest files: "
            f"{largest}. List data, checkpoints and environments in {root}/.tlabignore")


def max_code_bytes() -> int:
    raw = os.environ.get("TLAB_MAX_CODE_MB", "50")
    try:
        return int(float(raw) * MB)
    except ValueError:
        raise CodeDirError(f"TLAB_MAX_CODE_MB={raw!r}: give a number of MiB") from None


def upload(c: Client, directory: str) -> dict[str, Any]:
    """Zip DIR and upload it unless the service already has these bytes: ``{package, bytes, uploaded}``."""
    from tlab.http import ApiError

    data = zip_dir(Path(directory), max_code_bytes())
    package = f"sha256:{hashlib.sha256(data).hexdigest()}"
    try:
        c.json("GET", f"/v1/code/{package}")
        return {"package": package, "bytes": len(data), "uploaded": False}
    except ApiError as err:
        if err.status != 404:
            raise
    stored = c.json("POST", "/v1/code", content=data, headers={"Content-Type": "application/zip"})
    return {**stored, "uploaded": True}


def with_code(c: Client, spec: dict[str, Any], directory: str | Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``spec`` with ``code.package`` set to DIR's package (uploaded if new), and what ``upload`` said ({} without
    DIR: the spec as it is)."""
    if not directory:
        return spec, {}
    done = upload(c, str(directory))
    return {**spec, "code": {**(spec.get("code") or {}), "package": done["package"]}}, done
