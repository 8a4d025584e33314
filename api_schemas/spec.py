"""ExperimentSpec: the one contract between the CLI, the service, the scheduler and the workers.

Names follow the paper's symbols: ``teleport.batches`` is b, ``teleport.steps`` is t,
``teleport.batch_size`` is n, ``teleport.lr`` is η (eta_tele), ``teleport.cap`` is CAP and
``teleport.tau`` is τ of eq. 3. Every model forbids unknown fields, so a typo fails with the
field's path instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, ValidationInfo, create_model, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from api_schemas.code import CodeSpec, FactoryRef, LossRef
from api_schemas.strict import Strict as _Strict
from api_schemas.teleport_spec import SCALE_FREE as SCALE_FREE  # (re-exported: the scale-free teleport's fields)
from api_schemas.teleport_spec import TeleportSpec as TeleportSpec

# ---------------------------------------------------------------------------- model


class MLPModel(_Strict):
    """Fully connected net: flatten, then ``hidden`` Linear+activation layers, then a Linear head."""

    kind: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1024, 1024])
    activation: Literal["relu", "leaky_relu", "tanh", "gelu"] = "relu"
    negative_slope: float = Field(0.1, gt=0, lt=1, description="LeakyReLU slope (symmetry teleport needs it)")
    bias: bool = True


class CNNModel(_Strict):
    """The paper's CIFAR net: 3x3 conv + ReLU + 2x2 max pooling per entry of ``channels``, then a head."""

    kind: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [16, 32, 64])
    kernel_size: int = Field(3, ge=1)
    pool: bool = True


class ResNetModel(_Strict):
    """The paper's Tiny-ImageNet residual net: stages of equal-width convs with skip connections."""

    kind: Literal["resnet"] = "resnet"
    channels: list[Annotated[int, Field(gt=0)]] = Field(
        default_factory=lambda: [64, 64, 64, 128, 128, 128, 256, 256, 256]
    )
    batch_norm: bool = False


class TransformerModel(_Strict):
    """Encoder (classifier/regressor) or decoder-only causal LM with attention made of Linear Q/K/V/O.

    ``d_model = heads * head_dim``. The head depends on the dataset's task: classification
    averages over positions, regression reads the last position, language modelling is causal
    and predicts every next token.
    """

    kind: Literal["transformer"] = "transformer"
    heads: int = Field(2, ge=1)
    head_dim: int = Field(64, ge=1)
    layers: int = Field(2, ge=1)
    mlp_ratio: int = Field(2, ge=1)
    max_len: int = Field(1024, ge=1, description="positional embedding table size")
    dropout: float = Field(0.0, ge=0, lt=1)
    pooling: Literal["mean", "last", "none"] | None = Field(
        None, description="None picks by task: mean for classification, last for regression, none for LM"
    )


class CustomModel(_Strict):
    """The user's own model: ``factory(**args)`` returns a ``torch.nn.Module`` (code from ``code.package``)."""

    kind: Literal["custom"] = "custom"
    factory: FactoryRef
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory (a sweep "
                                                                   "can vary model.args.NAME)")


def _model_kind(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("kind", "mlp"))
    return str(getattr(value, "kind", "mlp"))


ModelSpec = Annotated[
    Annotated[MLPModel, Tag("mlp")]
    | Annotated[CNNModel, Tag("cnn")]
    | Annotated[ResNetModel, Tag("resnet")]
    | Annotated[TransformerModel, Tag("transformer")]
    | Annotated[CustomModel, Tag("custom")],
    Discriminator(_model_kind, custom_error_type="model_kind",
                  custom_error_message="model.kind must be one of mlp, cnn, resnet, transformer, custom"),
]


# --------------------------------------------------------------------------- dataset

DatasetName = Literal[
    "digits",
    "synthetic",
    "mnist",
    "fashion_mnist",
    "cifar10",
    "cifar100",
    "tiny_imagenet",
    "smnist",
    "electricity",
    "traffic",
    "ptb",
    "tokens",
    "npz",
    "custom",
]

_NEEDS_ROOT = {"mnist", "fashion_mnist", "cifar10", "cifar100", "tiny_imagenet", "smnist", "electricity",
               "traffic", "ptb", "tokens"}


class DatasetSpec(_Strict):
    """Where the data lives. Offline formats only: IDX, CIFAR pickles, image folders, text matrices, token files.

    Every kind's fields in one class (what the loaders read); the spec's ``dataset`` is one of the kinds below,
    chosen by ``name``, each taking only its own fields (``DATASET_FIELDS``)."""

    name: DatasetName = "digits"
    root: str | None = Field(None, description="directory holding the dataset's standard files")
    path: str | None = Field(None, description="the .npz file for name=npz (arrays X and y)")
    max_train: int | None = Field(None, ge=1, description="use only the first N training samples")
    max_test: int | None = Field(None, ge=1, description="use only the first N test samples")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out share where the data has no split")
    seq_len: int | None = Field(None, ge=2, description="ptb/tokens: tokens per sample (default 256); "
                                                        "electricity/traffic window (default 168)")
    token_dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="name=tokens: the integer type of train.bin/val.bin (default uint16, as nanoGPT writes)")
    vocab_size: int | None = Field(None, ge=2, le=16_777_216, description="name=tokens: the vocabulary size "
                                                                          "(default: the largest token id + 1)")
    horizon: int = Field(24, ge=1, description="electricity/traffic: predict the value this many steps later")
    image_size: int | None = Field(None, ge=8, description="tiny_imagenet: resize side (default 64)")
    normalize: bool = True
    factory: FactoryRef | None = Field(None, description="name=custom: package.module:function returning "
                                                         "(train, test) torch Datasets of (x, y) pairs")
    args: dict[str, Any] = Field(default_factory=dict, description="name=custom: keyword arguments of the factory")

    @model_validator(mode="before")
    @classmethod
    def _required(cls, data: Any) -> Any:
        """A kind's required field, missing, is named with what to give."""
        if cls.__name__ not in DATASET_FIELDS or not isinstance(data, dict):
            return data
        for field, why in (("factory", "package.module:function"), ("path", "the .npz file with arrays X and y"),
                           ("root", "the directory of its files")):
            if cls.__name__ in _REQUIRED[field] and data.get(field) is None:
                raise ValueError(f"dataset.{field} is required for name={data.get('name')}: give {why}")
        return data

    @model_validator(mode="after")
    def _paths(self) -> DatasetSpec:
        if self.name == "custom" and not self.factory:
            raise ValueError("dataset.factory is required for name=custom: give package.module:function")
        if self.name != "custom" and (self.factory or self.args):
            raise ValueError("dataset.factory and dataset.args are for name=custom only: set dataset.name=custom")
        if self.name != "tokens" and (self.token_dtype or self.vocab_size):
            raise ValueError("dataset.token_dtype and dataset.vocab_size are for name=tokens only")
        if self.name == "npz" and not self.path:
            raise ValueError("dataset.path is required for name=npz: give the .npz file with arrays X and y")
        if self.name in _NEEDS_ROOT and not self.root:
            raise ValueError(f"dataset.root is required for name={self.name}: give the directory of its files")
        return self


_EVERY_DATASET = ("name", "max_train", "max_test", "test_fraction", "normalize")
# each kind of dataset (the names it covers) and the fields it takes besides _EVERY_DATASET's
_NAMES: dict[str, tuple[str, ...]] = {
    "BundledDataset": ("digits", "synthetic"),
    "FilesDataset": ("mnist", "fashion_mnist", "smnist", "cifar10", "cifar100"),
    "TinyImageNetDataset": ("tiny_imagenet",),
    "SeriesDataset": ("electricity", "traffic"),
    "PTBDataset": ("ptb",),
    "TokensDataset": ("tokens",),
    "NpzDataset": ("npz",),
    "CustomDataset": ("custom",),
}
DATASET_FIELDS: dict[str, tuple[str, ...]] = {
    "BundledDataset": (),
    "FilesDataset": ("root",),
    "TinyImageNetDataset": ("root", "image_size"),
    "SeriesDataset": ("root", "seq_len", "horizon"),
    "PTBDataset": ("root", "seq_len"),
    "TokensDataset": ("root", "seq_len", "token_dtype", "vocab_size"),
    "NpzDataset": ("path",),
    "CustomDataset": ("factory", "args", "root", "path"),
}
_KIND_DOCS = {
    "BundledDataset": "Generated or bundled with scikit-learn: no files.",
    "FilesDataset": "The standard files (IDX, CIFAR pickles) in ``root``.",
    "TinyImageNetDataset": "Tiny-ImageNet's folders in ``root``, resized to ``image_size``.",
    "SeriesDataset": "A text matrix (rows = hours) in ``root``: ``seq_len`` hours in, the value ``horizon`` later out.",
    "PTBDataset": "PTB's text files in ``root``, ``seq_len`` tokens per sample.",
    "TokensDataset": "Token files (train.bin, val.bin) in ``root``, ``seq_len`` tokens per sample.",
    "NpzDataset": "One .npz file at ``path`` with arrays X and y.",
    "CustomDataset": "The user's own ``factory(**args)``; ``root`` and ``path``, when absolute, are mounted for it.",
}
_REQUIRED = {"root": ("FilesDataset", "TinyImageNetDataset", "SeriesDataset", "PTBDataset", "TokensDataset"),
             "path": ("NpzDataset",), "factory": ("CustomDataset",)}


def _dataset_kind(kind: str) -> type[DatasetSpec]:
    """A DatasetSpec whose JSON Schema lists its own fields only: another kind's is left out of the schema and of
    every dump, and refused by name when given (``_not_mine``)."""
    names = _NAMES[kind]
    default = ... if "digits" not in names else "digits"  # a dataset with no name is digits
    fields: dict[str, Any] = {"name": (Literal[names], default)}  # type: ignore[valid-type]
    for field, info in DatasetSpec.model_fields.items():
        if field in _EVERY_DATASET:
            continue
        if field not in DATASET_FIELDS[kind]:
            hidden = Field(default_factory=info.default_factory, exclude=True) if info.default_factory \
                else Field(info.default, exclude=True)
            fields[field] = (SkipJsonSchema[info.annotation], hidden)  # type: ignore[name-defined]
        elif kind in _REQUIRED.get(field, ()):
            fields[field] = (info.annotation.__args__[0], Field(..., description=info.description,  # type: ignore
                                                               json_schema_extra=None))
    hidden_fields = [f for f in DatasetSpec.model_fields if f not in _EVERY_DATASET and f not in DATASET_FIELDS[kind]]
    refuse = field_validator(*hidden_fields, mode="before")(_not_mine) if hidden_fields else None
    return create_model(kind, __base__=DatasetSpec, __doc__=_KIND_DOCS[kind], __module__=__name__,
                        __validators__={"_not_mine": refuse} if refuse else None, **fields)


def _not_mine(cls: type[DatasetSpec], value: Any, info: ValidationInfo) -> Any:
    """Another kind's field, given: refused at its own path, naming the kinds that take it."""
    takers = [n for kind, fields in DATASET_FIELDS.items() if info.field_name in fields for n in _NAMES[kind]]
    raise ValueError(f"dataset.{info.field_name} is for name={', '.join(takers)} only, not name="
                     f"{info.data.get('name')}")


_DATASET_KINDS = {kind: _dataset_kind(kind) for kind in _NAMES}
_KIND_OF_NAME = {name: kind for kind, names in _NAMES.items() for name in names}
DATASET_TAGS = tuple(_NAMES)  # the union's tags, in an error's location


def _dataset_tag(value: object) -> str | None:
    name = value.get("name", "digits") if isinstance(value, dict) else getattr(value, "name", "digits")
    return _KIND_OF_NAME.get(name) if isinstance(name, str) else None


Dataset = Annotated[
    Union[tuple(Annotated[cls, Tag(kind)] for kind, cls in _DATASET_KINDS.items())],  # type: ignore[valid-type]  # noqa: UP007
    Discriminator(_dataset_tag, custom_error_type="dataset_name",
                  custom_error_message=f"dataset.name must be one of {', '.join(_KIND_OF_NAME)}"),
]


# ------------------------------------------------------------------------- optimizer


class OptimizerSpec(_Strict):
    """The paper's four optimizers plus AdamW. ``momentum`` is used by name=momentum (SGD + momentum)."""

    name: Literal["sgd", "momentum", "adagrad", "adam", "adamw"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, description="adamw: on matrices and embeddings only, not on biases and "
                                                       "normalization weights (1-D), as nanoGPT and Hugging Face's "
                                                       "Trainer do, unless decay_all; the other optimizers: on every "
                                                       "parameter (an L2 term in the gradient)")
    decay_all: bool = Field(False, description="adamw: weight_decay on every parameter, biases and normalization "
                                               "weights too")
    betas: tuple[float, float] = (0.9, 0.999)
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="the learning rate over the run's optimizer steps (training.warmup_steps' "
                                "included), after lr_warmup_steps: constant at lr, or decayed from lr to "
                                "lr x final_lr_ratio at the last step along a half cosine or a line")
    lr_warmup_steps: int = Field(
        0, ge=0, description="optimizer steps over which the learning rate climbs linearly from lr/(n+1) to lr "
                             "before the schedule (not training.warmup_steps, the plain steps before the first "
                             "teleport)")
    final_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="schedule cosine or linear: the last step's learning rate as a share of lr "
                                     "(constant: unused, so that one sweep can compare constant with a decay)")


# -------------------------------------------------------------------------- training


class TrainingSpec(_Strict):
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(32, ge=1)
    seed: int = 0
    warmup_steps: int = Field(0, ge=0, description="optimizer steps before the first teleport (paper: 40 for CNNs)")
    max_steps_per_epoch: int | None = Field(None, ge=1, description="cap the optimizer steps per epoch (LM runs; "
                                                                   "a step is grad_accumulation batches)")
    grad_accumulation: int = Field(
        1, ge=1, le=1024, description="batches whose gradients add up before each optimizer step: the step of a "
                                      "batch of batch_size x this (x workers) in the memory of batch_size, each "
                                      "sample weighing alike (under DDP the gradients are all-reduced once a "
                                      "step). The optimizer steps (warmup_steps, the lr schedule, "
                                      "max_steps_per_epoch) count such steps")
    target_loss: float | None = Field(None, description="report the first epoch whose train loss is below this")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "float64"] = "float32"
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16: each training step's forward and loss run under torch.autocast(bfloat16) on the "
                            "model's device (CPU or CUDA); weights, gradients, optimizer state, evaluation and "
                            "teleport stay in training.dtype (float32). fp16: the same in float16 (GPUs without "
                            "fast bf16: V100, T4), the loss scaled by a torch.amp.GradScaler (a step whose gradients "
                            "overflow is skipped and the scale lowered; the scale is checkpointed). fp32: no "
                            "autocast")
    eval_batch_size: int = Field(1024, ge=1)
    grad_clip_norm: float | None = Field(
        None, gt=0, description="before each optimizer step, scale the gradients down so that their global L2 "
                                "norm is at most this (torch.nn.utils.clip_grad_norm_); each epoch then reports "
                                "grad_norm (its steps' mean norm before clipping) and clipped (the share of its "
                                "steps clipped). none: no clipping")
    loss: LossRef | None = Field(None, description="cross_entropy, mse, or package.module:function(pred, target) "
                                                  "-> scalar; none: cross_entropy for integer targets, mse for "
                                                  "float ones")
    entrypoint: FactoryRef | None = Field(
        None, description="package.module:function(ctx): your own training loop, run on every worker instead of "
                          "ours (docs/spec.md, 'Your own loop'); the model, dataset, optimizer and loss sections are "
                          "then yours to read (ctx.spec)")
    entrypoint_args: dict[str, Any] = Field(default_factory=dict, description="training.entrypoint: what the loop "
                                            "reads as ctx.args (a sweep can vary the ones set here)")

    @model_validator(mode="after")
    def _cross_field(self) -> TrainingSpec:
        if self.entrypoint_args and not self.entrypoint:
            raise ValueError("training.entrypoint_args is for training.entrypoint: set the entrypoint, or drop them")
        if self.precision != "fp32" and self.dtype != "float32":  # autocast leaves float64 tensors as they are
            raise ValueError(f"training.precision={self.precision} needs training.dtype=float32 (autocast does not "
                             "cast float64)")
        return self


# ------------------------------------------------------------------------- resources

GIB = 2**30


def ray_memory(memory_gb: float) -> int:
    """Bytes of Ray's ``memory`` resource for ``memory_gb`` GiB: what a job's driver (``entrypoint_memory``), a gang's
    rank (``memory=``), a Ray Train worker and a Tune trial (``"memory"``) and a preflight reserve."""
    return int(memory_gb * GIB)


class ResourcesSpec(_Strict):
    workers: int = Field(1, ge=1)
    gpus_per_worker: float = Field(
        0, ge=0, description="a share of one GPU (< 1: several processes on one card, their process group on gloo) "
                             "or whole GPUs (1, 2, ...: NCCL); 0: the job sees no GPU (CUDA_VISIBLE_DEVICES empty)")
    cpus_per_worker: float = Field(1, gt=0)
    gpu_memory_gb: float | None = Field(
        None, gt=0, description="GiB of its card's memory each process may allocate (its allocations beyond fail "
                                "naming this limit; with a share < 1, at most that share of the card); none: the "
                                "gpus_per_worker share of the card when it is < 1")
    gpu_type: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="the GPU model each worker needs, as Ray names it (H100, A100, L4, ...: a node's "
                    "accelerator_type:<name> resource); none: any")
    time_limit_s: float | None = Field(
        None, gt=0, description="running time after which the job is stopped (its last checkpoint kept) and ends "
                                "failed; none: the cluster default TLAB_DEFAULT_TIME_LIMIT_S. At most the user's "
                                "max_time_limit_s quota and TLAB_MAX_TIME_LIMIT_S. In a sweep: each trial's limit")
    memory_gb: float | None = Field(
        None, gt=0, le=65536, description="GiB of host memory each worker's process needs: the job starts where Ray "
                                          "can reserve it on the node (more than any node has: refused), and a "
                                          "training whose processes hold more is killed and the job "
                                          "fails saying so (a job whose driver the kernel's OOM killer ended is "
                                          "told to set it); none: the cluster's TLAB_DEFAULT_MEMORY_GB, set "
                                          "at submit, else no reservation and no limit")
    max_retries: int = Field(
        2, ge=0, le=10, description="times the job starts again from its last checkpoint after a process of it died "
                                    "(a signal, the OOM killer, a lost node, a vanished Ray job), all attempts "
                                    "together; an error of the job's own (its code raised, the loss diverged, a "
                                    "failed preflight) is never retried")
    preemptible: bool = Field(
        True, description="a queued job of strictly higher priority may stop this one (it checkpoints, goes back to "
                          "the queue keeping its age, and resumes from its checkpoint); false opts out, for at most "
                          "the user's max_unpreemptible quota of queued or running jobs. A sweep is preempted whole")

    @model_validator(mode="after")
    def _gpus(self) -> ResourcesSpec:
        g = self.gpus_per_worker
        if g > 1 and g != int(g):
            raise ValueError(f"resources.gpus_per_worker={g:g}: above 1 it is a whole number of GPUs (Ray shares "
                             "only a single card): use 1, 2, ... or a share below 1")
        for name in ("gpu_memory_gb", "gpu_type"):
            if getattr(self, name) is not None and g <= 0:
                raise ValueError(f"resources.{name} is for a job with GPUs: set resources.gpus_per_worker > 0, "
                                 f"or drop {name}")
        return self


# ---------------------------------------------------------------------------- spec


class ExperimentSpec(_Strict):
    """One training run: what to train, on what, how, and when to teleport."""

    model: ModelSpec = Field(default_factory=MLPModel)
    dataset: Dataset = Field(default_factory=lambda: _DATASET_KINDS["BundledDataset"]())
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    teleport: TeleportSpec = Field(default_factory=TeleportSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    code: CodeSpec | None = Field(None, description="the uploaded package (POST /v1/code) the factories come from")

    def user_code_fields(self) -> list[str]:
        """The fields that make the workers run code the user chose (what ``TLAB_USER_CODE=off`` refuses)."""
        fields = ["code"] if self.code is not None and (self.code.package or self.code.requirements) else []
        fields += ["model.factory"] if isinstance(self.model, CustomModel) else []
        fields += ["dataset.factory"] if self.dataset.factory else []
        fields += ["training.loss"] if self.training.loss and ":" in self.training.loss else []
        fields += ["training.entrypoint"] if self.training.entrypoint else []
        return fields

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentSpec:
        t = self.teleport
        if t.enabled and t.method == "symmetry" and self.training.entrypoint:
            raise ValueError("teleport.method=symmetry runs in our loop only (MLPs): an own loop "
                             "(training.entrypoint) teleports with method=nullspace")
        if t.enabled and t.method == "symmetry" and not isinstance(self.model, MLPModel):
            raise ValueError("teleport.method=symmetry works only for model.kind=mlp: use method=nullspace")
        if t.enabled and t.method == "symmetry" and self.model.activation != "leaky_relu":  # type: ignore[union-attr]
            raise ValueError(
                "teleport.method=symmetry needs a bijective activation: set model.activation=leaky_relu"
            )
        if t.enabled and t.epochs and all(e >= self.training.epochs for e in t.epochs):
            raise ValueError(
                f"teleport.epochs {t.epochs}: none is < training.epochs={self.training.epochs}, so teleport "
                "would never run: schedule an earlier epoch or set teleport.enabled=false"
            )
        return self
