"""Machines joining the cluster: join tokens (admin only), the join itself (``tlab join``, with a join token), and
the leave (``tlab leave``, with the token the node joined with: service.core.nodes_leaving). The address a node
joins from is bound to its token (service.core.join_tokens): a token acts on the nodes it joined, no other."""

from __future__ import annotations

import logging
import os
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from api_schemas.nodes import (
    JoinGrant,
    JoinRequest,
    JoinTokenCreate,
    JoinTokenCreated,
    JoinTokenView,
    LeaveRequest,
    LeaveStatus,
)
from service.api.deps import AdminUser, Credentials, StateDep, admin_user
from service.api.responses import ADMIN, AUTHED, BODY, error
from service.api.strict import strict_json
from service.core import join_tokens, nodes_leaving
from service.core.errors import Forbidden, InvalidState, UserNotFound

router = APIRouter(prefix="/v1", tags=["nodes"], responses=AUTHED)
log = logging.getLogger(__name__)

# of the head's settings, those a joining node's Ray node passes to the job processes it starts (its environment)
NODE_SETTINGS = ("TLAB_GANG_TIMEOUT_S", "TLAB_MAX_LOG_MB", "TLAB_DEBUG", "TLAB_DATA", "TLAB_IN_DRIVER",
                 "TLAB_TRIAL_RETRIES", "TLAB_ATTEMPT_LEASE_S", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


@router.post("/join-tokens", status_code=201, responses=ADMIN | BODY,
             dependencies=[Depends(strict_json(JoinTokenCreate, admin_user))])
def create_join_token(body: JoinTokenCreate, st: StateDep, admin: AdminUser) -> JoinTokenCreated:
    """Make a join token (admin only): a machine with it joins as a Ray node (`tlab join`); the token is in this
    response and nowhere else."""
    view, secret = join_tokens.create(st.store.r, body.note, time.time())
    return JoinTokenCreated(token=view, secret=secret)


@router.get("/join-tokens", responses=ADMIN)
def list_join_tokens(st: StateDep, admin: AdminUser) -> list[JoinTokenView]:
    """The join tokens not revoked (admin only), without their secrets."""
    return join_tokens.listed(st.store.r)


@router.delete("/join-tokens/{token_id}", status_code=204, responses=ADMIN | {404: error("no such join token")})
def revoke_join_token(token_id: str, st: StateDep, admin: AdminUser) -> None:
    """Revoke a join token (admin only): the next join with it is refused; nodes already joined stay."""
    if not join_tokens.revoke(st.store.r, token_id):
        raise UserNotFound(f"no join token {token_id!r}: `tlab join-token --list` shows them", field="token_id")


def node_token(st: StateDep, creds: Credentials) -> str:
    """The bearer token as a join token: its id (401 for an unknown or revoked one, or a user's token)."""
    return join_tokens.check(st.store.r, creds.credentials if creds else "")


NodeToken = Annotated[str, Depends(node_token)]


@router.post("/nodes/join", responses=BODY | {409: error("this service lets no node join (tlab up --listen), or "
                                                         "`address` is another join token's or the head's")},
             dependencies=[Depends(strict_json(JoinRequest, node_token))])
def join(body: JoinRequest, st: StateDep, token_id: NodeToken) -> JoinGrant:
    """What a machine with a join token (the bearer token here, never a user's) needs to join as a Ray node. The
    address it joins from is bound to its token: no other token joins from there or takes that node out."""
    address, ray_token = st.settings.join_address, os.environ.get("RAY_AUTH_TOKEN", "")
    if not address:
        raise InvalidState("this service lets no node join: start it with `tlab up --listen ADDR` (or set "
                           "TLAB_JOIN_ADDRESS to the Ray head's host:port)", field="ray_address")
    head = address.rpartition(":")[0].strip("[]")
    if body.address == head or join_tokens.holder(st.store.r, body.address) is None and nodes_leaving.node_ids(
            st.store.r, body.address, alive_only=True):
        raise InvalidState(f"a node that joined with no join token (the head's) is at {body.address}: a machine "
                           "joins from its own address", field="address")
    join_tokens.bind(st.store.r, body.address, token_id)
    join_tokens.counted(st.store.r, token_id)
    log.warning("node %s (%s) joins with join token %s", body.hostname, body.address, token_id)
    nodes_leaving.clear(st.store.r, body.address)  # back: whatever left from this address before is gone
    return JoinGrant(ray_address=address, ray_token=ray_token,
                     env={k: os.environ[k] for k in NODE_SETTINGS if os.environ.get(k)})


def joined_with(st: StateDep, token_id: str, address: str) -> None:
    """Return when the node at ``address`` joined with the join token ``token_id``; 403 otherwise."""
    holder = join_tokens.holder(st.store.r, address)
    if holder != token_id:
        said = "no node joined from there" if holder is None else "its node joined with another join token"
        raise Forbidden(f"this join token takes no node at {address} out ({said}): `tlab leave` on the node, which "
                        "uses the token it joined with", field="address")


@router.post("/nodes/leave", responses=BODY | {403: error("the node at `address` did not join with this token")},
             dependencies=[Depends(strict_json(LeaveRequest, node_token))])
def leave(body: LeaveRequest, st: StateDep, token_id: NodeToken) -> LeaveStatus:
    """Take a node out (`tlab leave`, with the join token it joined with): nothing more starts there, and the jobs
    placed there stop to resume elsewhere from their last checkpoint; the answer lists those still there."""
    joined_with(st, token_id, body.address)
    now = time.time()
    if body.address not in nodes_leaving.current(st.store.r, now):
        log.warning("node %s (%s) leaves, with join token %s", body.hostname, body.address, token_id)
    marked = nodes_leaving.mark(st.store.r, body.hostname, body.address, body.wait_s, now)
    return nodes_leaving.status(st.store, body.address, now) or marked


@router.get("/nodes/leave", responses={403: error("the node at `address` did not join with this token"),
                                       404: error("no node is leaving from that address")})
def leaving(st: StateDep, token_id: NodeToken,
            address: Annotated[str, Query(max_length=64, pattern=r"^[0-9A-Fa-f.:]+$")]) -> LeaveStatus:
    """How a node's leave goes (with the join token it joined with): the jobs still placed on it."""
    joined_with(st, token_id, address)
    found = nodes_leaving.status(st.store, address, time.time())
    if found is None:
        raise UserNotFound(f"no node is leaving from {address}: `tlab leave` on it", field="address")
    return found
