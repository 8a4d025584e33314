"""Dependencies (``after``) and notifications (``notify``) of a job or sweep: the submit fields and the webhook body.

A webhook POST carries ``WebhookPayload`` as JSON; its ``X-Tlab-Signature: sha256=<hex>`` header is the
HMAC-SHA256 of the raw body with the owner's webhook secret (``GET /v1/me/webhook-secret``)::

    expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(expected, request.headers["X-Tlab-Signature"])
"""

from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api_schemas.keys import JOB_ID_PATTERN

MAX_AFTER = 16  # jobs one submission may wait for
NotifyState = Literal["succeeded", "failed", "cancelled", "preempted"]
NOTIFY_STATES: tuple[str, ...] = ("succeeded", "failed", "cancelled", "preempted")
SIGNATURE_HEADER = "X-Tlab-Signature"

JobRef = Annotated[str, Field(pattern=JOB_ID_PATTERN, description="a job id, as the API returned it")]
After = Annotated[list[JobRef], Field(max_length=MAX_AFTER, description=(
    f"job ids (at most {MAX_AFTER}, your own; admins: anyone's) that must all succeed before this one starts; "
    "if one fails or is cancelled this one ends failed"))]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def webhook_host(url: str) -> str:
    """The URL's host name (lower case), or ValueError unless it is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{parts.scheme or 'no'} scheme: give an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("the URL has no host: give e.g. https://hooks.example.org/tlab")
    return parts.hostname.lower()


class Notify(_Strict):
    """``notify``: POST a signed JSON to ``webhook`` when the job reaches one of the ``on`` states
    (``preempted``: a running job sent back to the queue)."""

    webhook: str = Field(..., max_length=2000, description="an http(s) URL; admins may restrict hosts "
                                                           "(TLAB_WEBHOOK_ALLOW)")
    on: list[NotifyState] = Field(default_factory=lambda: list(NOTIFY_STATES), min_length=1, max_length=4,
                                  description="the states that send a POST (default: all four)")

    @field_validator("webhook")
    @classmethod
    def _http_only(cls, url: str) -> str:
        webhook_host(url)
        return url


class WebhookPayload(_Strict):
    """What a webhook receives (JSON, signed with ``X-Tlab-Signature``)."""

    id: str
    name: str
    owner: str
    kind: Literal["experiment", "sweep"]
    state: NotifyState
    reason: str = ""
    summary: dict[str, Any] | None = None
    link: str = Field(..., description="the job's API URL")


class WebhookSecret(_Strict):
    """``GET /v1/me/webhook-secret``: the key your webhooks are signed with (made on first use)."""

    secret: str
    header: str = SIGNATURE_HEADER
    algorithm: str = "HMAC-SHA256 over the raw body, hex, prefixed 'sha256='"
