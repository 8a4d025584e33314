"""Whether a model kind can take a dataset's samples: the rule the workers' model builders apply, and the
service applies at submit to the built-in datasets, whose shapes are known without reading them.

Shapes are one sample's x without the batch dim; ``None`` marks a size only the files know (a series'
column count). Each refusal is a ValueError naming the spec field to change.
"""

from __future__ import annotations

from api_schemas.spec import CNNModel, MLPModel, ResNetModel, TransformerModel

AnyModelSpec = MLPModel | CNNModel | ResNetModel | TransformerModel
Shape = tuple[int | None, ...]


def where(dataset: str | None) -> str:
    return f"dataset {dataset}" if dataset else "the dataset"


def shape_text(shape: Shape) -> str:
    """``(168, D)`` for a shape with a size only the files know, else the tuple as Python prints it."""
    if all(s is not None for s in shape):
        return str(tuple(shape))
    return "(" + ", ".join("D" if s is None else str(s) for s in shape) + ")"


def no_lm(kind: str, task: str, dataset: str | None) -> None:
    if task == "lm":
        raise ValueError(
            f"model.kind={kind} cannot do language modelling ({where(dataset)} gives token sequences): "
            "use model.kind=transformer"
        )


def check_image(kind: str, input_shape: Shape, dataset: str | None) -> None:
    """CNNs and ResNets take images (C,H,W)."""
    if len(input_shape) != 3:
        hint = "model.kind=transformer" if len(input_shape) == 2 else "model.kind=mlp"
        raise ValueError(
            f"model.kind={kind} needs image input (C,H,W); {where(dataset)} gives {shape_text(input_shape)}: "
            f"use {hint}"
        )


def check_transformer(spec: TransformerModel, task: str, input_shape: Shape, dataset: str | None) -> None:
    """Token input (T,) for language modelling, sequences (T,D) otherwise, T within ``max_len``."""
    if task == "lm":
        if len(input_shape) != 1:
            raise ValueError(
                f"model.kind=transformer for language modelling needs token input (T,); "
                f"{where(dataset)} gives {shape_text(input_shape)}"
            )
        if spec.pooling not in (None, "none"):
            raise ValueError(f"model.pooling={spec.pooling} does not fit a language model: set model.pooling=none")
    else:
        if len(input_shape) != 2:
            hint = "model.kind=cnn" if len(input_shape) == 3 else "model.kind=mlp"
            raise ValueError(
                f"model.kind=transformer needs sequence input (T,D); {where(dataset)} gives "
                f"{shape_text(input_shape)}: use {hint}"
            )
        if spec.pooling == "none":
            raise ValueError(
                f"model.pooling=none gives one output per position, which only a language model uses: "
                f"set model.pooling=mean or last for {task}"
            )
    t = input_shape[0]
    if t is not None and t > spec.max_len:
        raise ValueError(
            f"{where(dataset)} has sequences of length {t} > model.max_len={spec.max_len}: set model.max_len>={t}"
        )


def check_model_data(spec: AnyModelSpec, task: str, input_shape: Shape, dataset: str | None = None) -> None:
    """Raise ValueError naming the field to change when ``spec`` cannot take samples of ``input_shape``."""
    if isinstance(spec, MLPModel):
        no_lm("mlp", task, dataset)
    elif isinstance(spec, CNNModel | ResNetModel):
        no_lm(spec.kind, task, dataset)
        check_image(spec.kind, input_shape, dataset)
    elif isinstance(spec, TransformerModel):
        check_transformer(spec, task, input_shape, dataset)
