"""The job page lists a finished job's artifacts and downloads one with the bearer token (a blob, since a link
cannot carry the header), in a real headless chromium on the real API."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.service.conftest import Api, tiny


def test_the_job_page_lists_and_downloads_artifacts(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:  # a queued job cancelled at once: it ended, with no Ray needed
        job = c.post("/v1/experiments", json={"spec": tiny(), "name": "with-files"}).json()["id"]
        assert c.post(f"/v1/experiments/{job}/cancel").json()["state"] == "cancelled"
    out = api_only.stack.home / "storage" / job / "artifacts"
    (out / "plots").mkdir(parents=True)
    (out / "summary.json").write_text('{"epochs": 3}\n')
    (out / "plots" / "a b.txt").write_bytes(b"\x00\x01 mine")
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.goto()
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{job}")
    page.wait_for_selector("#artifacts a[data-name='plots/a b.txt']")
    assert "summary.json" in page.inner_text("#artifacts")
    tab.shot("job-artifacts")
    with page.expect_download() as info:
        page.click("#artifacts a[data-name='plots/a b.txt']")
    download = info.value
    assert download.suggested_filename == "a b.txt"
    assert Path(download.path()).read_bytes() == b"\x00\x01 mine"
