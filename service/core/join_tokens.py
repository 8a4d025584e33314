"""Join tokens (``tlab join-token``): made and revoked by an admin, checked when a machine joins
(``POST /v1/nodes/join``) and when it leaves (``/v1/nodes/leave``). Only the token's sha256 is kept; a revoked
token is gone from ``keys.join_tokens``, so the next join or leave with it is refused. Revoking does not cut off a
node already joined: ``tlab leave`` on it (which then stops its node without moving its jobs first: they resume
elsewhere once the node is seen gone), or rotate the cluster's Ray token (``$TLAB_HOME/ray.token``) and restart.

An address a node joined from is bound to the token it joined with (``keys.nodes_joined``): the join from an address
is the claim on it, and another token joins nothing from there and takes nothing out from there (one token's
machine cannot take another's node, or the head, out of the cluster). Revoking a token frees its addresses."""

from __future__ import annotations

import hmac
import json
import secrets

import redis

from api_schemas import keys
from api_schemas.nodes import JoinTokenView
from service.core.errors import InvalidState, Unauthorized
from service.core.store import hash_token

PREFIX = "tlj_"  # a join token is told apart from a user's (tl_) at a glance
MAX_ADDRESSES = 1024  # addresses one join token may have joined from (each kept until the token is revoked)


def create(r: redis.Redis, note: str, now: float) -> tuple[JoinTokenView, str]:
    """A new join token: its view and the secret (``tlj_<id>.<secret>``), which is not kept."""
    token_id = secrets.token_hex(6)
    secret = f"{PREFIX}{token_id}.{secrets.token_urlsafe(32)}"
    view = JoinTokenView(id=token_id, note=note, created_at=now)
    r.hset(keys.join_tokens(), token_id, json.dumps({"sha256": hash_token(secret), **view.model_dump()}))
    return view, secret


def listed(r: redis.Redis) -> list[JoinTokenView]:
    raws = r.hgetall(keys.join_tokens()).values()
    rows = [json.loads(raw) for raw in raws]
    return sorted((JoinTokenView(**{k: v for k, v in row.items() if k != "sha256"}) for row in rows),
                  key=lambda v: v.created_at)


def revoke(r: redis.Redis, token_id: str) -> bool:
    """Revoke the token; the addresses its nodes joined from are free to join from again (with another token)."""
    freed = [address for address, holder in r.hgetall(keys.nodes_joined()).items() if holder == token_id]
    if freed:
        r.hdel(keys.nodes_joined(), *freed)
    return bool(r.hdel(keys.join_tokens(), token_id))


def bind(r: redis.Redis, address: str, token_id: str) -> None:
    """Bind ``address`` to ``token_id`` at a join (already its: nothing); 409 naming ``address`` when another token
    holds it, or when ``token_id`` holds ``MAX_ADDRESSES`` others already."""
    holder = r.hget(keys.nodes_joined(), address)
    if holder is None and list(r.hvals(keys.nodes_joined())).count(token_id) >= MAX_ADDRESSES:
        raise InvalidState(f"join token {token_id} joined {MAX_ADDRESSES} addresses already: ask the admin for "
                           "another", field="address")
    if holder is None and not r.hsetnx(keys.nodes_joined(), address, token_id):
        holder = r.hget(keys.nodes_joined(), address)  # another join from there won the race
    if holder not in (None, token_id):
        raise InvalidState(f"a node joined from {address} with join token {holder}: join from there with that "
                           f"token, or have the admin revoke it (`tlab join-token --revoke {holder}`)", field="address")


def holder(r: redis.Redis, address: str) -> str | None:
    """The id of the join token a node joined from ``address`` with (None: no node joined from there)."""
    return r.hget(keys.nodes_joined(), address)


def check(r: redis.Redis, secret: str) -> str:
    """The id of the join token ``secret``; 401 for an unknown or revoked one."""
    token_id = secret.removeprefix(PREFIX).partition(".")[0] if secret.startswith(PREFIX) else ""
    raw = r.hget(keys.join_tokens(), token_id) if token_id else None
    row = json.loads(raw) if raw else {}
    if not row or not hmac.compare_digest(str(row.get("sha256", "")), hash_token(secret)):
        raise Unauthorized("unknown or revoked join token: ask the admin for one (`tlab join-token` on the head)")
    return token_id


def counted(r: redis.Redis, token_id: str) -> None:
    """One more join granted with the token (its ``joins``; nothing if it was revoked meanwhile)."""
    raw = r.hget(keys.join_tokens(), token_id)
    if raw:
        row = json.loads(raw)
        row["joins"] = int(row.get("joins", 0)) + 1
        r.hset(keys.join_tokens(), token_id, json.dumps(row))
