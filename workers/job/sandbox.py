"""The sandbox a job's own code runs in (docs/security.md): bubblewrap, one per process that trains.

Our code (a Ray job's driver, a gang rank's Ray task, a preflight's entrypoint) is the trusted supervisor: it holds the
Ray connection and the job's ticket, and starts the payload (``python -m workers.payload``: the user's factories,
loss and own loop) through ``launch``, which wraps it in ``bwrap``:

- a private PID namespace (no other process's ``/proc``, no pid of ours to signal), IPC and UTS namespaces;
- never root on the host: under a root supervisor, bwrap makes the mounts as root, then ``setpriv`` drops the
  payload to the job's own uid (``job_uid``: one per job from ``TLAB_JOB_UID_BASE``, in the jobs' group
  ``TLAB_JOB_GID``) with no capability, no set-uid gain (``--no-new-privs``) and no user namespace; under an
  unprivileged supervisor (a service user's Ray), bwrap's user namespace maps the payload to that uid, with
  ``--disable-userns``; either way a seccomp filter (``workers.job.seccomp``), ``/proc/sys`` read-only and a cap on
  its processes (``TLAB_SANDBOX_MAX_PROCS``); of ``/etc`` only ``ETC`` is bound;
- read-only: the system (``/usr``, ``/etc``, the ``/lib`` links), Python and its packages, our packages, the job's
  code (its working directory), its data and the checkpoint it starts from; read-write: only its own job directory;
  a private ``/tmp`` (a tmpfs of ``TLAB_SANDBOX_TMP_MB``, 1024) and ``/dev``; ``TLAB_SANDBOX_HIDE`` (the service's
  home) covered by an empty tmpfs;
- an environment cleared, then only what the payload needs (``PASSED``): no Ray token, no Redis URL, no bucket key
  (its Redis URL, the job's own ACL user, comes on a pipe: ``workers.payload``);
- the network shared: the gang's process group and the metrics sink work as before.

What the payload must read is readable by its uid: its job directory is its own (``own_job_dir``), its code is
made world-readable where Ray unpacked it (under the node's 0700 temp directory, so only through the sandbox's bind:
``readable_code``), its data roots are the admin's to open to ``TLAB_JOB_GID``, and Python is bound by root, so one
under a 0700 home (``/root``) is still found at its own path inside.

``TLAB_SANDBOX=off`` (the admin's choice, knowingly: ``service.core.settings``) runs the payload as a plain child with
the same cleared environment. Where bwrap cannot run (not installed, user namespaces off: ``unavailable``), a job
without the user's code runs that way too, and one with it fails with one line (the API refuses it at submit).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from workers.job import collectives, job_user, seccomp

SETTING = "TLAB_SANDBOX"  # "off": no sandbox, knowingly; anything else: a sandbox wherever one can run
HIDE = "TLAB_SANDBOX_HIDE"  # colon-separated directories the payload must never see (the service's home)
ROOTS = "TLAB_DATA_ROOTS"  # colon-separated: the only places a dataset is mounted from
TMP_MB = "TLAB_SANDBOX_TMP_MB"  # the payload's private /tmp: a tmpfs (memory) of at most this many MB
DEFAULT_TMP_MB = 1024
NOBODY = 65534
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# of /etc only what Python, torch and a connection need: no /etc/shadow, no /etc/ssl/private (see ``bwrap_argv``)
ETC = ("hosts", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf", "passwd", "group", "localtime", "timezone",
       "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl/certs", "ca-certificates", "os-release",
       "mime.types", "protocols", "services")
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


class MountRefused(ValueError):
    """A path a spec named (its data) or the node gave (its code) that the sandbox will not mount; one line."""


def data_roots(environ: Mapping[str, str] = os.environ) -> list[Path]:
    """``TLAB_DATA_ROOTS`` as the service resolved them (``service.launch.job_env`` passes them to every job)."""
    return [Path(os.path.realpath(p)) for p in environ.get(ROOTS, "").split(":") if p.strip()]


def allowed(path: Path, what: str, hidden: Sequence[Path], roots: Sequence[Path] | None = None) -> Path:
    """``path`` resolved, when the sandbox may mount it: never ``/``, never a directory that holds the service's
    home, the storage root or another hidden directory, never one inside storage; with ``roots``, only inside one of
    them (a dataset's files). Else ``MountRefused`` naming ``what``."""
    real = Path(os.path.realpath(path))
    covered = [Path(os.path.realpath(h)) for h in hidden]
    if real == Path("/") or any(_under(h, [real]) for h in covered):
        raise MountRefused(f"{what} {path} holds the service's own files ({':'.join(map(str, covered))}): the "
                           "sandbox never mounts it; name a directory of your data under the data roots")
    if roots is not None and not _under(real, roots):
        raise MountRefused(f"{what} {path} is outside the data roots ({':'.join(map(str, roots)) or 'none set'}, "
                           "TLAB_DATA_ROOTS): put the data under one of them")
    if roots is None and _under(real, covered):
        raise MountRefused(f"{what} {path} lies in the service's own files: the sandbox never mounts it")
    return real


def hidden_dirs(environ: Mapping[str, str] = os.environ) -> list[Path]:
    return [Path(p) for p in environ.get(HIDE, "").split(":") if p.strip()]


def our_package_dirs() -> list[Path]:
    """Where ``OUR_PACKAGES`` are imported from (an editable install's or a bare checkout's are outside Python's)."""
    import importlib.util

    found: list[Path] = []
    for name in OUR_PACKAGES:
        spec = importlib.util.find_spec(name)
        found += [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    return found


def python_paths(hidden: Sequence[Path] = ()) -> list[Path]:
    """Python's own directories and those on ``sys.path``, and our packages; never ``/`` nor a directory holding a
    ``hidden`` one (a Ray worker started from ``/`` has it on ``sys.path``: the whole file system would be bound)."""
    covered = [Path(os.path.realpath(h)) for h in hidden]
    found = [Path(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path) if p]
    found = [p for p in found if (real := Path(os.path.realpath(p))) != Path("/") and not _under_any(covered, real)]
    return [*found, *our_package_dirs()]


def _under_any(paths: Sequence[Path], top: Path) -> bool:
    """Whether one of ``paths`` is ``top`` or lies below it."""
    return any(_under(p, [top]) for p in paths)


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


def identity(uid: int | None) -> list[str]:
    """How the payload stops being this process's uid: under root, no user namespace (a uid mapped in one would be
    root on the host) and ``setpriv`` to ``uid`` after bwrap made the mounts, with only the capabilities setpriv needs
    (and bwrap's chdir into the job's directory) until setpriv drops them all; else bwrap's user namespace (the
    payload is this uid on the host), no nested one."""
    if not job_user.rootful():
        return ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--disable-userns"]
    return [a for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_DAC_READ_SEARCH") for a in ("--cap-add", cap)]


def drop_to(uid: int | None, command: Sequence[str]) -> list[str]:
    """``command`` run as ``uid`` (root: ``setpriv``; else as it is: bwrap's namespace did it)."""
    if not job_user.rootful():
        return list(command)
    uid = NOBODY if uid is None else uid
    gid = job_user.job_gid() if uid != NOBODY else NOBODY
    return [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all", "--", *command]


def bwrap_argv(command: Sequence[str], env: Mapping[str, str], mounts: Mounts, uid: int | None = None) -> list[str]:
    """The command that runs ``command`` with exactly ``env`` and ``mounts``, as ``uid`` (see the module): bwrap,
    its seccomp program on descriptor 9 (``workers.job.seccomp``, read by bwrap at start)."""
    argv = [shutil.which("bwrap") or "bwrap", "--cap-drop", "ALL", *identity(uid), "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--seccomp", "9",
            "--size", str(tmp_bytes()), "--perms", "1777", "--tmpfs", "/tmp", "--proc", "/proc",
            "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev"]
    gpus = sorted(glob.glob("/dev/nvidia*"))  # a GPU job's cards (CUDA_VISIBLE_DEVICES says which); CUDA reads /sys
    argv += [a for d in gpus for a in ("--dev-bind", d, d)] + (["--ro-bind", "/sys", "/sys"] if gpus else [])
    for name in SYSTEM:
        if os.path.islink(name):  # Debian's merged /usr: /bin -> usr/bin
            argv += ["--symlink", os.readlink(name), name]
    system = [Path(p) for p in SYSTEM if not os.path.islink(p)] + [Path("/etc", name) for name in ETC]
    readable = [*system, *python_paths(mounts.hidden), *mounts.readable]
    outer = [p for p in _outermost(readable) if not _under(p, mounts.hidden)]
    inner = _outermost([p for p in readable if _under(Path(os.path.realpath(p)), mounts.hidden)])
    job_dir = Path(os.path.realpath(mounts.writable))
    argv += parents([*outer, *inner, job_dir])
    argv += [a for p in outer for a in ("--ro-bind", str(p), str(p))]
    argv += [a for p in mounts.hidden if _under(p, outer) for a in ("--tmpfs", str(p))]  # the service's home
    argv += [a for p in inner for a in ("--ro-bind", str(p), str(p))]  # what the job needs from under it
    argv += ["--bind", str(job_dir), str(job_dir), "--remount-ro", "/", "--clearenv"]  # (/: what bwrap made)
    for name, value in env.items():
        argv += ["--setenv", name, value]
    argv += ["--chdir", str(mounts.workdir or job_dir), "--", *drop_to(uid, command)]
    # bwrap reads the filter from a descriptor: a shell opens the program's file there and becomes bwrap
    return ["/bin/sh", "-c", f'exec "$0" "$@" 9<{shlex.quote(str(seccomp.program_file()))}', *argv]


def tmp_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The size of the payload's private /tmp: ``TLAB_SANDBOX_TMP_MB`` (memory: a job that fills it gets ENOSPC, not
    the node's RAM), 1024 by default."""
    raw = environ.get(TMP_MB, "").strip()
    mb = int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_TMP_MB
    return mb * 1024 * 1024


def payload_env(code_dir: str | None) -> dict[str, str]:
    """The payload's whole environment: ``PASSED`` (those set), a PATH to Python, HOME in its private /tmp, and a
    PYTHONPATH of the job's package first (as Ray's working_dir is), then the folders our packages are imported
    from: a checkout run without ``pip install`` (``PYTHONPATH=.``, as on a lent GPU machine) has them nowhere else,
    and in the sandbox only our packages are mounted there; and the interface the gang's collectives use
    (``workers.job.collectives``)."""
    env = {k: os.environ[k] for k in PASSED if k in os.environ}
    env.update(PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", HOME="/tmp",
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    ours = dict.fromkeys(str(p.parent) for p in our_package_dirs())
    env["PYTHONPATH"] = os.pathsep.join([*([code_dir] if code_dir else []), *ours])
    env.update(collectives.socket_env(collectives.node_ip()))  # gloo/NCCL on the node's own interface
    return env


@cache
def unavailable() -> str:
    """'' when a sandbox can run here; else why not, in one line (probed with a real ``bwrap ... true``)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (no bwrap on PATH): `make sandbox`, or apt-get install bubblewrap"
    if job_user.rootful() and shutil.which("setpriv") is None:
        return "setpriv is not installed (util-linux): a payload cannot leave root's uid"
    probe = Path(os.environ.get("TMPDIR", "/tmp"))
    try:
        argv = bwrap_argv(["true"], {}, Mounts(writable=probe))
    except (OSError, RuntimeError, AttributeError) as err:  # no libseccomp: pyseccomp cannot load it
        return f"the sandbox's seccomp filter cannot be built (libseccomp2 installed?): {err}"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
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
