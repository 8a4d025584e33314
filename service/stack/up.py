"""``tlab up``: the embedded stack (``service.stack.embedded``) started and kept up (``service.stack.supervise``)."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from service.core.sandbox_state import said_at_start
from service.core.settings import Settings
from service.core.signals import stop_on_signals
from service.core.storage import check_or_exit
from service.core.store import redact_url
from service.stack.addresses import LOOPBACK
from service.stack.embedded import Interrupted, Stack, port_range
from service.stack.runtime import RuntimeRefused
from service.stack.service_user import OFF, ServiceUser, ServiceUserRefused, resolve
from service.stack.service_user import said_at_start as who_at_start
from service.stack.supervise import Supervisor, supervise_policy


def service_user(home: Path) -> ServiceUser | None:
    """As root, the unprivileged user the Ray head runs as (``TLAB_SERVICE_USER``, made when missing); else None, and
    None with ``RAY_ADDRESS`` (no Ray head started here)."""
    name = Settings(TLAB_HOME=home).service_user
    if os.geteuid() != 0 or os.environ.get("RAY_ADDRESS") or name.strip().lower() == OFF:
        return None
    return resolve(name)


def up(home: Path, port: int | None, num_cpus: int | None, num_gpus: int | None = None,
       listen: str = LOOPBACK) -> int:
    """Start the stack and keep it up (``service.stack.supervise``) until Ctrl-C or SIGTERM; 1 after a crash loop.
    As root, its Ray head (every Ray worker and job supervisor) runs as the service user (``service_user``).
    ``listen``: the address Redis, the Ray head and the API listen on (other machines join there: ``tlab join``)."""
    policy = supervise_policy()  # a bad TLAB_RESTART_*/TLAB_CRASH_LOOP_* setting stops here, before anything runs
    check_or_exit(Settings(TLAB_HOME=home))  # so does a malformed TLAB_STORAGE URI or an unreachable bucket
    try:
        port_range()
        user = service_user(home)
        stack = Stack(home, port=port, redis_url=os.environ.get("REDIS_URL") or None,
                      ray_address=os.environ.get("RAY_ADDRESS") or None, num_cpus=num_cpus, num_gpus=num_gpus,
                      service_user=user, listen=listen)
    except (ValueError, ServiceUserRefused) as err:  # a malformed TLAB_PORT_RANGE, no service user, a bad --listen
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    supervisor = Supervisor(stack, policy)
    os.umask(0o077)  # what the stack writes under TLAB_HOME (Redis's AOF, checkpoints, logs) is the owner's only
    stopping = stack.stopping = stop_on_signals()
    print(f"starting Teleport Lab in {home} (logs: {stack.logs}) ...", file=sys.stderr, flush=True)
    print(said_at_start(Settings(TLAB_HOME=home)), flush=True)  # (service.core.sandbox_state)
    if not stack.ray_address:
        print(who_at_start(user), flush=True)
    crash_loop, refused = None, ""
    try:
        stack.start()
        for warning in stack.warnings:
            print(warning, file=sys.stderr, flush=True)
        print(f"Teleport Lab is up at {stack.url}\n"
              f"  redis {redact_url(stack.redis_url or '')}   ray {stack.ray_address}\n"
              f"  admin token: {home / 'admin.token'}   (tlab reads it from there)\n"
              "A part that dies is restarted. Ctrl-C stops everything.", flush=True)
        if stack.join_address:
            print(f"Other machines join with `tlab join {stack.url}` and a token from `tlab join-token`; open "
                  f"ports {stack.port} (API), {stack.redis_port or '-'} (Redis) and Ray's to them only "
                  "(docs/operations.md, Several machines).", flush=True)
        crash_loop = supervisor.run(stopping)
    except Interrupted:
        pass  # Ctrl-C while a part was starting: stop what is up
    except (ServiceUserRefused, RuntimeRefused) as err:  # what the service user needs is out of its reach
        refused = f"error: {err}"
    except Exception:
        supervisor.record(f"tlab up failed:\n{traceback.format_exc()}")
        raise
    finally:
        print("stopping ...", file=sys.stderr, flush=True)
        stack.stop()
    if refused:
        print(refused, file=sys.stderr, flush=True)
        return 2
    if crash_loop:
        print(crash_loop, file=sys.stderr, flush=True)
        return 1
    return 0
