"""Admission without HTTP: which nodes a gang must fit, and what a dry run answers in each case."""

from __future__ import annotations

import json

from api_schemas.jobs import ClusterView, Demand, NodeView
from service.api.enqueue import dry_run_view, known_nodes, never_fits

NODES = json.dumps([{"id": "n1", "cpus": 4, "gpus": 1}, {"id": "n2", "cpus": 4, "gpus": 1}])


def view(free_cpus: float) -> ClusterView:
    nodes = [NodeView(id=i, alive=True, cpus_total=4, cpus_free=free_cpus, gpus_total=1, gpus_free=1)
             for i in ("n1", "n2")]
    return ClusterView(nodes=nodes, cpus_total=8, cpus_free=2 * free_cpus, gpus_total=2, gpus_free=2,
                       running_jobs=[], scheduler_alive=True)


def gang(workers: int, cpus: float = 1.0, gpus: float = 0.0) -> Demand:
    return Demand(workers=workers, cpus_per_worker=cpus, gpus_per_worker=gpus)


def test_known_nodes_prefer_the_configured_cluster_then_the_schedulers_view() -> None:
    assert [n.id for n in known_nodes(NODES, None) or []] == ["n1", "n2"]
    assert [(n.id, n.cpus) for n in known_nodes("", view(free_cpus=1)) or []] == [("n1", 4), ("n2", 4)]
    assert known_nodes("", None) is None  # nothing known yet: nothing is refused as never fitting


def test_never_fits_names_the_shortfall_and_is_silent_when_nothing_is_known() -> None:
    nodes = known_nodes(NODES, None)
    assert never_fits(gang(2, gpus=1), nodes) is None
    assert "GPU" in (never_fits(gang(3, gpus=1), nodes) or "")
    assert never_fits(gang(100), None) is None


def test_dry_run_fits_now_only_where_the_scheduler_saw_room() -> None:
    nodes = known_nodes("", view(free_cpus=4))
    ok = dry_run_view(gang(2, cpus=3), view(free_cpus=4), nodes)
    assert ok.fits_ever and ok.fits_now and sorted(ok.placement) == ["n1", "n2"] and ok.reason is None
    busy = dry_run_view(gang(2, cpus=3), view(free_cpus=1), nodes)
    assert busy.fits_ever and not busy.fits_now and busy.placement == [] and "wait in the queue" in (busy.reason or "")
    never = dry_run_view(gang(2, cpus=5), view(free_cpus=4), nodes)
    assert not never.fits_ever and not never.fits_now and never.reason


def test_dry_run_without_a_scheduler_uses_the_configured_nodes_or_says_it_does_not_know() -> None:
    static = dry_run_view(gang(1, gpus=1), None, known_nodes(NODES, None))
    assert static.fits_now and static.placement in (["n1"], ["n2"])
    unknown = dry_run_view(gang(1), None, None)
    assert unknown.fits_ever and not unknown.fits_now and "no scheduler has reported" in (unknown.reason or "")
