"""``python -m service.stack.ray_registered GCS TEMP TIMEOUT_S``: wait until Ray's GCS at GCS lists alive the node
started with ``--temp-dir TEMP`` (a folder of its own per start), for TIMEOUT_S at most.

A joined node's ``ray start --block`` running is not yet a node of the cluster: its raylet must register with the
head's GCS. ``tlab join`` says a node joined, or is back after a restart, only once this says so
(``service.stack.join``); a raylet that never registers counts as a start that failed. Run in a process of its own
with the cluster's Ray token in its environment (``RAY_AUTH_TOKEN``), as ``service.stack.ray_drain`` is. Prints one
line; exit status 0 when listed, 1 when not within TIMEOUT_S."""

from __future__ import annotations

import sys
import time

from service.stack.ray_drain import alive_nodes, named

POLL_S = 0.5


def main(argv: list[str]) -> int:
    gcs_address, temp, timeout_s = argv[0], argv[1], float(argv[2])
    import ray._raylet

    deadline = time.monotonic() + timeout_s
    gcs = ray._raylet.GcsClient(address=gcs_address)
    seen, error = "", ""
    while True:
        try:
            alive = alive_nodes(gcs)
            mine = [n for n in alive if n.temp_dir == temp]
            if mine:
                print(f"Ray lists this node alive: {mine[0].node_id.hex()[:12]}")
                return 0
            seen, error = named(alive), ""
        except Exception as err:  # the GCS did not answer this time (a head restarting): asked again
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if time.monotonic() >= deadline:
            why = f"the GCS last said {error}" if error else f"it lists only {seen or 'no node'}"
            print(f"Ray's GCS at {gcs_address} did not list this node (temp dir {temp}) alive within {timeout_s:g} s; "
                  f"{why}")
            return 1
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
