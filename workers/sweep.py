"""``python -m workers.sweep --job ID``: a sweep's Ray job — Ray Tune over a search space of specs.

A 1-worker trial trains in the trial itself (``workers.on_ray.trial``: the trial holds the worker's CPUs and reports
each epoch's summary and checkpoint to Tune), under every scheduler; PBT pauses it at a round and starts it
again from the checkpoint it hands over, with no worker group to start. ``TLAB_IN_DRIVER=0`` or more workers:
each trial is a driver function (no CPU: only its workers hold CPUs, so a sweep's Ray usage is exactly the
gang the scheduler counts) that runs the trial's spec as a Ray Train TorchTrainer (Ray 2.60 rejects a
TorchTrainer handed straight to ``Tuner``); ``TuneReportCallback`` forwards the trainer's per-epoch reports
to Tune, so ASHA can stop a trial between epochs. Under PBT such a trial trains ``perturbation_interval``
epochs per TorchTrainer and reports each one's checkpoint to Tune, which is what PBT copies from a top
trial to a bottom one. Every trial's events
go to the sweep's Redis stream tagged with the trial id; the trials table is kept in Redis
(``keys.trials``) by a Tune callback as results arrive.

Environment as for ``workers.run``: ``TLAB_JOB_TICKET`` (or ``REDIS_URL``), ``TLAB_STORAGE``. The URL the driver
redeemed reaches the trials in their closures (never their config, which Tune saves and the trials table shows).
"""

from __future__ import annotations

import glob
import json
import math
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

import redis

from api_schemas import gate, keys
from api_schemas.reasons import one_line
from api_schemas.sweeps import SweepSubmit, trial_spec
from workers.job.artifacts import artifacts_dir
from workers.job.harness import SetupError, export_artifacts, job_main
from workers.job.logs import capture
from workers.job.record import attempt_of, connect, job_field, write_summary
from workers.job.redis_sink import RedisSink
from workers.job.ticket import redeemed
from workers.on_ray.pbt import pbt_scheduler, pbt_trainable
from workers.on_ray.supervisor import refuse_unsandboxed
from workers.on_ray.sweep_rerun import marked_trials, resume_only, state_gone
from workers.on_ray.trial import in_trial, trial_dirs, trial_resources
from workers.on_ray.trial_bridge import supervise_trial
from workers.on_ray.tune_storage import tune_storage
from workers.train.context import keep_checkpoints
from workers.train.failure import JobFailed, failure_reason


def param_space(sweep: SweepSubmit) -> dict[str, Any]:
    """The search space in Ray Tune's terms, keyed by dotted spec path."""
    from ray import tune

    make = {"loguniform": lambda a: tune.loguniform(*a), "uniform": lambda a: tune.uniform(*a),
            "randint": lambda a: tune.randint(int(a[0]), int(a[1])), "choice": tune.choice,
            "grid": tune.grid_search}
    return {path: make[next(iter(d))](next(iter(d.values()))) for path, d in sweep.search_space.items()}


def searcher(sweep: SweepSubmit) -> Any:
    """Tune's search algorithm: its variant generator (random and grid), or Optuna's TPE sampler."""
    if sweep.searcher == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch
        except ImportError as err:
            raise SetupError(f"searcher optuna: {err}: install optuna where the sweep's driver runs "
                             "(pip install optuna), or use searcher random") from None
        return OptunaSearch(seed=sweep.seed)
    from ray.tune.search.basic_variant import BasicVariantGenerator

    # a generator given to Tune ignores TuneConfig(max_concurrent_trials): it must carry the limit itself,
    # or every trial's driver starts at once and their TorchTrainers all wait for workers
    return BasicVariantGenerator(max_concurrent=sweep.max_concurrent_trials, random_state=sweep.seed)


TRIAL_FAILED = "TrialFailed: "  # marks the reason line in Tune's text of a trial's error


class TrialFailed(RuntimeError):
    """A trial's failure, its message already the one line to show (``workers.train.failure.failure_reason``)."""


def trial_reason(trial: Any) -> str:
    """The one line a failed trial's row shows, read from the error text Tune kept for it."""
    try:
        text = trial.get_error() or ""
    except Exception:  # noqa: BLE001 - the storage went away: the row still says failed
        text = ""
    marked = [line.split(TRIAL_FAILED, 1)[1] for line in text.splitlines() if TRIAL_FAILED in line]
    lines = [line for line in text.splitlines() if line.strip()]
    return one_line(marked[-1] if marked else lines[-1] if lines else "the trial failed (no error was kept)")


def reuse_actors(sweep: SweepSubmit, own: bool) -> bool:
    """Whether a trial's process supervises the next trial too (it saves that process's start): only when no trial
    ends early (FIFO). A reused process must first end the last trial's thread, and Tune waits for it only
    ``TUNE_FUNCTION_THREAD_TIMEOUT_S`` (2 s). Under ASHA a stopped trial's thread waits for its payload's next report
    (an epoch away) before it sees the stop, so the next trial given that process can fail ("Could not re-use actor
    for trial ...: reset_config() ... return True"); under PBT, whose rounds pause every trial and restart it on
    another's checkpoint, a moved trial can lose its last report (it ends "stopped early" one epoch short on a busy
    machine). Since a trial trains in its sandboxed payload, its own process holds no torch or data to keep."""
    return own and sweep.scheduler == "fifo"


DRIVER_MEMORY = 1 << 20  # bytes of Ray's logical memory resource per trial driver


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None


# what a trial's row keeps of its latest result: the run summary so far (``workers.train.loop.summarize``), and on
# a GPU the trial's peak GPU memory so far (what four trials sharing a card each took of it)
SUMMARY_KEYS = ("epochs", "final_train_loss", "final_test_loss", "final_test_acc", "best_test_loss",
                "best_test_acc", "final_test_ppl", "seconds", "teleport_seconds", "teleport_share",
                "teleport_batches", "target_loss", "epochs_to_target", "seconds_to_target", "gpu_memory_peak_mb")


class TrialTable:
    """A Tune callback that keeps the trials table in Redis: config, state, last and best metric,
    epochs run, whether the scheduler stopped the trial early, and the run summary so far."""

    time_limit_s: float | None = None  # a table restored from a sweep's saved state written before it had one
    job_id = ""  # ... or its job id (its key names it)

    def __init__(self, redis_url: str, job_id: str, metric: str, mode: str, epochs: int,
                 time_limit_s: float | None = None) -> None:
        from ray.tune import Callback

        table = self

        class _Callback(Callback):
            def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
                table.update(trial, state="running")

            def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
                table.update(trial, result=result)

            def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
                table.update(trial, state="done")

            def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
                table.update(trial, state="failed", reason=trial_reason(trial))

        self.callback = _Callback()
        self.redis_url = redis_url
        self._r: redis.Redis | None = None
        self.key, self.job_id = keys.trials(job_id), job_id
        self.metric, self.mode, self.epochs, self.time_limit_s = metric, mode, epochs, time_limit_s

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks into tuner.pkl on the shared storage: leave the connection out, and a URL
        # redeemed from the job's ticket (its password: another job's code could read the file)
        return {**self.__dict__, "_r": None, "redis_url": "" if self.redis_url == redeemed() else self.redis_url}

    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            # a callback restored from Tune's saved state carries the address an earlier attempt had: the
            # service's Redis may have moved since (a restarted stack): this attempt's redeemed ticket or REDIS_URL
            url = redeemed() or os.environ.get("REDIS_URL") or self.redis_url
            self._r = connect(url, decode_responses=True)
        return self._r

    def update(self, trial: Any, state: str | None = None, result: dict | None = None,
               reason: str | None = None) -> None:
        raw = self.r.hget(self.key, trial.trial_id)
        row = json.loads(raw) if raw else {"trial": trial.trial_id, "config": trial.config, "state": "pending",
                                           "epochs": 0, "last": None, "best": None, "stopped_early": False}
        if json.dumps(trial.config, sort_keys=True) != json.dumps(row["config"], sort_keys=True):
            # PBT moved this trial onto a top trial's checkpoint with mutated values
            row["config"], row["perturbed"] = trial.config, row.get("perturbed", 0) + 1
        if result is not None:
            value = _finite(result.get(self.metric))
            row["epochs"] = int(result.get("epochs", row["epochs"]) or 0)
            row["last"] = value
            if value is not None and (row["best"] is None or (value < row["best"]) == (self.mode == "min")):
                row["best"] = value
            row["summary"] = {k: result[k] if isinstance(result[k], int) else _finite(result[k])
                              for k in SUMMARY_KEYS if k in result}
        if state == "done":
            row["stopped_early"] = row["epochs"] < self.epochs
            row["state"] = "stopped early" if row["stopped_early"] else "succeeded"
            if row["stopped_early"] and reason is None:
                reason = self.limit_reason(trial, row["epochs"])
        elif state is not None:
            row["state"] = state
        if state in ("running", "done"):  # a rerun trial's earlier failure is no longer why it stands where it does
            row.pop("reason", None)
        if reason is not None:
            row["reason"] = reason
        from workers.job.record import write_hash

        # through the bounded script the scheduler loaded: a row over its cap, or past the job's share, is refused
        write_hash(self.r, self.job_id or self.key.split(":")[2], self.key, {trial.trial_id: json.dumps(row)})

    def limit_reason(self, trial: Any, epochs: int) -> str | None:
        """Why a trial stopped early, when it was its time limit (Tune's ``time_total_s`` stop criterion) and
        not the search's scheduler (ASHA, PBT)."""
        ran = (getattr(trial, "last_result", None) or {}).get("time_total_s")
        if self.time_limit_s is None or not isinstance(ran, int | float) or ran < self.time_limit_s:
            return None
        return f"time limit of {self.time_limit_s:g} s reached at epoch {epochs}"


def trial_retries() -> int:
    """``TLAB_TRIAL_RETRIES``: how many times Tune starts a failed trial again (default 1)."""
    raw = os.environ.get("TLAB_TRIAL_RETRIES", "1")
    if not raw.isdigit():
        raise SetupError(f"TLAB_TRIAL_RETRIES={raw!r}: give a whole number (0 turns retries off)")
    return int(raw)


def trial_stop(sweep: SweepSubmit) -> dict[str, float] | None:
    """Each trial's time limit (``base.resources.time_limit_s``) as Tune's stop criterion: checked at each
    epoch's result, on the time the trial has run (``time_total_s``)."""
    limit = sweep.base.resources.time_limit_s
    return None if limit is None else {"time_total_s": limit}


def best_trial(storage: str, job_id: str, metric: str, mode: str) -> dict[str, Any] | None:
    """The trial with the best ``metric`` so far as Tune recorded it in the sweep's own directory (its experiment
    state: each trial's config and the best of all its results), never as the trials table says: the trials can write
    that. Of trials tied on the metric, the first in trial id order, as the API's table. None before any trial
    reported (or before Tune saved its state)."""
    from ray.tune import ExperimentAnalysis

    try:
        trials = ExperimentAnalysis(os.path.join(storage, f"sweep-{job_id}")).trials
    except Exception:  # noqa: BLE001 - no state saved yet (stopped at once): no trial to export
        return None
    rows = [{"trial": gate.trial_id(t.trial_id), "config": t.config, "best": best}
            for t in trials if (best := _finite((t.metric_analysis.get(metric) or {}).get(mode))) is not None]
    rows.sort(key=lambda r: r["trial"])
    return (min if mode == "min" else max)(rows, key=lambda r: r["best"]) if rows else None


def trial_runs(storage: str, job_id: str, trial_id: str) -> list[Path]:
    """A trial's Ray Train runs (``<storage>/<sweep>-<trial>``, a PBT trial's ``...-<trial>-<n>``): real
    directories (no link) named after the sweep and the trial's id, checked by the gate."""
    prefix = f"{job_id}-{gate.trial_id(trial_id)}"
    runs = []
    for path in glob.glob(os.path.join(glob.escape(storage), f"{glob.escape(prefix)}*")):
        name = os.path.basename(path)
        if name == prefix or name.startswith(f"{prefix}-"):
            try:
                runs.append(gate.real_dir(storage, name))
            except (OSError, gate.Refused):
                continue
    return runs


def export_best(job_id: str, sweep: SweepSubmit, storage: str) -> dict[str, Any] | None:
    """The best trial's artifacts (its weights, checkpoint, metrics) as the sweep's own artifacts; that trial
    (``best_trial``: Tune's word), or None."""
    row = best_trial(storage, job_id, sweep.report_metric, sweep.mode)
    if row is None:
        return None
    spec = trial_spec(sweep.base.model_dump(mode="json"), row["config"])
    # a trial that trained in itself left no training run: its checkpoints are the ones it reported to Tune
    runs = trial_runs(storage, job_id, row["trial"]) or trial_dirs(storage, job_id, row["trial"])
    export_artifacts(spec, runs, artifacts_dir(storage, job_id),
                     {"trial": row["trial"], "config": row["config"], sweep.metric: row["best"]})
    return row


def run_sweep(job_id: str, redis_url: str, storage: str) -> dict[str, Any]:
    import ray
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from workers.on_ray.ray_train import build_trainer

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    raw = job_field(client, job_id, "sweep")
    if raw is None:
        raise SetupError(f"job {job_id} has no sweep in Redis (key {keys.job(job_id)}): was it submitted?")
    sweep = SweepSubmit.model_validate_json(raw)
    base = sweep.base.model_dump(mode="json")
    epochs = sweep.base.training.epochs
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True)
    # Tune's experiment state (which trials exist, which ended) is saved every 2 s instead of every
    # 10+: a sweep whose driver dies (the cluster restarted) resumes from at most 2 s ago
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")

    def trial(config: dict[str, Any]) -> None:
        trial_id = tune.get_context().get_trial_id()
        spec = trial_spec(base, config)
        trainer = build_trainer(spec, name=f"{job_id}-{trial_id}", storage_path=storage, redis_url=redis_url,
                                job_id=job_id, trial=trial_id, callbacks=[TuneReportCallback()])
        try:
            trainer.fit()
        except Exception as err:
            raise TrialFailed(failure_reason(err)) from None

    def own_trial(config: dict[str, Any]) -> None:
        trial_id = tune.get_context().get_trial_id()
        # its output is kept with the sweep's logs (`tlab logs SWEEP --rank trial-<id>`)
        with capture(storage, job_id, f"trial-{trial_id}", attempt_of(redis_url, job_id)):
            try:
                supervise_trial(trial_spec(base, config), job_id, trial_id, redis_url, storage)  # in the sandbox
            except Exception as err:
                traceback.print_exc()  # the whole story, for the trial's log
                raise TrialFailed(failure_reason(err)) from None

    metric = sweep.report_metric
    table = TrialTable(redis_url, job_id, metric, sweep.mode, epochs, sweep.base.resources.time_limit_s)
    search_alg = searcher(sweep)
    space = param_space(sweep)
    own = in_trial(sweep)
    if not own:
        refuse_unsandboxed(sweep.base)  # a TorchTrainer per trial: Ray Train's workers, outside any sandbox
    # a trial training in itself reports a checkpoint every epoch: Tune keeps the last few, as Ray Train did
    checkpoints = tune.CheckpointConfig(num_to_keep=keep_checkpoints()) if own else None
    if sweep.scheduler == "asha":
        scheduler: Any = ASHAScheduler(max_t=epochs, grace_period=min(sweep.grace_period, epochs),
                                       reduction_factor=2, time_attr="epochs")
    elif sweep.scheduler == "pbt":
        mutations = {p: space[p] for p in sweep.sampled_paths()}
        # with the whole population running at once every trial waits at each boundary, so trials are ranked
        # at the same epoch; otherwise a trial is ranked against the others' latest results
        synch = sweep.max_concurrent_trials >= sweep.trial_count()
        scheduler = pbt_scheduler(epochs, time_attr="epochs", perturbation_interval=sweep.perturbation_interval,
                                  hyperparam_mutations=mutations, synch=synch)
        checkpoints = tune.CheckpointConfig(num_to_keep=4)  # PBT warns of early deletion at 2 or fewer
    else:
        scheduler = FIFOScheduler()
    # a trial training in itself holds its one worker's CPUs; a trial's driver only waits on its TorchTrainer:
    # no CPU (Tune needs some resource in a trial's placement group, so a token of memory); either way
    # max_concurrent_trials x the workers' CPUs is all a sweep holds in Ray
    if own:
        trainable = tune.with_resources(own_trial, trial_resources(sweep))
    else:
        trainable = tune.with_resources(pbt_trainable(sweep, job_id, redis_url, storage) if sweep.scheduler == "pbt"
                                        else trial,
                                        {"cpu": 0, "memory": DRIVER_MEMORY})
    name = f"sweep-{job_id}"
    path = os.path.join(storage, name)
    shared = tune_storage(storage, job_id, name)  # (with a bucket: a copy of it here)
    rerun = marked_trials(client, job_id)
    restore = tune.Tuner.can_restore(path)
    if rerun and not restore:  # the rows say rerun, and there is no Tune state to resume them from
        raise state_gone(path)
    sink = RedisSink(redis_url, job_id)
    if restore:
        # an earlier attempt's driver died (the cluster restarted): Tune's saved state says which trials ended;
        # unfinished ones run again under their own ids, and each one's TorchTrainer resumes from its last checkpoint
        # (same name and storage path). A rerun (workers.on_ray.sweep_rerun): of the errored trials, the marked ones
        # only
        resumed = resume_only(path, rerun) if rerun else None
        if resumed:
            shared.send_back(name)  # the state as rewritten, where Tune restores it from (with a bucket)
        what = f"rerunning trials {', '.join(resumed)}" if resumed else "resuming the sweep"
        sink.emit({"kind": "log", "level": "info", "message": f"{what} from Tune's state in {path}"})
        tuner = tune.Tuner.restore(shared.at(name), trainable, resume_unfinished=True, resume_errored=not rerun,
                                   storage_filesystem=shared.fs)
    else:
        # nothing to resume from: rows an earlier attempt left behind belong to trials that will not return
        client.delete(keys.trials(job_id))
        tuner = tune.Tuner(
            trainable,
            param_space=space,
            tune_config=tune.TuneConfig(metric=metric, mode=sweep.mode, num_samples=sweep.num_samples,
                                        scheduler=scheduler, search_alg=search_alg,
                                        max_concurrent_trials=sweep.max_concurrent_trials,
                                        reuse_actors=reuse_actors(sweep, own)),
            # a trial that fails past its TorchTrainer's own retries (the trial's actor or its restore went
            # wrong) runs once more from its last checkpoint before its row says failed
            run_config=tune.RunConfig(name=name, storage_path=shared.root, storage_filesystem=shared.fs,
                                      callbacks=[table.callback],
                                      checkpoint_config=checkpoints, stop=trial_stop(sweep),
                                      failure_config=tune.FailureConfig(max_failures=trial_retries())),
        )
    sink.close()
    try:
        results = tuner.fit()
    finally:  # also when stopped (the sweep's own time limit): the best trial so far
        shared.fetch(name)
        row = export_best(job_id, sweep, storage)
    shutil.rmtree(os.path.join(storage, f"pbt-{job_id}"), ignore_errors=True)
    # Tune's best: its best value over every result of every trial, a rerun's too (the API's `best` reads the same
    # from the trials table)
    row = row or {"trial": None, "config": None, "best": None}
    summary = {"trials": len(results), "best_trial": row["trial"], "best_config": row["config"],
               "best_" + sweep.metric: _finite(row["best"]), "errors": sum(1 for r in results if r.error)}
    write_summary(client, job_id, json.dumps(summary))
    if summary["errors"]:
        reasons = [f"{r['trial']}: {r['reason']}" for r in map(json.loads, client.hvals(keys.trials(job_id)))
                   if r.get("reason") and r.get("state") == "failed"]
        first = f"; {reasons[0]}" if reasons else " (see the trials table)"
        raise JobFailed(one_line(f"{summary['errors']} of {summary['trials']} trials failed{first}"))
    return summary


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m workers.sweep", __doc__.splitlines()[0], run_sweep, argv)


if __name__ == "__main__":
    sys.exit(main())
