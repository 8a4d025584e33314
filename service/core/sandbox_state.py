"""Whether a job's code can run in a sandbox here (``workers/job/sandbox.py`` builds it; docs/security.md).

``TLAB_SANDBOX`` (``service.core.settings``): ``auto`` (the default) probes this machine with a real ``bwrap ... true``;
``on`` says the Ray nodes have one without probing here (compose, KubeRay: the API's container is not where jobs run;
a job whose node has none then fails at start, naming it); ``off`` runs users' code without one, knowingly.
``tlab up`` says the state at start, ``GET /v1/cluster`` and ``tlab cluster`` show it, and while it is
``unavailable`` a job with the user's code is refused at submit (``service.core.code_store.check_may_run_code``).
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache

from service.core.settings import Settings

# the sandbox's own namespaces, uid and mounts, on a command that does nothing (workers.job.sandbox.bwrap_argv's)
PROBE = ["bwrap", "--unshare-user", "--uid", "65534", "--gid", "65534", "--unshare-pid", "--unshare-ipc",
         "--ro-bind", "/", "/", "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev", "--die-with-parent", "true"]


@cache
def probe() -> str:
    """'' when bwrap runs a sandbox on this machine; else why not, in one line."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (no bwrap on PATH): `make sandbox`, or apt-get install bubblewrap"
    try:
        done = subprocess.run(PROBE, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap did not start: {err}"
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return f"bwrap cannot make a sandbox here ({said}): are user namespaces allowed (user.max_user_namespaces)?"
    return ""


def sandbox_state(settings: Settings) -> str:
    """``on``, ``off``, or ``unavailable: <why>`` (see the module)."""
    if settings.sandbox in ("on", "off"):
        return settings.sandbox
    why = probe()
    return f"unavailable: {why}" if why else "on"


def said_at_start(settings: Settings) -> str:
    """The one line ``tlab up`` prints about it."""
    state = sandbox_state(settings)
    if state == "on":
        return "sandbox: on (bubblewrap: each job's code sees its own job only)"
    if state == "off":
        return ("sandbox: OFF (TLAB_SANDBOX=off): users' code runs beside the control plane, with what its process "
                "can reach")
    return f"sandbox: UNAVAILABLE, jobs with users' code are refused: {state.split(': ', 1)[1]}"
