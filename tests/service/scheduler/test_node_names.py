"""Nodes are named by host name and address in the cluster view and in node-loss messages; a node Ray declared dead
stays listed, not alive, with nothing free."""

from __future__ import annotations

from service.cli.stack import node_name
from service.rules.policy import Node, node_label
from service.scheduler.cluster_view import cluster_view

RAY_ID = "f" * 56


def test_a_node_is_named_host_and_address_else_by_its_ids_head() -> None:
    assert node_label(RAY_ID, "gpu-3", "10.0.0.13") == "gpu-3 (10.0.0.13)"
    assert node_label(RAY_ID, None, "10.0.0.13") == "10.0.0.13"
    assert node_label(RAY_ID, None, None) == RAY_ID[:12]
    assert Node(RAY_ID, 1, 0, hostname="gpu-3", address="10.0.0.13").label == "gpu-3 (10.0.0.13)"


def test_the_view_keeps_a_dead_node_with_its_names_and_nothing_free() -> None:
    alive = Node("a" * 56, 2, 0, hostname="cpu-1", address="10.0.0.11")
    dead = Node(RAY_ID, 4, 1, hostname="gpu-3", address="10.0.0.13")
    view = cluster_view([alive], [], lost=[dead])
    rows = {n.id: n for n in view.nodes}
    assert rows[alive.id].alive and rows[alive.id].hostname == "cpu-1"
    gone = rows[dead.id]
    assert not gone.alive and (gone.hostname, gone.address) == ("gpu-3", "10.0.0.13")
    assert (gone.cpus_free, gone.gpus_free) == (0.0, 0.0)
    assert (view.cpus_total, view.gpus_total) == (2, 0)  # the totals count what can run: the alive nodes
    assert node_name(gone.model_dump()) == "gpu-3 (10.0.0.13)"
