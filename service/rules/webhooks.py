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


# IPv6 prefixes whose last 32 bits are an IPv4 address the packet ends up at: NAT64's well-known prefix (RFC 6052),
# IPv4-compatible (deprecated, ::/96) and IPv4-translated (SIIT, ::ffff:0:0:0/96) addresses. IPv4-mapped
# (::ffff:0:0/96) and 6to4 (2002::/16) have properties of their own in ``ipaddress``.
LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in ("64:ff9b::/96", "::/96", "::ffff:0:0:0/96"))
# NAT64 for local use (RFC 8215): the site's own translator, whatever IPv4 inside; Teredo (2001::/32): a tunnel
# whose client address is obfuscated in the last bits. Neither is a public host.
NEVER = tuple(ipaddress.ip_network(n) for n in ("64:ff9b:1::/48", "2001::/32"))


def inner_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries traffic to (IPv4-mapped, NAT64, 6to4, compatible, translated)."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in LAST_32_BITS):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def internal(address: str) -> bool:
    """Loopback, link-local, private, shared, reserved, multicast or unspecified: not a public address. An IPv6
    address that carries an IPv4 one (IPv4-mapped, NAT64, 6to4) is judged by the IPv4 inside; local-use NAT64 and
    Teredo never pass."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if any(ip in net for net in NEVER):
            return True
        ip = inner_ipv4(ip) or ip
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
