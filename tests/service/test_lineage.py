"""Continue and fork on the real stack (API, scheduler, Redis, Ray): a 3-epoch job, then a continuation of 2 more
epochs and a fork from epoch 2 with another tau, run through a scheduler restart; the child's own stream holds its
own epochs once, its metrics and plot join its parent's. (The refusals are tests/service/api/test_lineage_api.py's,
the driver's start from a checkpoint tests/workers/job/test_lineage_start.py's.)"""

from __future__ import annotations

import signal

import pytest

from service.cli.client import Client
from service.stack.embedded import Stack
from tests.service.conftest import Api, tiny
from tests.service.test_failure_reasons import wait_ended


@pytest.mark.slow
@pytest.mark.parametrize("stack_env", [{"TLAB_KEEP_ENDED_CHECKPOINTS": "3"}])  # the fork names epoch 2 of 3: the
def test_continue_and_fork_go_on_from_the_parents_checkpoint(stack: Stack) -> None:  # default keeps the newest only
    api = Api(stack)
    api.add_user("ann")
    api.add_user("bob")
    with api.client("ann") as ann, api.client("bob") as bob, Client(stack.url, api.tokens["ann"]) as cli:
        parent = ann.post("/v1/experiments", json={"spec": tiny(training={"epochs": 3, "batch_size": 64})}).json()
        r = ann.post(f"/v1/experiments/{parent['id']}/continue", json={"epochs": 2})
        assert r.status_code == 409 and "once it has ended" in r.text  # queued or running: not yet
        assert wait_ended(cli, parent["id"])["state"] == "succeeded"
        assert bob.post(f"/v1/experiments/{parent['id']}/continue", json={"epochs": 2}).status_code == 403

        cont = ann.post(f"/v1/experiments/{parent['id']}/continue", json={"epochs": 2}).json()
        # the fork runs as a 2-worker TorchTrainer: Ray Train's resume_from path, from a 1-worker parent's checkpoint
        fork = ann.post(f"/v1/experiments/{parent['id']}/fork", json={"from_epoch": 2, "set": {
            "teleport.tau": 0.99, "resources.workers": 2, "resources.cpus_per_worker": 0.5}}).json()
        assert (cont["parent_epoch"], fork["parent_epoch"], fork["spec"]["teleport"]["tau"]) == (3, 2, 0.99)
        stack.kill("scheduler", signal.SIGTERM)  # the lineage and the start checkpoint are in Redis
        stack.start_service(("scheduler",))
        for child in (cont, fork):
            assert wait_ended(cli, child["id"])["state"] == "succeeded", child["id"]

        joined = ann.get(f"/v1/experiments/{cont['id']}/metrics").json()["points"]
        assert [(p["job"], p["epoch"]) for p in joined] == [(parent["id"], 0), (parent["id"], 1), (parent["id"], 2),
                                                             (cont["id"], 3), (cont["id"], 4)]
        first, own = joined[0]["train_loss"], joined[3]["train_loss"]
        assert abs(own - joined[2]["train_loss"]) < abs(own - first)  # from the checkpoint, not from scratch
        forked = ann.get(f"/v1/experiments/{fork['id']}/metrics").json()["points"]
        assert [(p["job"], p["epoch"]) for p in forked] == [(parent["id"], 0), (parent["id"], 1), (fork["id"], 2)]
        # the parent's epoch 3 again, from the same weights (2 ranks: other batches, so near, not equal)
        assert abs(forked[2]["train_loss"] - joined[2]["train_loss"]) < abs(forked[2]["train_loss"] - first)
        view = ann.get(f"/v1/experiments/{cont['id']}").json()
        assert (view["parent"], view["progress"]["epoch"], view["summary"]["epochs"]) == (parent["id"], 5, 5)
        assert ann.get(f"/v1/experiments/{parent['id']}").json()["children"] == [cont["id"], fork["id"]]
        png = ann.get(f"/v1/experiments/{cont['id']}/plot.png", params={"compare": fork["id"]})
        assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
