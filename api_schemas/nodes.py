"""Machines joining the cluster (``tlab join-token``, ``tlab join``): the join tokens an admin makes, and what a
node with one is given. A join token lets a machine join as a Ray node; it is never a user's token."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JoinTokenCreate(_Strict):
    note: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f]*$",
                      description="what the token is for (the machines it is handed to)")


class JoinTokenView(_Strict):
    id: str = Field(description="the token's id: `tlab join-token --revoke ID`")
    note: str = ""
    created_at: float
    joins: int = Field(0, description="nodes that joined with it so far")


class JoinTokenCreated(_Strict):
    token: JoinTokenView
    secret: str = Field(description="the join token itself (`tlab join HEAD` reads it from TLAB_JOIN_TOKEN); in "
                                    "this response and nowhere else")


class JoinRequest(_Strict):
    hostname: str = Field(max_length=253, pattern=r"^[A-Za-z0-9._-]+$")
    address: str = Field(max_length=64, pattern=r"^[0-9A-Fa-f.:]+$", description="the IP the node joins from")


class JoinGrant(_Strict):
    """What a node needs to join: the Ray head's address, the cluster's Ray token, and the settings its Ray node
    gives every job process there."""

    ray_address: str = Field(description="the Ray head's GCS address, host:port (`ray start --address`)")
    ray_token: str = Field(description="the cluster's Ray auth token (RAY_AUTH_TOKEN on every Ray process)")
    env: dict[str, str] = Field(default_factory=dict, description="TLAB_* settings of the head's Ray node that "
                                                                  "its job processes read")


class LeaveRequest(JoinRequest):
    """A node leaving (``tlab leave``): the scheduler places nothing more on it and moves the jobs placed there."""

    wait_s: float = Field(120.0, ge=0, le=86400, description="how long the node waits for its jobs to move before "
                                                             "it stops its Ray node anyway")


class LeaveStatus(_Strict):
    """How a node's leave goes: the jobs still placed on it (their attempts stopping, to resume elsewhere from their
    last checkpoint)."""

    hostname: str
    address: str
    since: float = Field(description="when the node asked to leave (seconds since the epoch)")
    until: float = Field(description="when the record of its leave goes (its wait, and some margin)")
    jobs: list[str] = Field(default_factory=list, description="ids of the jobs still placed on the node (starting "
                                                              "or running): it is free to stop once none is left")
