"""Files a job writes in its storage are data, never paths to follow (service/core/safe_files.py): links planted where
its logs, artifacts and checkpoints lie, as a job's code could plant them, on the real API (real Redis, no Ray).
A link or a special file is refused with one line; none of the service's secrets is served."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.service.conftest import Api, tiny


def planted(api: Api) -> tuple[str, Path, str]:
    """A queued job, its storage directory, and the admin token a job would like to read."""
    with api.client() as c:
        job = c.post("/v1/experiments", json={"spec": tiny()}).json()["id"]
    home = api.stack.home
    return job, home / "storage" / job, (home / "admin.token").read_text().strip()


def test_log_links_and_special_files_are_refused_and_a_ranks_alias_is_read(api_only: Api) -> None:
    job, run, token = planted(api_only)
    logs = run / "logs" / "attempt-1"
    logs.mkdir(parents=True)
    (logs / "driver.log").symlink_to(api_only.stack.home / "admin.token")  # the review's: printed the token
    (logs / "rank-1.log").symlink_to("/dev/zero")  # read without a bound before
    os.mkfifo(logs / "rank-2.log")  # would block a reader
    with api_only.client() as c:
        for rank in ("0", "driver", "1", "2"):
            r = c.get(f"/v1/experiments/{job}/logs", params={"rank": rank})
            assert r.status_code == 404 and token not in r.text, (rank, r.text)
            assert "in storage" in r.json()["errors"][0]["message"] and "refused" in r.text, r.text
        (logs / "driver.log").unlink()
        (logs / "driver.log").write_text("trained\n")
        (logs / "rank-0.log").symlink_to("driver.log")  # a 1-worker job's alias (workers.job.logs.also_as)
        assert c.get(f"/v1/experiments/{job}/logs", params={"rank": "0"}).text == "trained\n"
        (logs / "rank-3.log").symlink_to("../../../../admin.token")  # not a sibling's name: refused
        assert c.get(f"/v1/experiments/{job}/logs", params={"rank": "3"}).status_code == 404
        whole = run / "logs"  # logs/ itself a link to the home: nothing under it is read
        os.rename(whole, run / "logs-real")
        (api_only.stack.home / "attempt-1").mkdir()
        (api_only.stack.home / "attempt-1" / "driver.log").symlink_to(api_only.stack.home / "admin.token")
        whole.symlink_to(api_only.stack.home)
        r = c.get(f"/v1/experiments/{job}/logs", params={"rank": "driver"})
        assert token not in r.text and r.status_code == 404, r.text


@pytest.mark.parametrize("where", ["folder", "file", "checkpoint"])
def test_artifact_links_are_left_out_and_refused(api_only: Api, where: str) -> None:
    job, run, token = planted(api_only)
    home = api_only.stack.home
    if where == "folder":  # the review's: artifacts/ -> TLAB_HOME listed the home and served its secrets
        run.mkdir(parents=True)
        (run / "artifacts").symlink_to(home)
        name = "admin.token"
    elif where == "file":
        (run / "artifacts" / "plots").mkdir(parents=True)
        (run / "artifacts" / "plots" / "a.txt").write_text("mine")
        (run / "artifacts" / "admin.token").symlink_to(home / "admin.token")
        (run / "artifacts" / "home").symlink_to(home)
        name = "admin.token"
    else:  # a checkpoint folder that is a link: checkpoint.pt's stand-in is never read through it
        run.mkdir(parents=True)
        (home / "ckpt").mkdir()
        (home / "ckpt" / "checkpoint.pt").symlink_to(home / "admin.token")
        (run / "checkpoint_2026-01-02_00-00-00.000001").symlink_to(home / "ckpt")
        name = "checkpoint.pt"
    with api_only.client() as c:
        listed = c.get(f"/v1/experiments/{job}/artifacts").json()["items"]
        assert [a["name"] for a in listed] == (["plots/a.txt"] if where == "file" else []), listed
        for asked in (name, "home/admin.token"):
            r = c.get(f"/v1/experiments/{job}/artifacts/{asked}")
            assert r.status_code == 404 and token not in r.text, r.text
        if where == "file":
            assert c.get(f"/v1/experiments/{job}/artifacts/plots/a.txt").content == b"mine"
