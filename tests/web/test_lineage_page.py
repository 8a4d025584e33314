"""The job page links a forked job to its parent, and the parent to its children (headless chromium on the real
API; the parent is a cancelled job with checkpoint directories where its run keeps them: no Ray needed)."""

from __future__ import annotations

from typing import Any

from tests.service.api.test_lineage_api import ended_parent
from tests.service.conftest import Api


def test_the_job_page_links_parent_and_children(api_only: Api, tab_factory: Any) -> None:
    with api_only.client() as c:
        parent = ended_parent(api_only, c, [1, 2])
        child = c.post(f"/v1/experiments/{parent}/fork", json={"from_epoch": 1, "set": {"teleport.tau": 0.9}})
        assert child.status_code == 201, child.text
        child_id = child.json()["id"]
    tab = tab_factory(api_only.url)
    page = tab.page
    tab.goto()
    tab.sign_in(api_only.stack.admin_token)
    tab.goto(f"#/job/{child_id}")
    page.wait_for_selector(f"#job-facts a[href='#/job/{parent}']")
    assert "from its checkpoint after epoch 1" in page.inner_text("#job-facts")
    page.click(f"#job-facts a[href='#/job/{parent}']")
    page.wait_for_selector(f"#job-facts a[href='#/job/{child_id}']")
    tab.shot("job-lineage", "#job-facts")
    assert not tab.errors, tab.errors
