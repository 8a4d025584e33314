"""Which dead Ray nodes the cluster view lists as lost (``lost_of``): a host's history read as its admin would."""

from __future__ import annotations

from service.launch.ray_cluster import NodeRecord, lost_of
from service.rules.policy import Node


def record(node_id: str, host: str, *, alive: bool = False, left: bool = False, started: int = 0) -> NodeRecord:
    address = {"a": "10.0.0.11", "b": "10.0.0.12"}[host]
    return NodeRecord(Node(id=node_id, cpus=1, gpus=0, hostname=host, address=address), alive, left, started)


def ids(records: list[NodeRecord]) -> list[str]:
    return [n.id for n in lost_of(records)]


def test_a_node_lost_is_listed_until_its_host_is_back():
    assert ids([record("a1", "a", started=1), record("b1", "b", alive=True, started=1)]) == ["a1"]
    assert ids([record("a1", "a", started=1), record("a2", "a", alive=True, started=2)]) == []


def test_a_node_that_left_on_purpose_is_not_lost():
    assert ids([record("a1", "a", left=True, started=1)]) == []


def test_a_host_lost_then_joined_again_and_taken_out_is_out_not_lost():
    # killed, rebooted and joined again, cut off and joined again, then `tlab leave`: none of its nodes is lost
    history = [record("b1", "b", started=1), record("b2", "b", started=2), record("b3", "b", left=True, started=3)]
    assert ids(history) == []
    assert ids([*history, record("a1", "a", alive=True, started=4)]) == []


def test_only_the_latest_loss_of_a_host_is_listed():
    # joined again after its first loss, then lost again: one lost node for the host, the one that was last
    assert ids([record("a1", "a", started=1), record("a2", "a", started=2)]) == ["a2"]
    assert ids([record("a2", "a", started=2), record("a1", "a", started=1)]) == ["a2"]  # in whatever order Ray lists
