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


def _quotas(args: argparse.Namespace) -> dict[str, Any]:
    """``--quota FIELD=VALUE`` items, then the named options (which win)."""
    quotas: dict[str, Any] = {}
    for item in args.quota:
        field, sep, value = item.partition("=")
        if not sep or not field:
            fail(f"--quota {item!r}: expected FIELD=VALUE, e.g. --quota max_gpus=4")
        quotas[field.strip()] = _quota_value(value.strip())
    if args.max_gpus is not None:
        quotas["max_gpus"] = args.max_gpus
    if args.max_running_jobs is not None:
        quotas["max_running_jobs"] = args.max_running_jobs
    return quotas


def cmd_users_create(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "role": args.role}
    if quotas := _quotas(args):
        body["quotas"] = quotas
    with client(args) as c:
        created = c.json("POST", "/v1/users", json=body)
    if args.json:
        return print_json(created)
    user = created["user"]
    print(f"{user['name']}  {user['role']}  {_quota_text(user['quotas'])}")
    print(f"token  {created['token']}")
    print("the token is shown only now (Redis keeps its hash): the user sets TLAB_TOKEN to it", file=sys.stderr)
    return 0


def cmd_users_list(args: argparse.Namespace) -> int:
    users = get_json(args, "/v1/users")
    if args.json:
        return print_json(users)
    rows = [("NAME", "ROLE", "CREATED", "QUOTAS")]
    rows += [(u["name"], u["role"], time.strftime("%Y-%m-%d %H:%M", time.localtime(u["created_at"])),
              _quota_text(u["quotas"])) for u in users]
    print_table(rows)
    return 0


def cmd_me(args: argparse.Namespace) -> int:
    with client(args) as c:
        me = c.json("GET", "/v1/me")
    if args.json:
        return print_json(me)
    print(f"{me['name']}  {me['role']}  {_quota_text(me['quotas'])}  at {c.url}")
    return 0


def cmd_admin_bootstrap(args: argparse.Namespace) -> int:
    """Create the admin user, or point its token at ``TLAB_ADMIN_TOKEN``, straight in Redis (safe to repeat)."""
    import redis

    from service.store import Store

    token = os.environ.get("TLAB_ADMIN_TOKEN", "").strip()
    if not token:
        fail("TLAB_ADMIN_TOKEN is empty: set it (compose: .env; Kubernetes: the admin-token key of Secret "
             "tlab-secrets) to the admin's bearer token")
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
    print(f"admin {args.name!r} {'token re-pointed' if existing else 'created'}; it signs in with TLAB_ADMIN_TOKEN")
    return 0


def _add_users(sub: Any) -> None:
    users = sub.add_parser("users", help="(admins) create users with quotas, list them")
    users_sub = users.add_subparsers(dest="users_command", metavar="ACTION", required=True)
    p = users_sub.add_parser("create", help="create a user; prints its token once")
    p.add_argument("name", help="lower-case login name")
    p.add_argument("--role", default="user", choices=["user", "admin"])
    p.add_argument("--max-gpus", type=float, default=None, help="GPUs its starting/running jobs may hold at once")
    p.add_argument("--max-running-jobs", type=int, default=None, help="jobs it may have starting/running at once")
    p.add_argument("--quota", action="append", default=[], metavar="FIELD=VALUE",
                   help="any quota field the API takes (GET /docs: Quotas)")
    p.add_argument("--json", action="store_true", help="print {user, token} as JSON")
    p.set_defaults(func=cmd_users_create)
    add_remote_args(p)
    add_read_command(users_sub, "list", "every user, role and quotas", cmd_users_list)


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
