"""The gate between what a job wrote and the trusted side (``api_schemas.gate``), on real files: ids of the service's
shapes only, paths below a root with no link followed, trees copied as regular files within bounds, trees removed
without following a link."""

from __future__ import annotations

import doctest
import os
from pathlib import Path

import pytest

from api_schemas import gate


def test_its_examples_hold() -> None:
    assert doctest.testmod(gate).failed == 0


@pytest.mark.parametrize("value", ["/../../18f3a2b4c5d-9e1f2a", "18f3a2b4c5d-9e1f2a/..", "../x", "a/b", "a.b", "",
                                   None, 7, "x" * 65])
def test_ids_not_of_the_services_shape_are_refused(value: object) -> None:
    for check in (gate.job_id, gate.trial_id):
        with pytest.raises(gate.Refused, match="not of the shape"):
            check(value)
    assert gate.job_id("18f3a2b4c5d-9e1f2a") == "18f3a2b4c5d-9e1f2a"
    assert gate.trial_id("ab12c_00001") == "ab12c_00001" and gate.trial_id("1a2b3c4d") == "1a2b3c4d"


@pytest.mark.parametrize("named", ["/etc", "..", "a/../../b", "./a", "/srv/store", "/srv/storex/a", "a/./b"])
def test_a_named_path_outside_its_root_or_with_dots_is_refused(named: str) -> None:
    with pytest.raises(gate.Refused):
        gate.named_under("/srv/store", named)
    assert gate.named_under("/srv/store", "a//b/") == ("a", "b")


def test_a_link_anywhere_below_the_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "root" / "job").mkdir(parents=True)
    (tmp_path / "root" / "job" / "via").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "root" / "job" / "secret").symlink_to(tmp_path / "elsewhere" / "file")
    (tmp_path / "elsewhere" / "file").write_text("secret")
    root = tmp_path / "root"
    assert gate.real_dir(root, "job") == root / "job"
    for parts in (("job", "via"), ("job", "via", "deep")):
        with pytest.raises(gate.Refused, match="link"):
            gate.real_dir(root, *parts)
    assert not gate.regular_file(root, "job", "secret") and not gate.regular_file(root, "job", "via", "deep")
    with pytest.raises(FileNotFoundError):
        gate.real_dir(root, "nope")
    with pytest.raises(gate.Refused):
        gate.real_dir(root, "..")


def test_a_tree_is_copied_as_regular_files_only_within_its_bounds(tmp_path: Path) -> None:
    secret = tmp_path / "admin.token"
    secret.write_text("tl_secret")
    src = tmp_path / "root" / "report"
    (src / "sub").mkdir(parents=True)
    (src / "checkpoint.pt").write_bytes(b"weights" * 100)
    (src / "sub" / "meta.json").write_text("{}")
    (src / "token").symlink_to(secret)
    (src / "sub" / "up").symlink_to(tmp_path)
    os.mkfifo(src / "fifo")
    dest = tmp_path / "own"
    dest.mkdir()
    done = gate.copy_tree(tmp_path / "root", ("report",), dest, max_bytes=10_000, max_files=10)
    assert sorted(done.left_out) == ["fifo", "sub/up", "token"] and done.bytes == 702
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*"))
    assert copied == ["checkpoint.pt", "sub", "sub/meta.json"]
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert (dest / "checkpoint.pt").read_bytes() == b"weights" * 100
    for bounds in ({"max_bytes": 100, "max_files": 10}, {"max_bytes": 10_000, "max_files": 2}):
        again = tmp_path / f"again-{bounds['max_files']}"
        again.mkdir()
        with pytest.raises(gate.Refused, match="more than"):
            gate.copy_tree(tmp_path / "root", ("report",), again, **bounds)
    (tmp_path / "root" / "linked").symlink_to(src)
    with pytest.raises(gate.Refused):
        gate.copy_tree(tmp_path / "root", ("linked",), tmp_path / "own", 10_000, 10)


def test_a_tree_is_removed_without_following_a_link(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("alive")
    scratch = tmp_path / "root" / "job" / "scratch"
    scratch.mkdir(parents=True)
    (scratch / "out").symlink_to(canary)
    (tmp_path / "root" / "job" / "planted").symlink_to(canary)
    with pytest.raises(gate.Refused):
        gate.remove_tree(tmp_path / "root", "job", "planted")
    gate.remove_tree(tmp_path / "root", "job", "scratch")
    gate.remove_tree(tmp_path / "root", "job", "scratch")  # gone: nothing to do
    assert not scratch.exists() and (canary / "keep").read_text() == "alive"
