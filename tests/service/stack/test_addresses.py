"""Where `tlab up --listen` listens and where `tlab join` speaks from (service.stack.addresses): never an address
of another machine, never loopback towards a head elsewhere; each refusal one line saying what to give."""

from __future__ import annotations

import pytest

from service.stack.addresses import AddressRefused, is_loopback, node_address, reachable, route_source


def own_address() -> str:
    """The source of this machine's default route (skips on a machine with no route at all)."""
    try:
        return route_source("192.0.2.1")
    except OSError:
        pytest.skip("this machine has no default route")


def test_loopback_is_the_default_and_a_machine_address_is_its_own() -> None:
    assert reachable("127.0.0.1") == "127.0.0.1"
    assert reachable("localhost") == "127.0.0.1"
    own = own_address()
    assert reachable(own) == own
    assert reachable("0.0.0.0") == own


def test_an_address_of_another_machine_is_refused_saying_what_to_give() -> None:
    with pytest.raises(AddressRefused, match="not an address of this machine; give one of `ip -brief address`"):
        reachable("198.51.100.77")


def test_a_node_joins_from_its_route_to_the_head_and_never_from_loopback_towards_another_machine() -> None:
    own_address()
    assert not is_loopback(node_address("192.0.2.1"))
    assert node_address("127.0.0.1") == "127.0.0.1"  # a head on this machine, for a node on it too
    with pytest.raises(AddressRefused, match="loopback.*set --address"):
        node_address("192.0.2.1", "127.0.0.1")
