"""The unprivileged user a root ``tlab up`` runs its Ray head as (``TLAB_SERVICE_USER``, default ``tlab``), so that no
Ray worker and no job supervisor is root (docs/security.md).

Only the Ray head's process tree drops to it: Ray's daemons, every Ray worker, each job's supervisor (a Ray job's
driver) and, through them, the payloads (the sandbox maps a payload to its supervisor's uid: ``workers.job.sandbox``).
Redis, the API and the scheduler stay root: they run no job code, they hold the secrets (``admin.token``,
``redis.password``, ``ray.token``, ``redis.conf``: root's, 0600) and they read what jobs wrote only through the
checked readers (``service.core.safe_files``).

What the service user reaches, and nothing more of ``TLAB_HOME``: ``prepare`` makes the home 0711 (passable, not
listable), the storage root its own (the whole tree once, links not followed, when it was another owner's: a stack
that ran Ray as root before), the default data root ``$TLAB_HOME/data`` readable by its group (root's, 02750; an
admin's own data roots must be readable by it too: a warning names those it cannot read), and the Ray head's temp
dir its own. Ray's token reaches it by environment as before. A home under a directory it cannot pass (``/root``,
pytest's 0700 temp root) is refused with one line: nothing opens that directory.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

OFF = "off"  # TLAB_SERVICE_USER=off: a root tlab up runs Ray as root, knowingly (said at start)
DATA_MODE = 0o2750  # the default data root: root's, its group the service user's, new entries in that group


class ServiceUserRefused(RuntimeError):
    """The service user cannot be had or cannot do its work here; one line."""


@dataclass(frozen=True)
class ServiceUser:
    name: str
    uid: int
    gid: int

    def popen(self) -> dict[str, object]:
        """``subprocess.Popen`` arguments that start a child as this user, with its own group only."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def resolve(name: str) -> ServiceUser:
    """The user ``name``, made (``useradd --system``, no home, no login shell) when missing; never root."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        entry = _useradd(name)
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise ServiceUserRefused(f"TLAB_SERVICE_USER={name!r} is root or in root's group: name an unprivileged user")
    return ServiceUser(name, entry.pw_uid, entry.pw_gid)


def _useradd(name: str) -> pwd.struct_passwd:
    useradd = shutil.which("useradd")
    if useradd is None:
        raise ServiceUserRefused(
            f"the service user {name!r} (TLAB_SERVICE_USER) does not exist and useradd is not here: create it "
            f"(useradd --system --no-create-home --shell /usr/sbin/nologin {name}), or name another")
    done = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True, timeout=60)
    try:
        return pwd.getpwnam(name)  # (made by another start at the same time, if useradd failed)
    except KeyError:
        said = (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]
        raise ServiceUserRefused(f"useradd could not make the service user {name!r} (TLAB_SERVICE_USER): "
                                 f"{said}") from None


def said_at_start(user: ServiceUser | None) -> str:
    """The one line ``tlab up`` prints about who runs what."""
    if user is None:
        try:
            me = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:  # a uid with no name (a container's)
            me = "this user"
        if os.getuid() == 0:
            return ("ray: runs as ROOT (TLAB_SERVICE_USER=off, or Ray is not ours: RAY_ADDRESS): every Ray worker "
                    "and job supervisor is root; each job's code still runs as a uid of its own")
        return f"ray: runs as {me} (uid {os.getuid()}), as the rest of the stack"
    return (f"ray: runs as the service user {user.name} (uid {user.uid}): Ray's daemons, its workers and each job's "
            "supervisor; Redis, the API and the scheduler run as root and hold the secrets")


def closed_to(user: ServiceUser, path: Path, need: int = 0o1) -> Path | None:
    """The first directory on the way to ``path`` (``path`` itself: with the bits ``need``, of r=4, w=2, x=1) that
    ``user`` cannot pass, by its mode bits (no ACLs); None when it can."""
    path = Path(os.path.abspath(path))
    for step in [*reversed(path.parents), path]:
        try:
            st = os.stat(step)
        except FileNotFoundError:
            return None  # made later, by root for it
        bits = need if step == path else 0o1
        shift = 6 if st.st_uid == user.uid else 3 if st.st_gid == user.gid else 0
        if (stat.S_IMODE(st.st_mode) >> shift) & bits != bits:
            return step
    return None


def _mode(path: Path) -> str:
    return f"{stat.S_IMODE(os.stat(path).st_mode):04o}"


def reachable(user: ServiceUser, what: str, path: Path) -> None:
    """``ServiceUserRefused`` naming the directory above ``path`` that ``user`` cannot pass, if there is one."""
    shut = closed_to(user, path.parent)
    if shut is not None:
        raise ServiceUserRefused(
            f"{what} {path} lies under {shut} (mode {_mode(shut)}), which the service user {user.name} cannot pass: "
            f"put TLAB_HOME where it can (e.g. TLAB_HOME=/var/lib/tlab); {shut} is not opened for it")


def prepare(user: ServiceUser, home: Path, storage: Path, data_roots: list[Path]) -> list[str]:
    """Open to ``user`` what its processes need (see the module); the warnings to print (data roots it cannot read).
    ``ServiceUserRefused`` when the home or the storage lies under a directory closed to it."""
    reachable(user, "TLAB_HOME", home)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o711)  # passable to its storage, not listable; the secrets in it stay root's 0600
    reachable(user, "the storage (TLAB_STORAGE)", storage)
    own_tree(storage, user)
    default = home / "data"
    warnings = []
    for root in data_roots:
        if root == default.resolve():
            default.mkdir(exist_ok=True, mode=0o700)
            os.chown(default, 0, user.gid)
            os.chmod(default, DATA_MODE)
        if closed_to(user, root, need=0o5) is not None:
            warnings.append(f"warning: the data root {root} (TLAB_DATA_ROOTS) is not readable by the service user "
                            f"{user.name} (uid {user.uid}): jobs cannot read their data there until it is (chgrp "
                            f"{grp.getgrgid(user.gid).gr_name}, g+rX)")
    return warnings


def own_tree(path: Path, user: ServiceUser) -> None:
    """``path`` (made 0700 if missing) owned by ``user``; when it was another owner's, everything in it too (links
    themselves, never followed)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        raise ServiceUserRefused(f"the storage {path} is not a directory")
    if (st.st_uid, st.st_gid) == (user.uid, user.gid):
        return
    for _top, dirs, files, fd in os.fwalk(path, follow_symlinks=False):
        for name in [*dirs, *files]:
            os.chown(name, user.uid, user.gid, dir_fd=fd, follow_symlinks=False)
    os.chown(path, user.uid, user.gid, follow_symlinks=False)


def head_env(user: ServiceUser, temp: Path, python: str, path: str) -> dict[str, str]:
    """What the Ray head's environment changes for ``user``: a home and a temp dir of its own in the head's temp dir
    (root's ``HOME`` and ``TMPDIR`` are not its), its name, and its Python first on ``PATH`` (then ``path``)."""
    own = {"home": temp / "home", "tmp": temp / "tmp"}
    for folder in own.values():
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chown(folder, user.uid, user.gid)
    os.chown(temp, user.uid, user.gid)
    return {"HOME": str(own["home"]), "TMPDIR": str(own["tmp"]), "USER": user.name, "LOGNAME": user.name,
            "PATH": f"{Path(python).parent}:{path or '/usr/bin:/bin'}"}
