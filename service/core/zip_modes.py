"""A code package's member modes masked before Ray unpacks it: Ray's unzip ``chmod``s each file to the mode its zip
member carries, so a member marked 04755 would unpack setuid, one marked 0666 writable by every job.

``masked`` rewrites the 4-byte external attributes of each central directory record in place (the bytes Ray's
``zipfile`` reads), nothing else: a file becomes 0755 if any execute bit was set, else 0644; a directory 0755;
anything else a plain 0644 file (links are refused at upload already). The local headers carry no mode.
"""

from __future__ import annotations

import stat
import struct
import zipfile
from io import BytesIO

CENTRAL = b"PK\x01\x02"
ATTR_AT = 38  # offset of the external attributes in a central directory record
NAMES_AT = 28  # offsets of the name, extra and comment lengths


def mask(mode: int) -> int:
    """The Unix mode a member unpacks with: type bits kept (a directory stays one), permissions 0755 or 0644."""
    if stat.S_ISDIR(mode):
        return stat.S_IFDIR | 0o755
    return stat.S_IFREG | (0o755 if mode & 0o111 else 0o644)


def masked(data: bytes) -> bytes:
    """The zip ``data`` with every member's Unix mode ``mask``ed (a member without one is left as it is)."""
    with zipfile.ZipFile(BytesIO(data)) as archive:
        count = len(archive.infolist())
        start = archive.start_dir  # where the central directory begins
    out = bytearray(data)
    at = start
    for _ in range(count):
        if out[at:at + 4] != CENTRAL:
            raise ValueError("the zip's central directory is not where its end record says")
        (attr,) = struct.unpack_from("<I", out, at + ATTR_AT)
        if attr >> 16:
            struct.pack_into("<I", out, at + ATTR_AT, (mask(attr >> 16) << 16) | (attr & 0xFFFF))
        names, extra, comment = struct.unpack_from("<HHH", out, at + NAMES_AT)
        at += 46 + names + extra + comment
    return bytes(out)
