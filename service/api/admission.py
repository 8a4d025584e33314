"""Admission at submit: refuse what can never run, knowable without running user code.

Each check names the field: the model takes the dataset's samples (``api_schemas.compat``, the rule the
workers apply), the dataset's files are there and under the data roots (``TLAB_DATA_ROOTS``; ``..`` and
symlinks resolved), sizes are within the limits an admin sets (``TLAB_MAX_*``), the gang within the user's
quotas, the priority within ``max_priority``, a webhook's host within ``TLAB_WEBHOOK_ALLOW``, user code allowed
(``TLAB_USER_CODE``) and its ``code.package`` the user's own (``service.core.code_store``). The accepted
spec carries the resolved dataset paths, so the workers read exactly what was checked. The workers' own checks
stay as the second line.
"""

from __future__ import annotations

import json
from pathlib import Path

from api_schemas.compat import check_model_data
from api_schemas.datasets import (
    FILELESS,
    DatasetNotFound,
    TokenFileError,
    check_token_sizes,
    required_files,
    sample_shape,
)
from api_schemas.jobs import ExperimentSubmit, Role, UserPublic
from api_schemas.notify import Notify, webhook_host
from api_schemas.spec import DatasetSpec, ExperimentSpec, MLPModel, TransformerModel
from api_schemas.spec_io import apply_overrides
from api_schemas.sweeps import SweepSubmit, probe_values
from service.core.code_store import check_code, check_may_run_code
from service.core.errors import InvalidInput
from service.core.settings import Settings
from service.core.store import demand_of
from service.rules import webhooks as webhook_guard
from service.rules.limits import check_time_limit

PROBED = ("model.", "dataset.", "training.epochs", "teleport.", "resources.")  # sweep axes the checks read
FIXED_IN_SWEEPS = ("dataset.root", "dataset.path")  # where the data lives is not a hyperparameter


def admit_experiment(settings: Settings, user: UserPublic, body: ExperimentSubmit) -> ExperimentSubmit:
    """The submission with its dataset paths resolved, or InvalidInput (422) naming the field."""
    check_priority(user, body.priority)
    check_quotas(user, body)
    check_notify(settings, body.notify)
    check_time_limit(settings, user, body.spec.resources.time_limit_s, "spec.resources.time_limit_s")
    check_code(settings, user, body.spec, "spec")
    return body.model_copy(update={"spec": admit_spec(settings, body.spec, "spec")})


def admit_sweep(settings: Settings, user: UserPublic, body: SweepSubmit) -> SweepSubmit:
    """Like ``admit_experiment`` for the base spec, and each value a sweep axis read by the checks can take."""
    check_priority(user, body.priority)
    check_quotas(user, body)
    check_notify(settings, body.notify)
    check_time_limit(settings, user, body.base.resources.time_limit_s, "base.resources.time_limit_s")
    check_time_limit(settings, user, body.time_limit_s, "time_limit_s")
    check_code(settings, user, body.base, "base")
    check_code_axes(settings, user, body)
    trials = body.trial_count()
    if trials > settings.max_trials:
        raise InvalidInput(f"{trials} trials (grid points x num_samples) are over this service's limit of "
                           f"{settings.max_trials} (TLAB_MAX_TRIALS): search a smaller space", field="search_space")
    base = admit_spec(settings, body.base, "base")
    check_axes(settings, body, base)
    return body.model_copy(update={"base": base})


CODE_AXES = ("model.factory", "dataset.factory", "training.loss", "training.entrypoint")  # values name functions


def check_code_axes(settings: Settings, user: UserPublic, body: SweepSubmit) -> None:
    """An axis that picks the function a trial calls is user code as the base's would be (403 where it may not
    run); the code package itself is not an axis (a trial's package must be the one the sweep was admitted with)."""
    for path in body.search_space:
        if path == "code" or path.startswith("code."):
            raise InvalidInput("a sweep cannot vary its code package: put the variants in one package and sweep "
                               "over model.args.* or training.entrypoint_args.*", field=f"search_space.{path}")
        if path in CODE_AXES or path.startswith(tuple(f"{a}." for a in CODE_AXES)):
            check_may_run_code(settings, user, f"search_space.{path}", f", and search_space.{path} would")


def admit_spec(settings: Settings, spec: ExperimentSpec, prefix: str) -> ExperimentSpec:
    """Sizes, CPU per worker, model-data fit, then the dataset's files; returns the spec with resolved paths and the
    cluster's ``TLAB_DEFAULT_MEMORY_GB`` where it asks no memory."""
    check_sizes(settings, spec, prefix)
    check_device(spec, prefix)
    check_compat(spec, prefix)
    resources = spec.resources
    if resources.memory_gb is None and settings.default_memory_gb is not None:
        resources = resources.model_copy(update={"memory_gb": settings.default_memory_gb})
    return spec.model_copy(update={"dataset": admit_dataset(settings, spec.dataset, f"{prefix}.dataset"),
                                   "resources": resources})


def check_device(spec: ExperimentSpec, prefix: str) -> None:
    """A job trains on CUDA only with a GPU share: without one it sees no GPU (``CUDA_VISIBLE_DEVICES`` empty)."""
    if spec.training.device == "cuda" and spec.resources.gpus_per_worker <= 0:
        raise InvalidInput(f"{prefix}.training.device=cuda but {prefix}.resources.gpus_per_worker=0: a job sees no "
                           "GPU it did not ask for: set gpus_per_worker (e.g. 0.5 or 1), or training.device=auto",
                           field=f"{prefix}.training.device")


# ---------------------------------------------------------------------------------------- who may ask


def check_priority(user: UserPublic, priority: int) -> None:
    if user.role != Role.ADMIN and priority > user.quotas.max_priority:
        raise InvalidInput(f"{priority} is above your max_priority quota of {user.quotas.max_priority}: submit at "
                           f"most that, or ask an admin to raise it", field="priority")


def check_quotas(user: UserPublic, body: ExperimentSubmit | SweepSubmit) -> None:
    """A gang bigger than the user's quotas would wait forever: refuse it now."""
    demand, field = demand_of(body), "spec.resources" if isinstance(body, ExperimentSubmit) else "base.resources"
    q = user.quotas
    if demand.gpus > q.max_gpus:
        raise InvalidInput(f"the gang needs {demand.gpus:g} GPUs at once; your max_gpus quota is {q.max_gpus:g}: "
                           "lower workers or gpus_per_worker, or ask an admin", field=f"{field}.gpus_per_worker")
    if demand.cpus > q.max_cpus:
        raise InvalidInput(f"the gang needs {demand.cpus:g} CPUs at once; your max_cpus quota is {q.max_cpus:g}: "
                           "lower workers or cpus_per_worker, or ask an admin", field=f"{field}.cpus_per_worker")
    if q.max_memory_gb is not None and demand.memory > q.max_memory_gb:
        raise InvalidInput(f"the gang needs {demand.memory:g} GiB of memory at once; your max_memory_gb quota is "
                           f"{q.max_memory_gb:g}: lower workers or memory_gb, or ask an admin",
                           field=f"{field}.memory_gb")


def check_notify(settings: Settings, notify: Notify | None) -> None:
    """The webhook's host is one an admin allows (``TLAB_WEBHOOK_ALLOW``; empty: any) and, unless named there,
    no loopback, link-local or private address (``service.rules.webhooks``)."""
    allow = settings.webhook_hosts
    if notify is not None and allow and (host := webhook_host(notify.webhook)) not in allow:
        raise InvalidInput(f"host {host} is not one this service sends webhooks to ({', '.join(sorted(allow))}; "
                           "TLAB_WEBHOOK_ALLOW): use one of them, or ask an admin", field="notify.webhook")
    if notify is not None and (why := webhook_guard.refusal(settings, notify.webhook, unresolved_ok=True)):
        raise InvalidInput(why, field="notify.webhook")


# ---------------------------------------------------------------------------------------- sizes


def model_size(model: object) -> tuple[str, int, int]:
    """(the width field, the widest layer, the number of layers) of a model spec."""
    if isinstance(model, MLPModel):
        return "hidden", max(model.hidden, default=0), len(model.hidden)
    if isinstance(model, TransformerModel):
        return "head_dim", model.heads * model.head_dim * model.mlp_ratio, model.layers
    channels: list[int] = getattr(model, "channels", [])
    return "channels", max(channels, default=0), len(channels)


def teleport_batches(spec: ExperimentSpec) -> int:
    """Teleport batches the run will do: ``teleport.batches`` x the teleport epochs within ``training.epochs``."""
    t = spec.teleport
    return t.batches * sum(e < spec.training.epochs for e in t.epochs) if t.enabled else 0


def check_sizes(s: Settings, spec: ExperimentSpec, prefix: str) -> None:
    width_field, width, layers = model_size(spec.model)
    layer_field = "layers" if isinstance(spec.model, TransformerModel) else width_field
    limits = [
        (spec.training.epochs, s.max_epochs, "training.epochs", "TLAB_MAX_EPOCHS"),
        (width, s.max_width, f"model.{width_field}", "TLAB_MAX_WIDTH"),
        (layers, s.max_layers, f"model.{layer_field}", "TLAB_MAX_LAYERS"),
        (teleport_batches(spec), s.max_teleport_batches, "teleport.batches", "TLAB_MAX_TELEPORT_BATCHES"),
        (spec.teleport.steps if spec.teleport.enabled else 0, s.max_teleport_steps, "teleport.steps",
         "TLAB_MAX_TELEPORT_STEPS"),
    ]
    for value, limit, field, env in limits:
        if value > limit:
            raise InvalidInput(f"{value} is over this service's limit of {limit} ({env}): lower it, or ask an "
                               f"admin to raise {env}", field=f"{prefix}.{field}")
    cpus = spec.resources.cpus_per_worker
    if cpus < s.min_cpus_per_worker:
        raise InvalidInput(f"{cpus:g} is below the minimum of {s.min_cpus_per_worker:g} CPU per worker "
                           "(TLAB_MIN_CPUS_PER_WORKER): give each worker more",
                           field=f"{prefix}.resources.cpus_per_worker")


def check_compat(spec: ExperimentSpec, prefix: str) -> None:
    """The model takes the dataset's samples (built-in datasets' shapes are known; npz, custom datasets and custom
    models are checked by the workers)."""
    shape = sample_shape(spec.dataset)
    if shape is None:
        return
    try:
        check_model_data(spec.model, shape.task, shape.input_shape, spec.dataset.name)
    except ValueError as err:
        raise InvalidInput(str(err), field=f"{prefix}.model") from None


# ---------------------------------------------------------------------------------------- data roots


def inside(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def candidates(value: str, roots: list[Path]) -> list[Path]:
    """Where ``value`` may live: itself if absolute; else under each root, as given and without a leading
    ``data/`` (a preset's ``data/mnist`` is ``<root>/mnist``)."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return [path]
    rels = [path] + ([Path(*path.parts[1:])] if path.parts[0] == "data" and len(path.parts) > 1 else [])
    return [root / rel for root in roots for rel in rels]


def resolve_in_roots(value: str, roots: list[Path], field: str) -> Path:
    """The first existing candidate (else the first), resolved; InvalidInput if it leaves the data roots."""
    options = candidates(value, roots)
    real = next((c for c in options if c.exists()), options[0]).resolve()
    if not inside(real, roots):
        raise InvalidInput(f"{value} is outside the data roots ({':'.join(map(str, roots))}) once '..' and "
                           "symlinks are resolved: put the data under one of them", field=field)
    return real


def check_not_service(settings: Settings, real: Path, value: str, field: str) -> None:
    """A dataset directory is never one that holds the service's home or its storage, nor one inside storage
    (where a data root is ``/`` or the home itself, say): the sandbox would mount the service's secrets or other
    jobs' files."""
    own = [settings.home.expanduser().resolve(), Path(settings.storage_path).expanduser().resolve()]
    if any(o == real or o.is_relative_to(real) for o in own) or real.is_relative_to(own[1]):
        raise InvalidInput(f"{value} holds or lies in the service's own files ({own[0]}, {own[1]}): name a "
                           "directory of your data under the data roots instead", field=field)


def admit_dataset(settings: Settings, ds: DatasetSpec, prefix: str) -> DatasetSpec:
    """The dataset spec with its root/path resolved under the data roots and its files found there. Every kind's
    root and path, when given, is checked (a built-in or custom dataset's absolute ones too: the sandbox mounts
    them)."""
    roots = settings.data_root_paths
    if ds.name in FILELESS or ds.name == "custom":  # a custom dataset is the user's code: the workers read it
        update = {}
        for name in ("root", "path"):
            if (given := getattr(ds, name)) and Path(given).expanduser().is_absolute():  # (relative: in its code)
                update[name] = str(real := resolve_in_roots(given, roots, f"{prefix}.{name}"))
                check_not_service(settings, real, given, f"{prefix}.{name}")
        return ds.model_copy(update=update)
    field = f"{prefix}.path" if ds.name == "npz" else f"{prefix}.root"
    given = (ds.path if ds.name == "npz" else ds.root) or ""
    real = resolve_in_roots(given, roots, field)
    check_not_service(settings, real, given, field)
    resolved = ds.model_copy(update={"path" if ds.name == "npz" else "root": str(real)})
    try:
        files = required_files(resolved)
    except DatasetNotFound as err:
        raise InvalidInput(str(err).removeprefix("dataset.path: "), field=field) from None
    for f in files:
        if not inside(f.resolve(), roots):
            raise InvalidInput(f"{f.relative_to(real) if f != real else f.name} is a link that leaves the data "
                               "roots: copy the file in instead", field=field)
    if ds.name == "tokens":  # what the files' sizes tell now, not when the job loads them
        try:
            check_token_sizes(resolved)
        except TokenFileError as err:
            raise InvalidInput(str(err), field=f"{prefix}.{err.field}") from None
    return resolved


# ---------------------------------------------------------------------------------------- sweep axes


def check_axes(settings: Settings, body: SweepSubmit, base: ExperimentSpec) -> None:
    """Each value of each axis the checks read, put in the base spec once: sizes, fit, files (not root/path)."""
    dumped = base.model_dump(mode="json")
    for path, dist in body.search_space.items():
        if path in FIXED_IN_SWEEPS:
            raise InvalidInput("a sweep cannot vary where the data lives: submit one sweep per dataset location",
                               field=f"search_space.{path}")
        if not path.startswith(PROBED):
            continue
        kind, args = next(iter(dist.items()))
        for value in probe_values(kind, args):
            spec = ExperimentSpec.model_validate(apply_overrides(dumped, [f"{path}={json.dumps(value)}"]))
            try:
                admit_spec(settings, spec, "base")
            except InvalidInput as err:
                raise InvalidInput(f"value {value!r}: {err.field}: {err.message}", field=f"search_space.{path}"
                                   ) from None
