"""Where a webhook may go: never to this service's own network (loopback, link-local, private, reserved addresses)
unless ``TLAB_WEBHOOK_ALLOW`` names the host. Otherwise a user's webhook is an internal port scanner run by the
scheduler, whose failures (401 from Ray's dashboard, a timeout from Redis) tell what answers where.

The host is resolved (``getaddrinfo``) at submit and again right before each send, and refused when any of its
addresses is not a public one. A name that does not resolve at submit passes (it may later); at send it is not
sent. The send then goes to the address just checked (``target``: the URL with that address for the name, the
name in ``Host`` and, over TLS, as the SNI name the certificate is checked against), so the name is not resolved a
second time: a name that changes its answer between the check and the connection (DNS rebinding) reaches nothing
new. Hosts that ``TLAB_WEBHOOK_ALLOW`` names are trusted: sent to by name.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

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
    return _check(settings, url, unresolved_ok)[0]


@dataclass(frozen=True)
class Target:
    """Where a webhook's POST goes: ``url`` with the checked address in place of the name, and the name kept in
    ``headers`` (Host) and ``extensions`` (the TLS SNI name, httpcore's ``sni_hostname``)."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extensions: dict[str, Any] = field(default_factory=dict)


def target(settings: Settings, url: str) -> Target | str:
    """Where to send ``url``'s webhook now: the address checked a moment ago, pinned; or one line why not."""
    why, found = _check(settings, url, unresolved_ok=False)
    if why:
        return why
    parts = urlsplit(url)
    if not found or parts.hostname is None:  # a host TLAB_WEBHOOK_ALLOW names: sent to by name
        return Target(url)
    ip = min(found, key=lambda a: (":" in a, a))  # IPv4 first: every one was checked
    port = f":{parts.port}" if parts.port else ""
    user = parts.netloc.rpartition("@")[0]
    netloc = (f"{user}@" if user else "") + (f"[{ip}]" if ":" in ip else ip) + port
    name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    tls = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return Target(urlunsplit(parts._replace(netloc=netloc)), {"Host": name + port}, tls)


def _check(settings: Settings, url: str, unresolved_ok: bool) -> tuple[str, list[str]]:
    """(why not, or ''; the public addresses checked: none for a host TLAB_WEBHOOK_ALLOW names or one that does not
    resolve while ``unresolved_ok``)."""
    try:
        host = webhook_host(url)
    except ValueError as err:
        return str(err), []
    allow = settings.webhook_hosts
    if allow and host not in allow:
        return f"host {host} is not one this service sends webhooks to (TLAB_WEBHOOK_ALLOW)", []
    if host in allow:
        return "", []
    parts = urlsplit(url)
    try:
        found = addresses(host, parts.port or (443 if parts.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError, ValueError):
        return ("" if unresolved_ok else f"host {host} does not resolve"), []
    if any(internal(a) for a in found):
        return (f"host {host} is a loopback, link-local or private address: webhooks go to public hosts only, "
                "unless an admin names the host in TLAB_WEBHOOK_ALLOW"), []
    return "", found
