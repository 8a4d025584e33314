"""``--code DIR``'s zip: the same bytes for an unchanged directory, ignore files honoured, links that leave DIR and
directories over the cap refused with a message that says what to do."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import pytest

from service.cli.code_zip import MB, CodeDirError, ignored, parse_rules, zip_dir


def make_dir(root: Path) -> Path:
    for rel, text in {"mylab/__init__.py": "", "mylab/models.py": "def build():\n    pass\n",
                      "data/big.npy": "x" * 100, "notes.log": "log", "keep.log": "kept", "build/out.txt": "o",
                      "mylab/__pycache__/models.cpython-311.pyc": "pyc", ".git/HEAD": "ref",
                      "sub/build/deep.txt": "deep"}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / ".gitignore").write_text("# comment\n*.log\n!keep.log\n/build/\n")
    (root / ".tlabignore").write_text("data/\n")
    return root


def names(data: bytes) -> list[str]:
    return zipfile.ZipFile(io.BytesIO(data)).namelist()


def test_the_zip_is_deterministic_and_honours_the_ignore_files(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "pkg")
    first = zip_dir(root, 50 * MB)
    os.utime(root / "mylab" / "models.py", (1, 1))  # a touched file with the same bytes: the same zip
    assert zip_dir(root, 50 * MB) == first
    assert names(first) == [".gitignore", ".tlabignore", "keep.log", "mylab/__init__.py", "mylab/models.py",
                            "sub/build/deep.txt"]  # /build/ is anchored: sub/build stays
    (root / "mylab" / "models.py").write_text("def build():\n    return 1\n")
    assert zip_dir(root, 50 * MB) != first


def test_gitignore_forms() -> None:
    rules = parse_rules(["*.py[co]", "docs/**/*.md", "tmp/", "!tmp/keep", "a?c"])
    assert ignored(rules, "x/y.pyc", False) and not ignored(rules, "x/y.py", False)
    assert ignored(rules, "docs/a/b/c.md", False) and ignored(rules, "docs/c.md", False)
    assert not ignored(rules, "other/docs/c.md", False)
    assert ignored(rules, "deep/tmp", True) and not ignored(rules, "deep/tmp", False)
    assert ignored(rules, "abc", False) and not ignored(rules, "a/c", False)


def test_links_leaving_the_directory_and_a_package_over_the_cap_are_refused(tmp_path: Path) -> None:
    root = make_dir(tmp_path / "pkg")
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    (root / "inside_link.py").symlink_to(root / "mylab" / "models.py")
    assert "inside_link.py" in names(zip_dir(root, 50 * MB))  # a link within DIR: stored as the file
    (root / "leak.txt").symlink_to(outside)
    with pytest.raises(CodeDirError, match=r"leak\.txt is a link to .*outside the directory"):
        zip_dir(root, 50 * MB)
    (root / "leak.txt").unlink()
    (root / "weights.bin").write_bytes(os.urandom(300_000))
    with pytest.raises(CodeDirError, match=r"over TLAB_MAX_CODE_MB=0\.2 MiB; the largest files: weights\.bin "
                                           r"\(0\.3 MiB\).*\.tlabignore"):
        zip_dir(root, int(0.2 * MB))
