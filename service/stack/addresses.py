"""Which address of this machine a stack listens on (``tlab up --listen``) and a joining node speaks from (``tlab
join``), in the standard library alone: the address others reach, never a loopback one when they are elsewhere."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"
ANY = frozenset({"0.0.0.0", "::", "*"})
ANY_PEER = "192.0.2.1"  # TEST-NET-1: a route towards it is the machine's default route (no packet is sent)


class AddressRefused(ValueError):
    """An address this machine cannot listen on, or one the other machines could not reach it at."""


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve(name: str) -> str:
    """``name`` as an IPv4 address (itself when it is one)."""
    try:
        return socket.gethostbyname(name)
    except OSError as err:
        raise AddressRefused(f"{name!r} does not resolve ({err}): give an IP address of this machine") from err


def route_source(peer: str) -> str:
    """The address this machine speaks from towards ``peer`` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return str(s.getsockname()[0])


def can_bind(address: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


def reachable(listen: str) -> str:
    """The address others reach a stack bound to ``listen`` at: the address itself (a host name: what it resolves
    to), or for ``0.0.0.0`` the address of the default route. A loopback name stays loopback (the default)."""
    if listen in ANY:
        try:
            found = route_source(ANY_PEER)
        except OSError as err:
            raise AddressRefused(f"--listen {listen}: this machine has no default route; give the address of "
                                 "the interface the other machines reach (ip -brief address)") from err
        return found
    address = resolve(listen)
    if not can_bind(address):
        raise AddressRefused(f"--listen {listen}: {address} is not an address of this machine; give one of "
                             "`ip -brief address`")
    if is_loopback(address) and not is_loopback(listen) and listen != "localhost":
        raise AddressRefused(f"--listen {listen}: the name resolves to {address}, a loopback address (the "
                             "/etc/hosts entry of a Debian host): give this machine's IP address instead")
    return address


def node_address(head: str, given: str = "") -> str:
    """The address a node joining the head at ``head`` (a host or IP) speaks from: ``given``, else the source of
    its route to the head; refused when loopback while the head is not (the head could never call it back)."""
    head_ip = resolve(head)
    address = resolve(given) if given else route_source(head_ip)
    if given and not can_bind(address):
        raise AddressRefused(f"--address {given}: {address} is not an address of this machine; give one of "
                             "`ip -brief address`")
    if is_loopback(address) and not is_loopback(head_ip):
        raise AddressRefused(f"this machine would join from {address} (loopback): set --address to its IP on "
                             f"the network where it reaches {head}")
    return address
