"""A model that returns more than its logits (nanoGPT's ``(logits, loss)``, a Hugging Face output, its own loss, the
last position's logits only) fails on the loss's first call with one line naming the fix, in our loop too."""

from __future__ import annotations

import pytest
import torch

from tests.workers.train.test_user_code import package, spec_for
from workers.train.loop import run_local
from workers.train.model_output import CheckedLoss, output_problem
from workers.train.models import cross_entropy_loss, lm_loss
from workers.train.user_code import UserCodeError

TUPLE = '''
import torch
from torch import nn
from torch.nn import functional as F


class GPTLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(6, 3)

    def forward(self, x, targets=None):  # as nanoGPT's GPT: (logits, loss)
        logits = self.head(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets)


def build():
    return GPTLike()
'''


@pytest.mark.parametrize(("out", "task", "needle"), [
    ((torch.zeros(4, 3), None), "classification", "a tuple of 2 (nanoGPT's `(logits, loss)`?)"),
    ({"logits": torch.zeros(4, 3), "loss": None}, "classification", "a dict (logits, loss)"),
    (torch.tensor(1.0), "classification", "a scalar (its own loss?)"),
    (torch.zeros(4, 1, 11), "lm", "(4, 1, 11) for targets (4, 7): an LM's output is (batch, seq, vocab)"),
    (torch.zeros(2, 3), "classification", "(2, 3) for targets (4,)"),
])
def test_an_output_the_loss_cannot_take_is_named_with_its_fix(out: object, task: str, needle: str) -> None:
    target = torch.zeros(4, 7, dtype=torch.long) if task == "lm" else torch.zeros(4, dtype=torch.long)
    problem = output_problem(out, target, task)
    assert problem is not None and needle in problem and "\n" not in problem, problem
    with pytest.raises(UserCodeError, match="the model returned"):
        CheckedLoss(lm_loss if task == "lm" else cross_entropy_loss, task)(out, target)


def test_a_good_output_is_checked_once_and_then_is_the_loss_alone() -> None:
    loss = CheckedLoss(cross_entropy_loss, "classification")
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert loss(x, y) == cross_entropy_loss(x, y) and loss.checked
    assert output_problem(torch.zeros(4, 7, 11), torch.zeros(4, 7, dtype=torch.long), "lm") is None


def test_our_loop_stops_a_tuple_model_on_its_first_step_with_the_fix(tmp_path) -> None:  # noqa: ANN001
    name, _root = package(tmp_path, TUPLE)
    with pytest.raises(UserCodeError, match=r"returned a tuple of 2 .* return self.model\(x\)\[0\]"):
        run_local(spec_for(name), tmp_path / "run", progress=False)  # type: ignore[arg-type]
