"""``--code DIR`` for the CLI: the packing and upload are the client's (``tlab.code_zip``); this adds the line
the CLI prints about it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tlab.code_zip import MB, CodeDirError, ignored, parse_rules, upload, zip_dir

if TYPE_CHECKING:
    from tlab.client import Client

__all__ = ["MB", "CodeDirError", "ignored", "parse_rules", "upload", "with_code", "zip_dir"]


def with_code(c: Client, spec: dict[str, Any], directory: str | None) -> dict[str, Any]:
    """``spec`` with ``code.package`` set to DIR's package (uploaded if new), said on stderr; as it is without DIR."""
    from tlab.code_zip import with_code as attach

    spec, done = attach(c, spec, directory)
    if done:
        note = "uploaded" if done["uploaded"] else "unchanged, not uploaded again"
        print(f"code {directory}: {done['package'][:19]}… ({done['bytes'] / 1024:.0f} KiB, {note})", file=sys.stderr)
    return spec
