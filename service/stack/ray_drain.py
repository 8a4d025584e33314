"""``python -m service.stack.ray_drain GCS ADDRESS TEMP DEADLINE_S MESSAGE``: ask Ray's GCS at GCS to drain this
machine's node (the alive node started with ``--temp-dir TEMP``, at ADDRESS), as ``ray drain-node`` does, for a
preemption (a reason Ray never refuses): Ray places nothing new there, and the node's raylet ends itself once idle.
DEADLINE_S only tells Ray when the node will stop; stopping it is the caller's part (``service.stack.leave``).

Run in a process of its own, with the cluster's Ray token in its environment (``RAY_AUTH_TOKEN``), so a GCS that
does not answer holds up ``tlab join``'s leave no longer than that process's timeout. Prints one line."""

from __future__ import annotations

import sys
import time

GCS_TIMEOUT_S = 10


def node_id(alive: list, address: str, temp: str) -> str | None:
    """The hex id of the node of ``alive`` (GcsNodeInfo) started with ``temp`` (a folder of its own), else of the one
    node at ``address``, if there is one only."""
    here = [n for n in alive if n.node_manager_address == address]
    mine = [n for n in alive if temp and n.temp_dir == temp] or (here if len(here) == 1 else [])
    return mine[0].node_id.hex() if mine else None


def alive_nodes(gcs: object) -> list:
    """The nodes Ray's GCS (a ``GcsClient``) lists alive, as ``GcsNodeInfo``."""
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    return list(gcs.get_all_node_info(  # type: ignore[attr-defined]
        timeout=GCS_TIMEOUT_S, state_filter=GcsNodeInfo.GcsNodeState.ALIVE).values())


def named(nodes: list) -> str:
    """Nodes as a line says them: address (temp dir), ..."""
    return ", ".join(f"{n.node_manager_address} ({n.temp_dir})" for n in nodes)


def main(argv: list[str]) -> int:
    gcs_address, address, temp, deadline_s, message = argv
    import ray._raylet
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=gcs_address)
    alive = alive_nodes(gcs)
    found = node_id(alive, address, temp)
    if found is None:
        print(f"Ray lists no alive node of this machine at {address} (its temp dir {temp}) but {named(alive)}: "
              "nothing to drain")
        return 1
    deadline_ms = int(time.time() * 1000) + int(deadline_s) * 1000
    accepted, refusal = gcs.drain_node(found, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       message, deadline_ms, timeout=GCS_TIMEOUT_S)
    if not accepted:
        print(f"Ray refused to drain node {found[:12]}: {refusal}")
        return 1
    print(f"Ray drains node {found[:12]}: it places nothing new here")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
