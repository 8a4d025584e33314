"""A GPU job's memory while it runs: each epoch record carries its ranks' peak GPU memory so far
(``workers.train.gpu_share.gpu_memory``), and the scheduler reads it from the job's stream for the cluster view;
a job's page reads it as its progress. On a real Redis, written by the job's own sink; the CUDA numbers themselves
are the GPU test's (tests/workers/train/test_gpu_share.py)."""

from __future__ import annotations

from api_schemas.jobs import Demand, ExperimentSubmit
from service.core.store import Store
from service.rules.policy import ActiveJob
from service.scheduler.cluster_view import gpu_memory
from tests.service.conftest import tiny
from workers.job.redis_sink import RedisSink

GPU = Demand(workers=1, cpus_per_worker=1, gpus_per_worker=0.25)
CPU = Demand(workers=1, cpus_per_worker=1, gpus_per_worker=0)


def epochs(redis_url: str, job: str, *records: dict) -> None:
    sink = RedisSink(redis_url, job)
    for record in records:
        sink.emit({"kind": "epoch", "train_loss": 1.0, "test_loss": 1.0, **record})
    sink.close()


def test_the_cluster_view_and_a_jobs_progress_show_its_last_reported_gpu_memory(redis_server: str) -> None:
    store = Store.from_url(redis_server)
    gpu_job, cpu_job, new_job, odd_job = (
        store.submit("ann", ExperimentSubmit.model_validate({"spec": tiny()}), now=1.0)[0] for _ in range(4))
    epochs(redis_server, gpu_job, {"epoch": 0, "gpu_memory_mb": 700.0}, {"epoch": 1, "gpu_memory_mb": 812.5})
    epochs(redis_server, cpu_job, {"epoch": 0})
    epochs(redis_server, odd_job, {"epoch": 0, "gpu_memory_mb": "a lot"})  # the job's own process wrote it
    active = [ActiveJob(gpu_job, "ann", GPU, ("n",)), ActiveJob(cpu_job, "ann", CPU, ("n",)),
              ActiveJob(new_job, "ann", GPU, ("n",)), ActiveJob(odd_job, "ann", GPU, ("n",))]
    assert gpu_memory(store, active) == {gpu_job: (812.5,)}  # the last epoch's; none yet, a CPU job, junk: left out
    progress = store.view(gpu_job).progress
    assert (progress.epoch, progress.gpu_memory_mb) == (2, 812.5)
    assert store.view(cpu_job).progress.gpu_memory_mb is None
    odd = store.view(odd_job).progress  # a malformed number is left out, never a broken view
    assert (odd.epoch, odd.gpu_memory_mb) == (1, None)


def test_a_gangs_epoch_carries_each_ranks_gpu_memory_and_the_view_reads_them(redis_server: str) -> None:
    """Two ranks at 0.5 GPU: the job's record lists both ranks' peaks (rank 0 gathers them); a list that does not
    match the job's placed workers, or holds anything but numbers, falls back to rank 0's number."""
    store = Store.from_url(redis_server)
    gang, short, junk = (store.submit("ann", ExperimentSubmit.model_validate({"spec": tiny()}), now=1.0)[0]
                         for _ in range(3))
    two = Demand(workers=2, cpus_per_worker=1, gpus_per_worker=0.5)
    epochs(redis_server, gang, {"epoch": 0, "gpu_memory_mb": 640.0, "gpu_memory_mb_ranks": [640.0, 598.5]})
    epochs(redis_server, short, {"epoch": 0, "gpu_memory_mb": 640.0, "gpu_memory_mb_ranks": [640.0]})
    epochs(redis_server, junk, {"epoch": 0, "gpu_memory_mb": 640.0, "gpu_memory_mb_ranks": [640.0, "x"]})
    active = [ActiveJob(j, "ann", two, ("n", "n")) for j in (gang, short, junk)]
    assert gpu_memory(store, active) == {gang: (640.0, 598.5), short: (640.0,), junk: (640.0,)}
    progress = store.view(gang).progress
    assert (progress.gpu_memory_mb, progress.gpu_memory_mb_ranks) == (640.0, [640.0, 598.5])
