"""What the loss takes from a model: its output tensor, one row of scores per target. A model written for its own
training loop often returns more, and fails deep inside the loss with a message that names neither the model nor
the fix; the first call of the loss checks the output and says in one line what to change.

- nanoGPT's ``GPT.forward`` returns ``(logits, loss)``: a tuple (or a dict, as Hugging Face's ``ModelOutput``);
- called without targets it returns the last position's logits only, ``(B, 1, V)`` for targets ``(B, T)``;
- a model that computes its own loss returns a scalar.

Example::

    loss_fn = CheckedLoss(lm_loss, "lm")
    loss_fn(model(x), y)  # UserCodeError: the model returned a tuple of 2 ... return the logits alone
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from workers.train.user_code import UserCodeError

PICK_LOGITS = ("wrap it in your factory so that forward returns the logits alone, e.g. "
               "`class Logits(nn.Module): forward(self, x): return self.model(x)[0]`")


def output_problem(out: Any, target: Tensor, task: str) -> str | None:
    """Why ``out`` cannot be the loss's input for ``target`` (None when it can)."""
    if isinstance(out, tuple | list):
        return (f"the model returned a {type(out).__name__} of {len(out)} (nanoGPT's `(logits, loss)`?), where the "
                f"loss takes the logits: {PICK_LOGITS}")
    if isinstance(out, dict):
        return (f"the model returned a {type(out).__name__} ({', '.join(map(str, list(out)[:4]))}), where the loss "
                f"takes the logits: {PICK_LOGITS.replace('[0]', '.logits')}")
    if not isinstance(out, Tensor):
        return f"the model returned a {type(out).__name__}, where the loss takes a tensor of logits"
    if out.dim() == 0:
        return ("the model returned a scalar (its own loss?), where the loss takes the logits, one row per target: "
                "return the logits and leave the loss to training.loss")
    shape, want = tuple(out.shape), tuple(target.shape)
    if task == "lm" and shape[:-1] != want:
        return (f"the model returned {shape} for targets {want}: an LM's output is (batch, seq, vocab), the logits "
                "at every position (nanoGPT's GPT called without targets returns only the last position's: return "
                "self.lm_head(x) for all of them)")
    if want and shape[0] != want[0]:
        return f"the model returned {shape} for targets {want}: one row of outputs per sample, (batch, ...)"
    return None


class CheckedLoss:
    """``loss_fn`` whose first call checks the model's output (``output_problem``); later calls are the loss alone.
    A module-level class, so it pickles for Ray like the losses it wraps."""

    def __init__(self, loss_fn: Callable[[Tensor, Tensor], Tensor], task: str) -> None:
        self.loss_fn, self.task, self.checked = loss_fn, task, False
        self.__name__ = getattr(loss_fn, "__name__", type(loss_fn).__name__)  # the loss it is, as a log names it

    def __call__(self, out: Any, target: Tensor) -> Tensor:
        if not self.checked:
            problem = output_problem(out, target, self.task)
            if problem:
                raise UserCodeError(problem)
            self.checked = True
        return self.loss_fn(out, target)
