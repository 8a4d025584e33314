"""Sweeps: a search space over any ExperimentSpec field, by dotted path, run as one queued Ray Tune job."""

from __future__ import annotations

import itertools
import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from api_schemas.jobs import Tag
from api_schemas.notify import After, Notify
from api_schemas.spec import ExperimentSpec, ResourcesSpec
from api_schemas.spec_io import apply_overrides, format_validation_error

DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice", "grid")
# the sweep metric -> the key Ray Train reports each epoch (workers/train/loop.py: summarize)
MAX_VALUES = 1000  # values one choice/grid axis may list (refused before any is looked at)
MAX_TRIALS = 100_000  # grid points x num_samples; a service sets its own lower limit (TLAB_MAX_TRIALS)
METRICS = {"train_loss": "final_train_loss", "test_loss": "final_test_loss", "test_acc": "final_test_acc"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_distribution(path: str, dist: Any) -> tuple[str, Any]:
    """``{loguniform: [lo, hi]}`` etc. -> (kind, args), or ValueError naming the path."""
    if not isinstance(dist, dict) or len(dist) != 1:
        raise ValueError(f"search_space.{path}: write one of {{{', '.join(DISTRIBUTIONS)}}}: [...], "
                         "e.g. {loguniform: [0.001, 1]}")
    kind, args = next(iter(dist.items()))
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"search_space.{path}: unknown distribution {kind!r}; use one of {', '.join(DISTRIBUTIONS)}")
    if not isinstance(args, list) or not args:
        raise ValueError(f"search_space.{path}.{kind}: give a non-empty list")
    if len(args) > MAX_VALUES:
        raise ValueError(f"search_space.{path}.{kind}: {len(args)} values; at most {MAX_VALUES} per axis")
    if kind in ("loguniform", "uniform", "randint"):
        if len(args) != 2 or not all(isinstance(a, int | float) and not isinstance(a, bool) for a in args):
            raise ValueError(f"search_space.{path}.{kind}: give [low, high] numbers")
        lo, hi = args
        if not lo < hi:
            raise ValueError(f"search_space.{path}.{kind}: low must be below high")
        if kind == "loguniform" and lo <= 0:
            raise ValueError(f"search_space.{path}.loguniform: low must be > 0")
        if kind == "randint" and not (float(lo).is_integer() and float(hi).is_integer()):
            raise ValueError(f"search_space.{path}.randint: give integer bounds [low, high)")
    return kind, args


# what PBT may change in a running trial: its checkpoint carries the model, the data order and the optimizer
# state across, so only the teleport settings and the optimizer's hyperparameters can move
PBT_MUTABLE = ("teleport.", "optimizer.")
PBT_FIXED = ("optimizer.name",)


def _leaves(data: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        path = f"{prefix}{k}"
        out.add(path)
        if isinstance(v, dict):
            out |= _leaves(v, f"{path}.")
    return out


def factory_arg(base: ExperimentSpec, path: str) -> bool:
    """``model.args.NAME`` of a custom model, ``dataset.args.NAME`` of a custom dataset: a factory's keyword
    argument, which a sweep may vary whether or not the base spec sets it."""
    section, _, name = path.partition(".args.")
    custom = {"model": base.model.kind == "custom", "dataset": base.dataset.name == "custom"}
    return custom.get(section, False) and name.isidentifier()


WIDEST = ("workers", "cpus_per_worker", "gpus_per_worker", "memory_gb")  # resources a trial's axis may widen


def probe_values(kind: str, args: list[Any]) -> list[Any]:
    """The values to validate against the spec: the bounds of ranges, every listed value once."""
    if kind == "randint":
        return [int(args[0]), int(args[1]) - 1]
    return list({json.dumps(v, sort_keys=True): v for v in args}.values())


class SweepSubmit(_Strict):
    """``POST /v1/sweeps``: the base spec, what to vary, and how to search."""

    base: ExperimentSpec
    search_space: dict[str, dict[str, Any]] = Field(
        ..., description="dotted spec path -> {loguniform|uniform|randint: [lo, hi]} or {choice|grid: [values]}")
    num_samples: int = Field(1, ge=1, le=1000, description="samples (random) or repeats of the whole grid")
    metric: Literal["train_loss", "test_loss", "test_acc"] = "train_loss"
    mode: Literal["min", "max"] = "min"
    scheduler: Literal["fifo", "asha", "pbt"] = Field(
        "fifo", description="fifo: run every trial out; asha: stop the worse trials early; pbt: population-based "
                            "training: every perturbation_interval epochs the worst quarter of the trials continue "
                            "from a copy of a top quarter trial's checkpoint with mutated sampled values")
    searcher: Literal["random", "grid", "optuna"] = Field(
        "random", description="random/grid: Tune's variant generator; optuna: Optuna's TPE sampler (no grid axes)")
    seed: int | None = Field(None, ge=0, description="seeds the random or Optuna sampler: the same seed, the "
                                                    "same configurations")
    max_concurrent_trials: int = Field(1, ge=1, le=64)
    grace_period: int = Field(1, ge=1, description="ASHA: epochs every trial runs before it can be stopped")
    perturbation_interval: int = Field(2, ge=1, description="PBT: epochs between two exploit/explore rounds")
    name: str = Field("", max_length=200)
    priority: int = Field(0, ge=-100, le=100)
    time_limit_s: float | None = Field(None, gt=0, description="the whole sweep's running time limit (default "
                                       "TLAB_DEFAULT_TIME_LIMIT_S); base.resources.time_limit_s is each trial's")
    tags: list[Tag] = Field(default_factory=list, max_length=32)
    after: After = Field(default_factory=list)
    notify: Notify | None = Field(None, description="POST a signed JSON to a webhook when the sweep ends")

    @model_validator(mode="after")
    def _space(self) -> SweepSubmit:
        if not self.search_space:
            raise ValueError("search_space: name at least one spec field to vary")
        base = self.base.model_dump(mode="json")
        known = _leaves(base)
        axes = {}
        for path, dist in self.search_space.items():  # shapes first: cheap, and caps before any value is probed
            if path not in known and not factory_arg(self.base, path):
                raise ValueError(f"search_space.{path}: the spec has no such field (see `tlab validate` for the "
                                 "fields, e.g. teleport.lr, optimizer.name, training.seed)")
            axes[path] = kind, args = _check_distribution(path, dist)
            if kind == "grid" and self.searcher == "optuna":
                raise ValueError(f"search_space.{path}: the optuna searcher samples and cannot run a grid; use "
                                 "choice, or searcher random")
        if self.trial_count() > MAX_TRIALS:
            raise ValueError(f"search_space: {self.trial_count()} trials (grid points x num_samples); at most "
                             f"{MAX_TRIALS}")
        for path, (kind, args) in axes.items():
            for value in probe_values(kind, args):
                try:
                    ExperimentSpec.model_validate(apply_overrides(base, [f"{path}={json.dumps(value)}"]))
                except ValidationError as err:
                    raise ValueError(f"search_space.{path}: value {value!r} is not valid: "
                                     f"{format_validation_error(err)}") from None
        if self.scheduler == "pbt":
            self._check_pbt()
        return self

    def _check_pbt(self) -> None:
        if self.searcher == "optuna":
            raise ValueError("searcher: pbt explores by mutating its own population; use searcher random or grid")
        sampled = self.sampled_paths()
        if not sampled:
            raise ValueError("search_space: scheduler pbt needs a sampled axis (loguniform, uniform, randint or "
                             "choice) to mutate; grid axes are never mutated, only copied with a checkpoint")
        for path in sampled:
            if not path.startswith(PBT_MUTABLE) or path in PBT_FIXED:
                raise ValueError(f"search_space.{path}: pbt can only mutate teleport.* and optimizer.* (not "
                                 "optimizer.name): a trial continues from another's checkpoint, so its model and "
                                 "data stay; make this a grid axis, or use scheduler asha")
        if self.perturbation_interval >= self.base.training.epochs:
            raise ValueError(f"perturbation_interval: {self.perturbation_interval} leaves no room to perturb in "
                             f"{self.base.training.epochs} epochs (base.training.epochs); make it smaller")

    @property
    def report_metric(self) -> str:
        return METRICS[self.metric]

    def sampled_paths(self) -> list[str]:
        """The axes drawn from a distribution (not grid axes): what PBT mutates."""
        return [p for p, d in self.search_space.items() if next(iter(d)) != "grid"]

    def trial_count(self) -> int:
        grid = [len(next(iter(d.values()))) for d in self.search_space.values() if next(iter(d)) == "grid"]
        return self.num_samples * math.prod(grid)  # Tune runs every grid point num_samples times

    def widest_resources(self) -> ResourcesSpec:
        """The base's resources with each of ``WIDEST`` at the largest value its axis can draw: the most one trial
        may hold in Ray (a trial with a ``resources.*`` axis runs a TorchTrainer of its own values), which the
        scheduler reserves per concurrent trial, checks against quotas and the nodes."""
        update: dict[str, Any] = {}
        for name in WIDEST:
            dist = self.search_space.get(f"resources.{name}")
            if dist:
                kind, args = next(iter(dist.items()))
                drawn = [0 if v is None else v for v in probe_values(kind, args)]  # memory_gb null: none held
                numbers = [v for v in drawn if isinstance(v, int | float) and not isinstance(v, bool)]
                if numbers:
                    update[name] = max(numbers)
        if update.get("memory_gb") == 0:
            update["memory_gb"] = None
        return self.base.resources.model_copy(update=update)

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination of the grid axes (one empty dict when there are none)."""
        axes = {p: next(iter(d.values())) for p, d in self.search_space.items() if next(iter(d)) == "grid"}
        return [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]


TRIAL_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # Tune's trial ids: ``1a2b3c4d_00002``
TrialId = Annotated[str, Field(pattern=TRIAL_ID_PATTERN, description="a trial id, as the trials table shows it")]
MAX_RERUN = 1000  # trial ids one rerun may name (TLAB_MAX_TRIALS bounds a sweep's trials the same way)


class SweepRerun(_Strict):
    """``POST /v1/sweeps/{id}/rerun``: which trials of an ended sweep run again, inside the same sweep."""

    trials: Literal["failed"] | Annotated[list[TrialId], Field(min_length=1, max_length=MAX_RERUN)] = Field(
        ..., description='"failed": every trial that failed or was cut off when the sweep ended; or a list of such '
                         "trials' ids. Each goes on from its last checkpoint (from scratch when it kept none)")


def trial_spec(base: dict[str, Any], config: dict[str, Any]) -> ExperimentSpec:
    """The base spec with a trial's sampled values put in at their dotted paths."""
    return ExperimentSpec.model_validate(apply_overrides(base, [f"{p}={json.dumps(v)}" for p, v in config.items()]))


def preflighted_spec(spec: ExperimentSpec, sweep: dict[str, Any] | None = None) -> ExperimentSpec:
    """The spec a preflight tries: an experiment's own; a sweep's base with each axis at its first value (the
    first grid or choice value, the low end of a range), so a factory argument only the axes give is there."""
    if not sweep:
        return spec
    config = {path: probe_values(kind, list(args))[0]
              for path, dist in (sweep.get("search_space") or {}).items() for kind, args in dist.items()}
    return trial_spec(spec.model_dump(mode="json"), config)
