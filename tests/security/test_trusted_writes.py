"""What the trusted side writes into a job's directory goes where it means, whatever the job planted there: the
supervisor's SHA256SUMS of the job's artifacts (written again from the files once the payload has ended, so the
digests the API lists are the service's, not the job's word) never lands through a link, and a job directory
turned into a link gets nothing written through it. The supervisor's other reads of job output are bounded."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

import pytest

from workers.job.artifacts import SUMS, record_digests
from workers.on_ray import supervisor
from workers.train.failure import JobFailed


def test_the_supervisors_digests_replace_the_jobs_and_follow_no_link(tmp_path: Path) -> None:
    out, canary = tmp_path / "artifacts", tmp_path / "canary"
    out.mkdir()
    canary.write_text("the service's own file")
    (out / "model.safetensors").write_bytes(b"weights")
    (out / SUMS).write_text(f"{'0' * 64}  model.safetensors\n")  # the job's forged word
    (out / f".{SUMS}.tmp").symlink_to(canary)  # planted where the writer puts its temporary copy
    (out / "secret").symlink_to(canary)  # a link among the artifacts: not hashed, not listed
    record_digests(out)
    assert canary.read_text() == "the service's own file"
    sums = (out / SUMS).read_text()
    assert f"{hashlib.sha256(b'weights').hexdigest()}  model.safetensors" in sums
    assert "0" * 64 not in sums and "secret" not in sums
    assert not (out / SUMS).is_symlink()


def test_an_artifacts_directory_that_is_a_link_gets_nothing(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "admin.token").write_text("secret")
    (tmp_path / "artifacts").symlink_to(elsewhere)
    with pytest.raises(OSError):
        record_digests(tmp_path / "artifacts")
    assert sorted(os.listdir(elsewhere)) == ["admin.token"]


def test_a_trial_report_line_over_the_bound_ends_the_try(tmp_path: Path) -> None:
    """A payload writing an endless line: the relay stops reading at the bound (the write goes on meanwhile)."""
    lines, theirs = os.pipe()
    mine, answers = os.pipe()

    def flood() -> None:
        with contextlib.suppress(BrokenPipeError), os.fdopen(theirs, "wb") as w:
            w.write(b"x" * (supervisor.MAX_REPORT_LINE + 10) + b"\n")

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    seen: list[bytes] = []
    with pytest.raises(JobFailed, match="a line over"):
        supervisor.relayed(seen.append, lines, answers)
    os.close(mine)
    writer.join(timeout=10)
    assert seen == []
