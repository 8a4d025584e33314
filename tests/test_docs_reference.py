"""The reference pages read off the code (docs/reference/settings.md, cli.md) match it: a new setting, a changed
default or a new CLI option fails here until `make docs-ref` rewrites the page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_checked_in_reference_pages_are_what_the_code_generates() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_ref.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
