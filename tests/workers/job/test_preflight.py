"""The preflight's own work, in this process (no Ray, no Redis): a good package's model, data and teleport report; a
factory with a NameError, an own loop with a wrong signature and a loss that does not fit the targets as one line
naming the user's file and line (the traceback as a log event); a sweep tried at its first point."""

from __future__ import annotations

import itertools
import re
import textwrap
from pathlib import Path

from api_schemas import build_spec
from api_schemas.sweeps import preflighted_spec
from workers.job.preflight_check import preflight
from workers.train.sinks import MemorySink
from workers.train.user_code import add_code_dir

_names = itertools.count()
MODELS = '''
from torch import nn


def mlp(hidden=16):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def broken(hidden=16):
    return undefined_name  # line 10
'''
LOOPS = '''
def fine(ctx):
    pass


def two(ctx, extra):  # line 6
    pass
'''


def package(tmp_path: Path) -> str:
    name = f"pfpkg{next(_names)}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "models.py").write_text(textwrap.dedent(MODELS))
    (tmp_path / name / "loops.py").write_text(textwrap.dedent(LOOPS))
    add_code_dir(tmp_path)
    return name


def spec(name: str, factory: str = "mlp", **training: object) -> object:
    return build_spec({"dataset": {"name": "digits"},
                       "model": {"kind": "custom", "factory": f"{name}.models:{factory}", "args": {"hidden": 16}},
                       "training": {"epochs": 1, "batch_size": 32, **training},
                       "teleport": {"epochs": [0], "batches": 1, "batch_size": 16, "steps": 2, "tau": 0.9}})


def test_a_good_package_reports_its_model_data_and_teleportable_layers(tmp_path: Path) -> None:
    result = preflight(spec(package(tmp_path)), MemorySink())
    assert result.state == "passed" and result.error is None
    assert result.params == 64 * 16 + 16 + 16 * 10 + 10
    assert result.task == "classification" and result.train_size > result.test_size > 0
    assert result.sample_shape == [1, 8, 8] and result.loss is not None and result.loss > 0
    assert result.teleport == "nullspace" and result.tau == 0.9
    assert [layer.name for layer in result.layers] and result.free_directions == sum(
        layer.free for layer in result.layers) and result.free_directions > 0
    assert all(layer.free == layer.input_dim - layer.rank for layer in result.layers)


def with_teleport(base: object, **teleport: object) -> object:
    return base.model_copy(update={"teleport": base.teleport.model_copy(update=teleport)})


def test_the_teleport_step_says_what_it_tells_of_the_cap_and_the_lr(tmp_path: Path) -> None:
    # before the gang is held, the user sees whether teleport will move at all, and by how much
    base = spec(package(tmp_path))
    moved = preflight(with_teleport(base, lr=1.0, cap=1e9, steps=8, tau=1.0), MemorySink())
    before, after = moved.grad_norm_sq, moved.grad_norm_sq_after_step
    assert before > 0 and (after / before) ** 8 > 1.1
    assert moved.step_advice == (f"‖∇L‖² {before:.3g} at the model's first weights; one step at teleport.lr=1 took it "
                                 f"to {after:.3g} ({after / before - 1:+.1%})")
    timid = preflight(with_teleport(base, lr=1e-6, cap=1e9), MemorySink()).step_advice
    assert timid.endswith("(+0.0%): at that rate 2 steps raise it by under 10%, too little to matter; set "
                          "teleport.rise: 1.5 with teleport.cap_ratio: 2 in place of teleport.lr (now 1e-06): each "
                          "batch's ‖∇L‖² raised to about 2x its own, in a step sized from its own slope whatever the "
                          "model's scale (docs/algorithm.md)")
    risen = preflight(with_teleport(base, rise=0.3, cap=1e9, tau=1.0), MemorySink())  # a step sized by its rise
    gained = risen.grad_norm_sq_after_step / before
    assert risen.step_advice == (f"‖∇L‖² {before:.3g} at the model's first weights; one step at teleport.rise=0.3 "
                                 f"took it to {risen.grad_norm_sq_after_step:.3g} ({gained - 1:+.1%})")
    assert 1.3 <= gained < 1.6  # first order, and over it: ‖∇L‖² is convex along the step (here +45 %)
    assert preflight(with_teleport(base, rise=1e-4, cap=1e9, tau=1.0), MemorySink()).step_advice.endswith(
        "too little to matter; raise teleport.rise (now 0.0001)")
    halved = preflight(with_teleport(base, lr=1.0, cap=1e9), MemorySink()).step_advice  # τ 0.9: the loss moves
    assert re.search(r"\(\+\d+\.\d%\) once halved \d times: a longer step moved the batch loss by over "
                     r"teleport.loss_tol=0.001$", halved), halved
    refused = preflight(with_teleport(base, lr=50.0, cap=1e9), MemorySink()).step_advice
    assert refused.endswith("one step at teleport.lr=50 was refused (loss_tol): lower teleport.lr")
    capped = preflight(with_teleport(base, cap=1e-9), MemorySink()).step_advice
    assert capped == (f"‖∇L‖² {before:.3g} at the model's first weights, over teleport.cap=1e-09: no step would be "
                      f"taken; raise the cap above {before:.3g}")
    full = preflight(with_teleport(base, batch_size=512, tau=1.0), MemorySink()).step_advice
    assert full.endswith("no layer has a free direction: lower teleport.batch_size (now 512)")


def test_a_name_error_in_a_factory_is_one_line_at_the_users_file_and_line(tmp_path: Path) -> None:
    name = package(tmp_path)
    sink = MemorySink()
    result = preflight(spec(name, "broken"), sink)
    assert result.state == "failed" and result.params is None
    assert result.error == f"{name}/models.py:10: NameError: name 'undefined_name' is not defined"
    assert any("Traceback" in (r.get("traceback") or "") for r in sink.records)


def test_an_own_loop_is_checked_for_its_signature_only(tmp_path: Path) -> None:
    name = package(tmp_path)
    good = preflight(spec(name, entrypoint=f"{name}.loops:fine"), MemorySink())
    assert good.state == "passed" and good.entrypoint == f"{name}.loops:fine" and good.params is None
    bad = preflight(spec(name, entrypoint=f"{name}.loops:two"), MemorySink())
    assert bad.state == "failed" and bad.error and bad.error.startswith(f"{name}/loops.py:6: TypeError: ")
    assert "must take one argument" in bad.error


def test_a_loss_that_does_not_fit_the_targets_fails_in_one_line(tmp_path: Path) -> None:
    result = preflight(spec(package(tmp_path), loss="mse"), MemorySink())
    assert result.state == "failed" and "training.loss=mse needs float targets" in (result.error or "")


def test_a_sweep_is_tried_at_its_first_point() -> None:
    base = build_spec({"dataset": {"name": "digits"}, "model": {"kind": "mlp", "hidden": [32]}})
    tried = preflighted_spec(base, {"search_space": {"model.hidden": {"grid": [[8], [16]]},
                                                     "optimizer.lr": {"loguniform": [0.001, 0.1]}}})
    assert tried.model.hidden == [8] and tried.optimizer.lr == 0.001
    assert preflighted_spec(base, None) is base
