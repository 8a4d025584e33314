"""What a Ray job's driver asks Ray for (``service.launch.ray_cluster``): a 1-worker experiment trains in its driver, so
the driver holds the worker's CPUs and GPUs on the planned node; everything else holds nothing itself."""

from __future__ import annotations

import json
import time

import pytest

from api_schemas.jobs import Demand
from service.cli.client import Client
from service.core.store import Store
from service.launch.ray_cluster import RayNodes, Used, driver_options, gpu_env, gpu_type_of, trains_in_driver
from service.stack.embedded import Stack
from tests.service.conftest import ray_rest, ray_state, tiny

NODE = "ab" * 28  # a Ray node id: 56 hex digits


def test_an_experiment_trains_in_its_driver_which_holds_rank_0s_resources() -> None:
    one, two = Demand(workers=1, cpus_per_worker=2, gpus_per_worker=0.5), Demand(workers=2, cpus_per_worker=1,
                                                                                 gpus_per_worker=0)
    assert trains_in_driver("workers.run", one, {})
    assert trains_in_driver("workers.run", two, {})  # rank 0 of the gang it leads (workers.on_ray.gang)
    assert not trains_in_driver("workers.run", one, {"TLAB_IN_DRIVER": "0"})  # the escape hatch: TorchTrainer
    assert not trains_in_driver("workers.sweep", one, {})
    assert driver_options(one, [NODE]) == {"entrypoint_num_cpus": 2, "entrypoint_num_gpus": 0.5,
                                           "entrypoint_label_selector": {"ray.io/node-id": NODE}}
    assert driver_options(one, ["n1"]) == {"entrypoint_num_cpus": 2, "entrypoint_num_gpus": 0.5}  # a static node
    assert driver_options(None, [NODE]) == {"entrypoint_num_cpus": 0}  # the worker group or trials hold them
    typed = one.model_copy(update={"gpu_type": "H100"})
    assert driver_options(typed, ["n1"])["entrypoint_resources"] == {"accelerator_type:H100": 0.001}


def test_a_job_without_gpus_is_shown_none_and_a_nodes_gpu_model_is_read_from_its_resources() -> None:
    none, share = Demand(workers=2, cpus_per_worker=1, gpus_per_worker=0), Demand(workers=1, cpus_per_worker=1,
                                                                                  gpus_per_worker=0.5)
    assert gpu_env(none) == {"CUDA_VISIBLE_DEVICES": ""}  # Ray 2.60 leaves it unset for 0 GPUs: every card shows
    assert gpu_env(share) == {} and gpu_env(None) == {}  # Ray names the share's card itself
    assert gpu_type_of({"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0}) == "H100"
    assert gpu_type_of({"CPU": 8.0}) is None


class Counted(RayNodes):
    """RayNodes whose asking the head for its usage report is counted (the answer: the count, as CPUs in use)."""

    asked = 0

    def ask_usage(self) -> dict[str, Used]:
        self.asked += 1
        return {"n1": Used(float(self.asked), 0.0)}


def test_rays_usage_report_is_asked_again_only_after_refresh_s() -> None:
    nodes = Counted("http://127.0.0.1:9", refresh_s=0.3)
    assert nodes.usage() == nodes.usage() == {"n1": Used(1.0, 0.0)} and nodes.asked == 1
    calls, deadline = 0, time.monotonic() + 10
    while nodes.usage() == {"n1": Used(1.0, 0.0)}:  # every call until refresh_s has passed answers the kept report
        calls += 1
        assert time.monotonic() < deadline, "the report was never asked again"
        time.sleep(0.01)
    assert nodes.asked == 2 and calls > 1, calls  # asked once more, when it was due, whatever the calls between


def test_the_node_list_is_asked_each_time() -> None:
    nodes = RayNodes("http://127.0.0.1:9", refresh_s=60)  # nothing listens there: no answer is kept
    for _ in range(2):
        with pytest.raises(Exception, match="127.0.0.1:9"):
            nodes.nodes()


def alive_actors(stack: Stack) -> list[dict]:
    """Ray's own list of alive actors (its State REST API, with the cluster's token)."""
    with ray_rest(stack) as http:
        return [{"class": a["class_name"], "node": a.get("node_id"), "resources": a.get("required_resources")}
                for a in ray_state(http, "actors") if a["state"] == "ALIVE"]


@pytest.mark.slow
def test_ray_holds_a_one_worker_jobs_cpu_in_its_driver_on_the_planned_node(stack: Stack) -> None:
    from tests.service.conftest import wait_ray_idle

    wait_ray_idle(stack)
    with Client(stack.url, stack.admin_token) as c:
        job = c.submit(tiny(training={"epochs": 100_000}))["id"]
        for event in c.events(job):
            if event.kind == "metric":
                break
        placement = json.loads(Store.from_url(stack.redis_url or "").raw(job)["placement"])
        deadline = time.monotonic() + 30
        while not (held := [a for a in alive_actors(stack) if (a["resources"] or {}).get("CPU")]):
            assert time.monotonic() < deadline, alive_actors(stack)
            time.sleep(0.5)
        c.cancel(job)
    # the job's driver (Ray's JobSupervisor actor) holds the worker's 1 CPU; no Ray Train worker exists
    assert [(a["class"], a["resources"]["CPU"], a["node"]) for a in held] == [("JobSupervisor", 1.0, placement[0])]


@pytest.mark.slow
def test_a_jobs_memory_is_reserved_in_ray_and_one_ray_has_no_memory_for_waits_in_the_queue(stack: Stack) -> None:
    """``resources.memory_gb`` is Ray's ``memory`` resource on the node: the driver reserves it, the cluster view
    shows it, a job asking more than any node has is refused at submit, and one asking more than is left waits in
    the queue saying so (before, it started on the free CPU and sat in Ray as ``starting``)."""
    from tests.service.conftest import wait_for, wait_ray_idle

    wait_ray_idle(stack)
    with Client(stack.url, stack.admin_token) as c:
        wait_for(lambda: c.json("GET", "/v1/cluster")["nodes"], 60, "the cluster's nodes")
        total = c.json("GET", "/v1/cluster")["nodes"][0]["memory_gb_total"]
        assert total > 1.5, total  # Ray's logical memory of this machine's head, in GiB
        a = c.submit(tiny(training={"epochs": 100_000}, resources={"memory_gb": 1}))["id"]
        for event in c.events(a):
            if event.kind == "metric":
                break
        node = c.json("GET", "/v1/cluster")["nodes"][0]
        assert node["memory_gb_free"] <= total - 1 + 1e-6 and node["jobs"][0]["memory_gb"] == 1
        wait_for(lambda: ("JobSupervisor", float(2**30)) in [
            (x["class"], (x["resources"] or {}).get("memory")) for x in alive_actors(stack)], 60, "the driver's 1 GiB")
        with pytest.raises(Exception, match=r"resources\.memory_gb=.* but the largest node has"):
            c.submit(tiny(resources={"memory_gb": round(total + 1, 1)}))
        b = c.submit(tiny(resources={"memory_gb": round(total - 0.5, 2)}))["id"]
        wait_for(lambda: (c.get(b).get("pending_reason") or "").startswith("no room"), 60, "b's reason")
        view = c.get(b)
        assert view["state"] == "queued" and "GiB of memory free" in view["pending_reason"], view
        c.cancel(a)
        wait_for(lambda: c.get(b)["state"] in ("running", "succeeded"), 60, "b to start once a's memory is back")
        c.cancel(b)
