"""The sandbox a job's own code runs in (issue 26; docs/security.md): bubblewrap, one per process that trains.

Our code (a Ray job's driver, a gang rank's Ray task, a preflight's entrypoint) is the trusted supervisor: it holds the
Ray connection and the job's ticket, and starts the payload (``python -m workers.payload``: the user's factories,
loss and own loop) through ``launch``, which wraps it in ``bwrap``:

- a private PID namespace (no other process's ``/proc``, no pid of ours to signal), IPC and UTS namespaces;
- an unprivileged uid: as root, ``nobody`` (65534) with no capability (``drop_root``), so even a file the sandbox can
  see but root owns (mode 0600) stays closed; otherwise the caller's uid in a user namespace;
- read-only: the system (``/usr``, ``/etc``, the ``/lib`` links), Python and its packages, our packages, the job's
  code (its working directory), its data and the checkpoint it starts from; read-write: only its own job directory;
  a private ``/tmp`` and ``/dev``; ``TLAB_SANDBOX_HIDE`` (the service's home) covered by an empty tmpfs;
- an environment cleared, then only what the payload needs (``PASSED``): no Ray token, no Redis URL, no bucket key
  (its Redis URL, the job's own ACL user, comes on a pipe: ``workers.payload``);
- the network shared: the gang's process group and the metrics sink work as before.

As root, bwrap runs without a user namespace and the payload drops to ``nobody`` inside (``drop_root``): bwrap started
as ``nobody`` could not bind what lies under ``/root`` (0700; pyenv's Python lives there), even from a descriptor.

``TLAB_SANDBOX=off`` (the admin's choice, knowingly: ``service.settings``) runs the payload as a plain child with
the same cleared environment. Where bwrap cannot run (not installed, user namespaces off: ``unavailable``), a job
without the user's code runs that way too, and one with it fails with one line (the API refuses it at submit).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

SETTING = "TLAB_SANDBOX"  # "off": no sandbox, knowingly; anything else: a sandbox wherever one can run
HIDE = "TLAB_SANDBOX_HIDE"  # colon-separated directories the payload must never see (the service's home)
NOBODY = 65534
SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/sys")
OUR_PACKAGES = ("api_schemas", "objstore", "teleport", "workers")  # what ``workers.payload`` imports
PASSED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "LANG", "LC_ALL",
          "TLAB_KEEP_CHECKPOINTS", "TLAB_CHECKPOINT_EVERY_S", "TLAB_GANG_TIMEOUT_S", "TLAB_MAX_LOG_MB", "TLAB_DEBUG",
          "TLAB_DATA", "TLAB_SANDBOX")


class SandboxRefused(RuntimeError):
    """The job runs the user's code, and no sandbox can run here (and the admin did not turn it off)."""


def turned_off(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(SETTING, "").strip().lower() == "off"


@dataclass
class Mounts:
    """What the payload sees of the file system besides the system and Python."""

    writable: Path  # its own job directory
    readable: list[Path] = field(default_factory=list)  # its code, data, the checkpoint it starts from
    hidden: list[Path] = field(default_factory=list)  # never visible, even under a directory that is
    workdir: Path | None = None  # where it starts (its code's directory; else its job directory)


def hidden_dirs(environ: Mapping[str, str] = os.environ) -> list[Path]:
    return [Path(p) for p in environ.get(HIDE, "").split(":") if p.strip()]


def python_paths() -> list[Path]:
    """Python's own directories and those on ``sys.path``, and our packages (an editable install's are elsewhere)."""
    import importlib.util

    found = [Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p]
    for name in OUR_PACKAGES:
        spec = importlib.util.find_spec(name)
        found += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return found


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def _outermost(paths: Sequence[Path]) -> list[Path]:
    """Existing directories and files, resolved, less those inside another of them; parents first."""
    real = sorted({Path(os.path.realpath(p)) for p in paths if os.path.exists(p)}, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(real) if not _under(p, real[:i])]


def parents(paths: Sequence[Path]) -> list[str]:
    """``--dir`` (mode 0755) for each directory above ``paths``: bwrap run as root makes the missing ones 0700,
    which ``nobody`` could not pass."""
    made: dict[Path, None] = {}
    for path in paths:
        for parent in reversed(path.parents[:-1]):  # (not "/")
            made.setdefault(parent)
    return [a for p in made for a in ("--perms", "0755", "--dir", str(p))]


def drop_root() -> list[str]:
    """As root, what the payload's command starts with: ``setpriv`` to ``nobody``, no capability left (bwrap runs
    as root without a user namespace, so it can bind what lies under ``/root``; the payload's uid is then
    unprivileged on the host too). Otherwise nothing: bwrap makes a user namespace with the caller's uid."""
    if os.geteuid() != 0:
        return []
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--"]


def bwrap_argv(command: Sequence[str], env: Mapping[str, str], mounts: Mounts) -> list[str]:
    """The bwrap command that runs ``command`` with exactly ``env`` and ``mounts`` (see the module)."""
    argv = ["bwrap", *([] if os.geteuid() == 0 else ["--unshare-user"]), "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--tmpfs", "/tmp",
            "--proc", "/proc", "--dev", "/dev"]
    for device in sorted(glob.glob("/dev/nvidia*")):  # a GPU job's cards (CUDA_VISIBLE_DEVICES says which)
        argv += ["--dev-bind", device, device]
    for name in SYSTEM:
        if os.path.islink(name):  # Debian's merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(name), name]
    readable = [*[Path(p) for p in SYSTEM if not os.path.islink(p)], *python_paths(), *mounts.readable]
    outer = [p for p in _outermost(readable) if not _under(p, mounts.hidden)]
    inner = _outermost([p for p in readable if _under(Path(os.path.realpath(p)), mounts.hidden)])
    job_dir = Path(os.path.realpath(mounts.writable))
    argv += parents([*outer, *inner, job_dir])
    argv += [a for p in outer for a in ("--ro-bind", str(p), str(p))]
    argv += [a for p in mounts.hidden if _under(p, outer) for a in ("--tmpfs", str(p))]  # the service's home
    argv += [a for p in inner for a in ("--ro-bind", str(p), str(p))]  # what the job needs from under it
    argv += ["--bind", str(job_dir), str(job_dir), "--clearenv"]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    return [*argv, "--chdir", str(mounts.workdir or job_dir), "--", *drop_root(), *command]


def payload_env(code_dir: str | None) -> dict[str, str]:
    """The payload's whole environment: ``PASSED`` (those set), a PATH to Python, HOME in its private /tmp."""
    env = {k: os.environ[k] for k in PASSED if k in os.environ}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", HOME="/tmp",
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    if code_dir:
        env["PYTHONPATH"] = code_dir  # the job's package first on its path, as Ray's working_dir is
    return env


def own_dir(job_dir: Path) -> None:
    """As root: the job directory (and what is in it) becomes ``nobody``'s, the sandbox's only writable place."""
    job_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return
    for root, dirs, files in os.walk(job_dir):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(root, name), NOBODY, NOBODY)
    os.lchown(job_dir, NOBODY, NOBODY)


@cache
def unavailable() -> str:
    """'' when a sandbox can run here; else why not, in one line (probed with a real ``bwrap ... true``)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (no bwrap on PATH): `make sandbox`, or apt-get install bubblewrap"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed: the sandbox cannot drop root"
    probe = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        done = subprocess.run(bwrap_argv(["true"], {}, Mounts(writable=probe)), capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap did not start a sandbox: {err}"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bwrap cannot start a sandbox here ({said}): are user namespaces allowed "
                "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone)?")
    return ""


def required(user_code: bool) -> bool:
    """Whether this job's payload runs in a sandbox: wherever one can run, unless turned off; where none can, a job
    with the user's code is refused (``SandboxRefused``), one without runs as a plain child."""
    if turned_off():
        return False
    why = unavailable()
    if why and user_code:
        raise SandboxRefused(f"this job runs your code, and no sandbox can run on this node: {why} "
                             f"(or the admin sets {SETTING}=off, knowingly)")
    return not why
