"""Failure reasons are one line a user can read: our own errors as their message, anything else as
``Type: message`` after the user's innermost ``file:line``; Ray Train's wrapped errors unwrapped."""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ray.train import WorkerGroupError

from api_schemas.reasons import MAX_REASON
from workers.train.data_files import DataFormatError
from workers.train.failure import failure_reason

MODELS = """\
import torch


def build(width):
    return torch.nn.Linear(width, 3)(torch.zeros(1, 5))  # line 5: torch raises inside its own frames


def broken():
    return undefined_name  # line 9
"""


@pytest.fixture()
def mylab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A user's package ``mylab`` in the working directory, imported as Ray would from a working_dir."""
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("mylab.models")
    for name in ("mylab.models", "mylab"):
        sys.modules.pop(name, None)


def raised(fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except Exception as err:
        return err
    raise AssertionError("it did not raise")


def test_user_code_is_named_by_its_innermost_frame(mylab: Any) -> None:
    assert failure_reason(raised(mylab.broken)) == (
        "mylab/models.py:9: NameError: name 'undefined_name' is not defined")
    reason = failure_reason(raised(mylab.build, 4))  # torch's frames are skipped: the user's call is named
    assert reason.startswith("mylab/models.py:5: RuntimeError: mat1 and mat2 shapes cannot be multiplied")


def throw(err: BaseException) -> None:
    raise err


def test_our_own_errors_are_their_message_on_one_line() -> None:
    err = raised(throw, DataFormatError("/data/x.txt: line 3 is not a row\nof numbers"))
    assert failure_reason(err) == "/data/x.txt: line 3 is not a row of numbers"
    long = failure_reason(ValueError("x" * 1000 + "\n" + "y" * 10))
    assert long.startswith("ValueError: xxx") and len(long) == MAX_REASON and long.endswith("…")


def test_ray_train_worker_errors_are_unwrapped() -> None:
    """Ray Train hands the driver a WorkerGroupError: the rank's exception without a traceback, and the
    traceback as text (frames under Ray's unpacked working_dir are the user's package)."""
    pkg = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0a1b2c"
    tb = textwrap.dedent(f"""\
        Traceback (most recent call last):
          File "{Path(torch.__file__).parent}/nn/modules/module.py", line 1775, in _call_impl
          File "{Path(__file__).resolve().parents[3]}/workers/train/loop.py", line 158, in train
          File "{pkg}/mylab/models.py", line 88, in build
            return foo
          File "{Path(torch.__file__).parent}/nn/modules/linear.py", line 134, in forward
        NameError: name 'foo' is not defined""")
    err = WorkerGroupError(f"[Rank 0, 1 Error Snippet]:\n{tb}", {1: KeyError("b"), 0: NameError("name 'foo' is "
                                                                                                   "not defined")})
    assert "\n" in str(err)  # what the job's failure reason used to be: the whole snippet
    assert failure_reason(err) == "mylab/models.py:88: NameError: name 'foo' is not defined"
    ours = WorkerGroupError(f"[Rank 0 Error Snippet]:\n{tb.replace(pkg + '/mylab', '/opt/tlab/workers')}",
                            {0: DataFormatError("dataset.path: /data/x.npz: no such file")})
    assert failure_reason(ours) == "dataset.path: /data/x.npz: no such file"
