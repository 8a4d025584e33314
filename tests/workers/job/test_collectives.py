"""The gang's collectives are bound to the interface of the node's address (workers.job.collectives)."""

from __future__ import annotations

import psutil

from workers.job.collectives import SETTINGS, interface_of, socket_env


def an_address() -> tuple[str, str]:
    """(interface, IPv4 address) of a non-loopback interface here."""
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return name, a.address
    raise AssertionError("no non-loopback IPv4 interface on this machine")


def test_the_interface_holding_the_node_address_is_chosen_for_gloo_and_nccl() -> None:
    name, ip = an_address()
    assert interface_of(ip) == name
    assert socket_env(ip, {}) == dict.fromkeys(SETTINGS, name)


def test_an_admins_own_setting_wins_and_loopback_or_unknown_addresses_set_nothing() -> None:
    _, ip = an_address()
    assert socket_env(ip, {"GLOO_SOCKET_IFNAME": "bond0"}) == {"GLOO_SOCKET_IFNAME": "bond0"}
    assert socket_env("127.0.0.1", {}) == {}
    assert socket_env("", {}) == {}
    assert socket_env("192.0.2.250", {}) == {}  # an address no interface here holds
