"""Which network interface a rank's collectives use: the one holding its Ray node's address.

Left to themselves gloo and NCCL pick an address from the host name, and a Debian host's name resolves to
127.0.1.1: the other hosts' ranks then dial loopback and the gang fails after minutes (``Gloo connectFullMesh
failed ... remote=[127.0.1.1]``). The node's address is the one Ray speaks from (``tlab join`` checks it), so the
interface that holds it is the one its peers reach; the payload gets it as ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` (an admin's own setting of either wins)."""

from __future__ import annotations

import ipaddress
import os
import sys
from collections.abc import Mapping

SETTINGS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_ip() -> str:
    """This Ray node's address, as Ray knows it ('' outside a Ray worker)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.util.get_node_ip_address())


def interface_of(ip: str) -> str:
    """The name of the interface that holds ``ip`` ('' when none here does)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return ""


def socket_env(ip: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for a rank on the node at ``ip``: the admin's when set, else
    the interface holding ``ip``; nothing for a loopback node (one machine: any interface reaches itself)."""
    given = {k: environ[k] for k in SETTINGS if environ.get(k)}
    if given or not ip or ipaddress.ip_address(ip).is_loopback:
        return given
    name = interface_of(ip)
    return dict.fromkeys(SETTINGS, name) if name else {}
