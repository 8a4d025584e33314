"""The system calls a payload may not make: a seccomp filter (libseccomp, through ``pyseccomp``) that bwrap loads
before the payload starts (``--seccomp FD``), on top of its unprivileged uid, its no-new-privileges bit and its
mount namespace.

Denied (EPERM), what a job needs none of and what escapes start with:

- debugging and reading other processes: ``ptrace``, ``process_vm_readv``/``writev``, ``kcmp``;
- new namespaces and mounts: ``unshare``, ``setns``, ``mount``, ``umount2``, ``pivot_root``, ``chroot``, the
  new mount API (``fsopen``, ``open_tree``, ``move_mount`` ...), and ``clone`` with any ``CLONE_NEW*`` flag
  (``clone3`` answers ENOSYS, so the C library falls back to ``clone``, whose flags can be read; Flatpak does the
  same); a nested user namespace is where a process regains every capability;
- the kernel's attack surface: ``keyctl``/``add_key``/``request_key``, ``bpf``, ``perf_event_open``,
  ``userfaultfd``, ``kexec_*``, ``*_module``, ``open_by_handle_at`` (a file by its handle, past every mount),
  ``name_to_handle_at``, ``quotactl``, ``acct``, ``swapon``/``swapoff``, ``reboot``, ``lookup_dcookie``,
  ``io_uring_*`` (its operations bypass this filter);
- a set-uid or set-gid bit on a file: ``chmod``/``fchmod``/``fchmodat`` and ``open``/``openat``/``creat``/
  ``mknod``/``mknodat`` with ``S_ISUID`` or ``S_ISGID`` in their mode (``fchmodat2`` and ``openat2`` answer
  ENOSYS: their callers fall back to the calls above). The supervisor also strips any such bit it finds in the
  job's directory after each payload (``workers.job.sandbox.strip_setid``).
"""

from __future__ import annotations

import atexit
import errno
import os
import stat
import tempfile
from functools import cache
from pathlib import Path

DENIED = ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "unshare", "setns", "mount", "umount2",
          "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "open_tree", "move_mount",
          "mount_setattr", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
          "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "open_by_handle_at",
          "name_to_handle_at", "quotactl", "acct", "swapon", "swapoff", "reboot", "lookup_dcookie",
          "io_uring_setup", "io_uring_enter", "io_uring_register", "personality")
NO_SUCH = ("clone3", 452, 437)  # clone3; fchmodat2 and openat2 (numbers on x86_64 and arm64 alike)
CLONE_NEW = 0x7E02_0000 | 0x0000_0080  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET, NEWTIME
MODE_ARG = {"chmod": 1, "fchmod": 1, "fchmodat": 2, "open": 2, "openat": 3, "creat": 1, "mknod": 1, "mknodat": 2}
SETID = (stat.S_ISUID, stat.S_ISGID)


@cache
def program() -> bytes:
    """The filter as a BPF program, as bwrap's ``--seccomp`` reads it."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    for name in DENIED:
        _add(f, deny, name)
    for call in NO_SUCH:
        _add(f, sc.ERRNO(errno.ENOSYS), call)
    for bit in range(32):  # clone: one rule per namespace flag (a rule's masked compare tests one value)
        if CLONE_NEW & (1 << bit):
            _add(f, deny, "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
    for name, arg in MODE_ARG.items():
        for bit in SETID:
            _add(f, deny, name, sc.Arg(arg, sc.MASKED_EQ, bit, bit))
    with tempfile.TemporaryFile() as out:  # (libseccomp writes to a descriptor)
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _add(f, action: int, call: str | int, *args) -> None:  # noqa: ANN001
    try:
        f.add_rule(action, call, *args)
    except (RuntimeError, OSError, ValueError):  # a call this architecture has not (``open`` on arm64, say)
        pass


@cache
def program_file() -> Path:
    """``program()`` in a file of this process's own (0600, removed at exit), opened by each sandbox's start."""
    fd, name = tempfile.mkstemp(prefix="tlab-seccomp-", suffix=".bpf")
    with os.fdopen(fd, "wb") as out:
        out.write(program())
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return Path(name)
