"""Where a webhook may go: never to this service's own network (loopback, link-local, private, reserved addresses)
unless ``TLAB_WEBHOOK_ALLOW`` names the host. Otherwise a user's webhook is an internal port scanner run by the
scheduler, whose failures (401 from Ray's dashboard, a timeout from Redis) tell what answers where.

The host is resolved (``getaddrinfo``) at submit and again right before each send, and refused when any of its
addresses is not a public one. A name that does not resolve at submit passes (it may later); at send it is not
sent. ``httpx`` resolves again when it connects, so a name that changes its answer within that moment
(DNS rebinding) is the gap left; name the hosts in ``TLAB_WEBHOOK_ALLOW`` to close it.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from api_schemas.notify import webhook_host
from service.core.settings import Settings


def addresses(host: str, port: int) -> list[str]:
    """The host's addresses (an IP literal: itself); ``socket.gaierror`` if it does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def internal(address: str) -> bool:
    """Loopback, link-local, private, shared, reserved, multicast or unspecified: not a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    ip = mapped or ip
    return not ip.is_global or ip.is_multicast


def refusal(settings: Settings, url: str, unresolved_ok: bool) -> str:
    """'' when the webhook may go to ``url``'s host now; else one line saying why (no port, no answer told)."""
    try:
        host = webhook_host(url)
    except ValueError as err:
        return str(err)
    allow = settings.webhook_hosts
    if allow and host not in allow:
        return f"host {host} is not one this service sends webhooks to (TLAB_WEBHOOK_ALLOW)"
    if host in allow:
        return ""
    parts = urlsplit(url)
    try:
        found = addresses(host, parts.port or (443 if parts.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError, ValueError):
        return "" if unresolved_ok else f"host {host} does not resolve"
    if any(internal(a) for a in found):
        return (f"host {host} is a loopback, link-local or private address: webhooks go to public hosts only, "
                "unless an admin names the host in TLAB_WEBHOOK_ALLOW")
    return ""
