"""The user's own training loop (``training.entrypoint: "pkg.module:function"``), run instead of ours.

Ray Train's ``train_loop_per_worker`` idiom: ``function(ctx)`` runs on every DDP worker (in the job's driver for
1 worker, in this process for ``tlab run --local --code DIR``) with one argument, an ``OwnLoopContext``: a thin
adapter over the run's ``RunContext`` (the same device, DDP wrapping, sink, checkpoints and resume as our loop,
``workers.train.loop.train``), so the events, artifacts, sweeps and retries work unchanged:

- ``ctx.spec``, ``ctx.args`` (``training.entrypoint_args``), ``ctx.device``, ``ctx.rank``, ``ctx.world_size``,
  ``ctx.is_chief``, ``ctx.artifacts_dir``; ``ctx.start_epoch`` (after a resume) and ``ctx.epochs()``;
- ``ctx.prepare(model)``, ``ctx.loader(dataset, batch_size=, shuffle=)``, ``ctx.mean(value)``;
- ``ctx.teleport(model, loss_fn, batches)``: the spec's teleport, DDP-consistent, its events emitted;
- ``ctx.report(epoch=, train_loss=, test_loss=, ...)``: the epoch event our loop emits;
- ``ctx.checkpoint(state)`` / ``ctx.restore()``.

Any error inside the user's function is one line naming their file and line (``workers.train.user_code``); a loop
that returns without reporting an epoch fails with a line saying to call ``ctx.report``.
"""

from __future__ import annotations

import inspect
import math
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from api_schemas import ExperimentSpec
from teleport import TeleportReport
from workers.train.budget import TeleportBudget
from workers.train.build import basis_executor, reset_optimizer_state, select_dtype, teleport_config
from workers.train.context import RunContext
from workers.train.failure import OURS
from workers.train.gpu_share import gpu_memory
from workers.train.shared import TrainingDiverged, diverged, param_count, summarize
from workers.train.teleport_hints import optimizer_name, schedule_hint
from workers.train.teleporting import TeleportDiverged, TeleportRunner, to_device
from workers.train.user_code import UserCodeError, definition, one_line, report, resolve

FIELD = "training.entrypoint"
REQUIRED = ("train_loss", "test_loss")  # what the curves, compare, summaries and sweeps read
PLAIN = (Tensor, int, float, str, bool, type(None), torch.dtype, torch.Size, np.ndarray, np.generic)


class NoEpochReported(ValueError):
    """The user's loop ended without a single ``ctx.report``: nothing to show, compare or sweep over."""


def bare(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (teleport and checkpoints take the bare one)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _number(name: str, value: Any, epoch: int) -> float:
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, int | float | np.number) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"ctx.report(epoch={epoch}): {name}={type(value).__name__}: give a number (a float, or a "
                     "one-element tensor)")


def _check_plain(value: Any, where: str) -> None:
    """Only what ``torch.load(weights_only=True)`` reads back: a resume must be able to load it."""
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise ValueError(f"ctx.checkpoint: {where} is a {type(value).__name__}: a checkpoint holds tensors and "
                         "plain values (dict, list, numbers, strings) only; save its .state_dict()")


class OwnLoopContext:
    """What the user's loop gets: ``function(ctx)``. See the module's docstring and docs/spec.md."""

    def __init__(self, spec: ExperimentSpec, run: RunContext) -> None:
        self.spec, self.run = spec, run
        self.args: dict[str, Any] = dict(spec.training.entrypoint_args)
        self.device: torch.device = run.device
        self.rank, self.world_size = run.rank, run.world_size
        self.dtype = select_dtype(spec.training)
        self._state = run.restore()  # a restarted worker, a retried driver, a continued or forked job
        saved = self._state or {}
        self.history: list[dict[str, Any]] = list(saved.get("history", []))
        self.start_epoch: int = int(saved.get("epoch", 0))
        self.teleport_seconds = float(saved.get("teleport_seconds", 0.0))
        self.teleport_batches = int(saved.get("teleport_batches", 0))
        self._resumed_seconds = float(saved.get("seconds", 0.0))
        self._t0 = time.perf_counter() - self._resumed_seconds  # ctx.epochs() restarts it: setup is not counted
        self._epoch = self.start_epoch  # the epoch under way: ctx.epochs() sets it, a report moves past it
        self._samplers: list[DistributedSampler] = []
        self._generators: list[torch.Generator] = []
        self._pending: dict[str, Any] | None = None  # the last epoch's summary, not yet given to Ray/Tune
        self._model: nn.Module | None = None
        self._sizes: dict[str, int] = {}
        self._started = False
        tp = spec.teleport  # the one teleport driver of every run (``workers.train.teleporting``); budget from the
        self._teleports = TeleportRunner(tp, teleport_config(tp), run, self.dtype,  # first reported epoch
                                         TeleportBudget(tp.budget, spec.training.epochs))
        self._teleports.restore(saved.get("teleport_runner"))
        self._told_schedule = self.start_epoch > 0  # the Adam hint (``schedule_hint``): once, at a run's start

    # ------------------------------------------------------------------------------------ where it runs

    @property
    def is_chief(self) -> bool:
        return self.run.is_chief

    @property
    def artifacts_dir(self) -> Path | None:
        """Files rank 0 writes here are the job's artifacts (None in a local run without one)."""
        return self.run.artifacts_dir

    def epochs(self) -> Iterator[int]:
        """``range(start_epoch, training.epochs)``; each loader from ``ctx.loader`` reshuffles per epoch. The
        run's clock (the events' ``seconds``) starts here, as our loop's starts after its setup."""
        if not self._started:
            self._t0 = time.perf_counter() - self._resumed_seconds
        for epoch in range(self.start_epoch, self.spec.training.epochs):
            self._set_epoch(epoch)
            yield epoch

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        for sampler in self._samplers:
            sampler.set_epoch(epoch)
        for g in self._generators:
            g.manual_seed(self.spec.training.seed * 100_003 + epoch)

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model in ``training.dtype`` on ``ctx.device``, DDP-wrapped when ``world_size > 1``: step the
        optimizer through what this returns."""
        self._model = model.to(dtype=self.dtype)
        return self.run.prepare_model(self._model)

    def loader(self, dataset: Dataset, batch_size: int | None = None, *, shuffle: bool = True,
               drop_last: bool = False, **kwargs: Any) -> DataLoader:
        """A DataLoader (``batch_size`` default ``training.batch_size``) over this rank's shard of ``dataset``
        (a DistributedSampler when distributed), reshuffled per epoch of ``ctx.epochs()``, seeded by
        ``training.seed``. More keyword arguments go to the DataLoader."""
        size = batch_size or self.spec.training.batch_size
        if hasattr(dataset, "__len__"):
            self._sizes.setdefault("train_size" if shuffle else "test_size", len(dataset))
        seed = self.spec.training.seed
        if self.world_size > 1:
            sampler = DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, shuffle=shuffle,
                                         seed=seed, drop_last=drop_last)
            sampler.set_epoch(self._epoch)
            self._samplers.append(sampler)
            return DataLoader(dataset, batch_size=size, sampler=sampler, drop_last=drop_last, **kwargs)
        g = torch.Generator().manual_seed(seed * 100_003 + self._epoch)
        self._generators.append(g)
        return DataLoader(dataset, batch_size=size, shuffle=shuffle, generator=g, drop_last=drop_last, **kwargs)

    def mean(self, value: float | Tensor) -> float:
        """``value`` averaged over the ranks (every rank calls it): a loss to report for the whole run."""
        total = float(value.detach()) if isinstance(value, Tensor) else float(value)
        return self.run.all_reduce_sum([total])[0] / self.world_size

    # ------------------------------------------------------------------------------------ teleport

    def teleport(self, model: nn.Module, loss_fn: Any, batches: Iterable[Any], *, epoch: int | None = None,
                 holdout: tuple[Tensor, Tensor] | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> list[TeleportReport]:
        """The spec's teleport on ``batches`` if ``teleport.enabled`` and the epoch (default: the current one) is
        in ``teleport.epochs``; else nothing ([]). ``batches``: a Dataset (``teleport.batches`` random batches of
        ``teleport.batch_size`` drawn from it as our loop draws them, split over the ranks), or (x, y) pairs of
        which the first ``teleport.batches`` are used (this rank's shard under DDP, as many on every rank).
        Every rank ends with the same weights. Emits one ``teleport`` event per batch and returns their
        reports. ``optimizer``: its state is cleared after it when ``teleport.reset_optimizer``; ``holdout``:
        (x, y) whose loss drift the reports show."""
        tp, epoch = self.spec.teleport, self._epoch if epoch is None else epoch
        if not tp.enabled or epoch not in tp.epochs or self._teleports.skipped is not None:
            return []
        if isinstance(batches, Dataset):
            batches = self._teleports.draw(batches, self.spec.training.seed, epoch)
        self._start()
        if optimizer is not None and not self._told_schedule:
            self._told_schedule = True
            if hint := schedule_hint(optimizer_name(optimizer), tp, self.spec.training.epochs):
                self.run.sink.emit(hint)
        started, runner = time.perf_counter(), self._teleports
        runner.executor = runner.executor or basis_executor(tp)
        held = None if holdout is None else to_device(holdout, self.device, self.dtype)
        last = self.history[-1] if self.history else {}
        train = float(last.get("seconds", 0.0)) - float(last.get("teleport_seconds", 0.0))
        try:
            reports = runner.run(epoch, bare(model), loss_fn, batches, self.teleport_seconds, train,
                                 len(self.history), held)
        except TeleportDiverged as e:
            raise diverged(self.run, f"teleport batch {e.batch}", epoch, f"teleport batch loss is {e.loss}",
                           tp.calmer) from None
        self.teleport_batches += len(reports)
        if optimizer is not None and tp.reset_optimizer and reports:
            reset_optimizer_state(optimizer)
        self.teleport_seconds += time.perf_counter() - started
        return reports

    # ------------------------------------------------------------------------------------ report, checkpoint

    def report(self, *, epoch: int, **metrics: Any) -> None:
        """One epoch's event (every rank calls it; rank 0's numbers are shown: ``ctx.mean`` averages them):
        ``train_loss`` and ``test_loss`` required, ``test_acc``/``test_ppl`` and any other numbers optional;
        ``seconds``/``teleport_seconds`` are filled in. Each epoch once, in increasing order."""
        last = self.history[-1]["epoch"] if self.history else self.start_epoch - 1
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch <= last:
            raise ValueError(f"ctx.report(epoch={epoch!r}): give each epoch once, in order (the last reported is "
                             f"{last}): loop over ctx.epochs()")
        missing = [name for name in REQUIRED if name not in metrics]
        if missing or "kind" in metrics:
            raise ValueError(f"ctx.report(epoch={epoch}): {', '.join(missing) or 'kind'} "
                             f"{'missing' if missing else 'is reserved'}: report train_loss and test_loss (the "
                             "curves, compare and sweeps read them), plus any other numbers")
        values = {name: _number(name, value, epoch) for name, value in metrics.items()}
        self._start()
        record = {"kind": "epoch", "epoch": epoch, **values, **gpu_memory(self.device)}
        record.setdefault("seconds", time.perf_counter() - self._t0)
        record.setdefault("teleport_seconds", self.teleport_seconds)
        for name in REQUIRED:
            if not math.isfinite(values[name]):
                raise diverged(self.run, "training", epoch, f"{name} is {values[name]}",
                                f"lower optimizer.lr (now {self.spec.optimizer.lr:g}) or "
                                f"{self.spec.teleport.step_field} / cap")
        self.run.sink.emit(record)
        self.history.append(record)
        self._set_epoch(epoch + 1)
        if self._pending is not None:  # the previous epoch was not checkpointed: its metrics go alone
            self.run.report_metrics(self._pending)
        self._pending = self.summary()

    def checkpoint(self, state: dict[str, Any]) -> None:
        """Keep ``state`` to resume from (every rank calls it, after ``report``; rank 0's is kept): a dict of
        tensors and plain values holding ``"model"``: the model's ``state_dict()`` (the artifacts' weights),
        plus what else you want back (``"optimizer": opt.state_dict()``, ...)."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise ValueError("ctx.checkpoint(state): give a dict holding 'model': model.state_dict() (the artifacts "
                             "and a resume read it), plus anything else you want back from ctx.restore()")
        _check_plain(state, "state")
        weights = self._bare_names(state["model"])
        saved = {"epoch": self.history[-1]["epoch"] + 1 if self.history else self.start_epoch,
                 "model": weights, "own": {**state, "model": weights}, "history": self.history,
                 "seconds": self.history[-1]["seconds"] if self.history else 0.0,
                 "teleport_seconds": self.teleport_seconds, "teleport_batches": self.teleport_batches,
                 "teleport_runner": self._teleports.saved()}
        self.run.save(saved, self.summary())
        self._pending = None

    def _bare_names(self, weights: dict[str, Any]) -> dict[str, Any]:
        """A DDP wrapper's state_dict under the bare model's names (``module.`` dropped), the names the
        artifacts' safetensors and a resume into the bare model use; any other state_dict as it is."""
        stripped = {k.removeprefix("module."): v for k, v in weights.items()}
        ddp = self._model is not None and all(k.startswith("module.") for k in weights)
        return stripped if ddp and set(stripped) == set(self._model.state_dict()) else weights  # type: ignore[union-attr]

    def restore(self) -> dict[str, Any] | None:
        """The state the last ``checkpoint`` kept (None on a fresh start): load it, then loop from
        ``ctx.start_epoch`` (``ctx.epochs()`` does). A forked job of our loop gives its model and optimizer."""
        if self._state is None or "model" not in self._state:
            return None
        return self._state.get("own") or {k: self._state[k] for k in ("model", "optimizer") if k in self._state}

    # ------------------------------------------------------------------------------------ the run's ends

    def summary(self) -> dict[str, Any]:
        return {**summarize(self.history, self.spec.training.target_loss, self.teleport_batches),
                **self._teleports.summary()}

    def _start(self) -> None:
        """The ``start`` event, once, before the first teleport or epoch event."""
        if self._started:
            return
        self._started = True
        model = self._model
        self.run.sink.emit({
            "kind": "start", "dataset": f"own loop {self.spec.training.entrypoint}", "task": None,
            "train_size": self._sizes.get("train_size"), "test_size": self._sizes.get("test_size"),
            "model": type(model).__name__ if model is not None else None,
            "params": param_count(model) if model is not None else None,
            "optimizer": None, "teleport": self.spec.teleport.method if self.spec.teleport.enabled else None,
            "device": str(self.device), "world_size": self.world_size, "resumed_from_epoch": self.start_epoch,
            "spec": self.spec.model_dump(mode="json"),
        })

    def finish(self) -> dict[str, Any]:
        """After the user's function returned: the metrics not yet given to Ray/Tune, the summary event."""
        if not self.history:
            raise NoEpochReported(f"{FIELD} {self.spec.training.entrypoint}: the entrypoint returned without "
                                  "reporting an epoch: call ctx.report(epoch=..., ...)")
        if self._pending is not None:
            self.run.report_metrics(self._pending)
            self._pending = None
        summary = {**self.summary(), "params": param_count(self._model) if self._model is not None else 0}
        self.run.sink.emit({"kind": "summary", **summary})
        return summary


# ---------------------------------------------------------------------------------------------- the call


def _ours(err: BaseException) -> bool:
    """Raised by this repository or Ray (a stop, a lost worker): not the user's error to place."""
    return type(err).__module__.split(".", 1)[0] in (*OURS, "ray", "__main__")


def entrypoint(spec: ExperimentSpec) -> Any:
    """The user's function, checked to take one argument (the context)."""
    ref = spec.training.entrypoint or ""
    fn = resolve(ref, FIELD)
    try:
        inspect.signature(fn).bind(None)
    except TypeError as err:
        where = definition(fn)
        text = f"TypeError: {ref} must take one argument, the loop's context (def {fn.__name__}(ctx)): {err}"
        raise UserCodeError(f"{where}: {text}" if where else text) from None
    except ValueError:  # no signature to read: let the call say
        pass
    return fn


def run_own_loop(spec: ExperimentSpec, run: RunContext) -> dict[str, Any]:
    """Run ``training.entrypoint`` under ``run``; the summary our loop would return (``workers.train.loop.train``)."""
    try:
        fn = entrypoint(spec)
        ctx = OwnLoopContext(spec, run)
        try:
            fn(ctx)
        except (TrainingDiverged, UserCodeError):
            raise
        except Exception as err:
            if _ours(err):
                raise
            full = "".join(traceback.format_exception(type(err), err, err.__traceback__))
            raise UserCodeError(one_line(err, fallback=definition(fn)), full) from err
    except UserCodeError as err:
        report(run.sink, err)
        raise
    return ctx.finish()
