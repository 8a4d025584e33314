"""People and tokens: ``users create|list`` and ``me`` (through the API), ``admin bootstrap`` (straight in Redis)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from service.cli.common import add_read_command, add_remote_args, client, fail, fmt, get_json, print_json, print_table


def _quota_text(quotas: dict[str, Any]) -> str:
    return "  ".join(f"{k} {fmt(v)}" for k, v in quotas.items())


def _quota_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # the API names the field if a string is wrong here


# every Quotas field as a named option of `users create` and `users set` (a test checks none is missing)
QUOTA_OPTIONS: dict[str, tuple[type, str]] = {
    "max_gpus": (float, "GPUs its starting/running jobs may hold at once"),
    "max_running_jobs": (int, "jobs it may have starting/running at once"),
    "max_queued_jobs": (int, "jobs it may have waiting in the queue at once"),
    "max_priority": (int, "the highest priority its jobs may ask for"),
    "max_cpus": (float, "CPUs its starting/running jobs may hold at once"),
    "max_memory_gb": (float, "GiB of host memory (resources.memory_gb) its starting/running jobs may hold at once"),
    "max_time_limit_s": (float, "the longest resources.time_limit_s its jobs may ask for"),
    "max_unpreemptible": (int, "jobs with resources.preemptible=false it may have queued or running at once"),
    "max_storage_gb": (float, "GB of storage its ended jobs may hold (at or over it, submits are refused)"),
}
WEAK_TOKENS = {"change-me", "changeme", "secret", "password", "admin", "token"}
MIN_TOKEN_CHARS = 32


def _quotas(args: argparse.Namespace) -> dict[str, Any]:
    """``--quota FIELD=VALUE`` items, then the named options (which win)."""
    quotas: dict[str, Any] = {}
    for item in args.quota:
        field, sep, value = item.partition("=")
        if not sep or not field:
            fail(f"--quota {item!r}: expected FIELD=VALUE, e.g. --quota max_gpus=4")
        quotas[field.strip()] = _quota_value(value.strip())
    for field in QUOTA_OPTIONS:
        if getattr(args, field) is not None:
            quotas[field] = getattr(args, field)
    return quotas


def _add_quota_args(p: argparse.ArgumentParser) -> None:
    for field, (kind, help_text) in QUOTA_OPTIONS.items():
        p.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None, help=help_text)
    p.add_argument("--quota", action="append", default=[], metavar="FIELD=VALUE",
                   help="any quota field the API takes (GET /docs: Quotas)")


def _print_user(user: dict[str, Any]) -> None:
    flags = [f for f in ("disabled", "can_submit_code") if user.get(f)]
    print(f"{user['name']}  {user['role']}  {_quota_text(user['quotas'])}" + "".join(f"  {f}" for f in flags))


def cmd_users_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "role": args.role}
    if quotas := _quotas(args):
        body["quotas"] = quotas
    with client(args) as c:
        created = c.json("POST", "/v1/users", json=body)
    if args.json:
        return print_json(created)
    _print_user(created["user"])
    print(f"token  {created['token']}")
    print("the token is shown only now (Redis keeps its hash): the user sets TLAB_TOKEN to it", file=sys.stderr)
    return 0


def cmd_users_list(args: argparse.Namespace) -> int:
    users = get_json(args, "/v1/users")
    if args.json:
        return print_json(users)
    rows = [("NAME", "ROLE", "CREATED", "STATUS", "QUOTAS")]
    rows += [(u["name"], u["role"], time.strftime("%Y-%m-%d %H:%M", time.localtime(u["created_at"])),
              "disabled" if u.get("disabled") else "active", _quota_text(u["quotas"])) for u in users]
    print_table(rows)
    return 0


def cmd_users_rotate(args: argparse.Namespace) -> int:
    with client(args) as c:
        rotated = c.json("POST", f"/v1/users/{args.name}/token")
    if args.json:
        return print_json(rotated)
    print(f"token  {rotated['token']}")
    print(f"{args.name}'s old token is refused from now on; this one is shown only now", file=sys.stderr)
    return 0


def _patch_user(args: argparse.Namespace, body: dict[str, Any]) -> int:
    with client(args) as c:
        user = c.json("PATCH", f"/v1/users/{args.name}", json=body)
    if args.json:
        return print_json(user)
    _print_user(user)
    return 0


def cmd_users_set(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if quotas := _quotas(args):
        body["quotas"] = quotas
    if args.can_submit_code is not None:
        body["can_submit_code"] = args.can_submit_code == "yes"
    if not body:
        fail("nothing to change: give a quota option (--max-gpus, ...) or --can-submit-code yes|no")
    return _patch_user(args, body)


def cmd_users_disable(args: argparse.Namespace) -> int:
    return _patch_user(args, {"disabled": args.users_command == "disable"})


def cmd_me(args: argparse.Namespace) -> int:
    with client(args) as c:
        me = c.json("GET", "/v1/me")
    if args.json:
        return print_json(me)
    used = me.get("storage_used_gb")
    cap = me["quotas"].get("max_storage_gb")
    stored = f"  storage {used or 0:.2f} GB" + (f" of {cap:g}" if cap else "")
    print(f"{me['name']}  {me['role']}  {_quota_text(me['quotas'])}{stored}  at {c.url}")
    return 0


def cmd_admin_bootstrap(args: argparse.Namespace) -> int:
    """Create the admin user, or point its token at ``TLAB_ADMIN_TOKEN``, straight in Redis (safe to repeat)."""
    import redis

    from service.core.store import Store

    token = os.environ.get("TLAB_ADMIN_TOKEN", "").strip()
    if not token:
        fail("TLAB_ADMIN_TOKEN is empty: set it (compose: .env; Kubernetes: the admin-token key of Secret "
             "tlab-secrets) to the admin's bearer token")
    if token.lower() in WEAK_TOKENS or len(token) < MIN_TOKEN_CHARS:
        fail(f"TLAB_ADMIN_TOKEN is too weak (a placeholder, or under {MIN_TOKEN_CHARS} characters): make one with "
             "python -c \"import secrets; print('tl_' + secrets.token_urlsafe(32))\"")
    url = args.redis_url or os.environ.get("REDIS_URL", "")
    if not url:
        fail("REDIS_URL is not set: give --redis-url redis://HOST:6379/0 or set REDIS_URL")
    store = Store.from_url(url)
    try:
        existing = store.user(args.name)
        if existing is not None and existing.role != "admin":
            fail(f"--name: user {args.name!r} exists with role {existing.role}, not admin: pick another name")
        store.ensure_admin(args.name, token)
    except redis.RedisError as err:
        fail(f"REDIS_URL: cannot use Redis: {err}")
    print(f"admin {args.name!r} {'token re-pointed (the old one is refused)' if existing else 'created'}; it signs "
          "in with TLAB_ADMIN_TOKEN")
    return 0


def _add_users(sub: Any) -> None:
    users = sub.add_parser("users", help="(admins) create users with quotas, list, change, disable them; rotate tokens")
    users_sub = users.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    p = users_sub.add_parser("create", help="create a user; prints its token once")
    p.add_argument("name", help="lower-case login name")
    p.add_argument("--role", default="user", choices=["user", "admin"])
    _add_quota_args(p)
    p.add_argument("--json", action="store_true", help="print {user, token} as JSON")
    p.set_defaults(func=cmd_users_create)
    add_remote_args(p)
    add_read_command(users_sub, "list", "every user, role, status and quotas", cmd_users_list)
    add_read_command(users_sub, "rotate", "a new token for NAME (yourself, or anyone as an admin), printed once; "
                     "the old one is refused at once", cmd_users_rotate, "name")
    p = users_sub.add_parser("set", help="change NAME's quotas (only those given) or --can-submit-code")
    p.add_argument("name")
    _add_quota_args(p)
    p.add_argument("--can-submit-code", choices=["yes", "no"], default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_users_set)
    add_remote_args(p)
    for action, text in (("disable", "refuse NAME's tokens at once (its jobs stay)"),
                         ("enable", "let NAME's current token in again")):
        add_read_command(users_sub, action, text, cmd_users_disable, "name")


def add_commands(sub: Any) -> None:
    _add_users(sub)
    add_read_command(sub, "me", "who the token belongs to, and its quotas", cmd_me)

    admin = sub.add_parser("admin", help="deployment chores that talk to Redis directly")
    admin_sub = admin.add_subparsers(dest="admin_command", metavar="ACTION", required=True)
    p = admin_sub.add_parser("bootstrap", help="create the admin user, or point its token at TLAB_ADMIN_TOKEN "
                                               "(REDIS_URL); safe to run at every start")
    p.add_argument("--name", default="admin", help="the admin's user name (default: admin)")
    p.add_argument("--redis-url", default=None, help="default: REDIS_URL")
    p.set_defaults(func=cmd_admin_bootstrap)
