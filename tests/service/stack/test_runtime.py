"""The runtime a root ``tlab up`` gives its service user (``service.stack.runtime``): a copy of this Python that
another uid can run, with the project on its path; made once, reused, made again when a start left it half-made."""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from service.stack import runtime

NOBODY = 65534


def test_the_runtime_is_made_once_runs_as_another_uid_and_a_half_made_one_is_made_again() -> None:
    parent = Path(tempfile.mkdtemp(prefix="tlab-rt-", dir="/tmp"))  # pytest's temp root is closed to others
    try:
        os.chmod(parent, 0o755)
        python = runtime.ensure(parent / "rt")
        assert python == parent / "rt" / "venv" / "bin" / "python"
        short = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        lib = parent / "rt" / "python" / "lib" / short
        assert (lib / "os.py").is_file() and not (lib / "test").exists()
        assert list((lib / "site-packages").iterdir()) == []  # none of the base's packages
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):
            assert "$ORIGIN/../lib" in runtime.runpath(parent / "rt" / "python" / "bin" / short).split(":")
        if os.geteuid() == 0:
            assert runtime.runs_as(str(python), NOBODY, NOBODY) == ""  # the project imports, as another uid
        stamp = parent / "rt" / runtime.STAMP
        made = stamp.stat().st_mtime_ns
        assert runtime.ensure(parent / "rt") == python and stamp.stat().st_mtime_ns == made  # reused
        stamp.unlink()  # a start killed half-way
        shutil.rmtree(lib / "json")
        runtime.ensure(parent / "rt")
        assert stamp.is_file() and (lib / "json" / "__init__.py").is_file()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_a_runpath_is_rewritten_in_place_and_never_grown(tmp_path: Path) -> None:
    exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    old = runtime.runpath(exe)
    if not old:
        pytest.skip("this Python's executable has no RUNPATH")
    copy = tmp_path / "python"
    shutil.copy2(exe, copy)
    with pytest.raises(runtime.RuntimeRefused, match="cannot rewrite"):
        runtime.set_runpath(copy, old.split(":")[0], "/" + "x" * len(old))
    runtime.set_runpath(copy, old.split(":")[0], "$ORIGIN/../lib")
    assert runtime.runpath(copy).split(":")[0] == "$ORIGIN/../lib"
    assert copy.stat().st_size == exe.stat().st_size
