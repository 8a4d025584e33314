"""Browser fixtures: Debian's chromium (``make browser`` installs it) driven by Playwright, on the service fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import Api, api_env, api_only, stack, stack_env  # noqa: F401 - the service fixtures, reused (ray_head is tests/conftest.py's)

CHROMIUM = os.environ.get("TLAB_CHROMIUM", "/usr/bin/chromium")
# a headless, offline chromium: no GPU, no QUIC, no first-run, no background fetches or component updates
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """One chromium for the session (Playwright's own browsers are never downloaded)."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: run `make browser` (apt-get install chromium) or set TLAB_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


class Tab:
    """A fresh browser context and page, with the page's script errors collected."""

    def __init__(self, browser: Any, url: str, shots: Path) -> None:
        self.context = browser.new_context(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
        self.context.set_default_timeout(30_000)
        self.page = self.context.new_page()
        self.url, self.shots = url, shots
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))

    def goto(self, route: str = "") -> None:
        self.page.goto(f"{self.url}/{route}")

    def sign_in(self, token: str) -> None:
        self.goto("#/signin")
        self.page.fill("#token", token)
        self.page.click("#signin-form button[type=submit]")
        self.page.wait_for_function("() => location.hash === '#/jobs' && window.tlab.me !== null")

    def shot(self, name: str, selector: str | None = None) -> Path:
        path = self.shots / f"{name}.png"
        if selector:
            self.page.locator(selector).screenshot(path=str(path))
        else:
            self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture()
def shots(tmp_path: Path) -> Path:
    """Where screenshots go: ``$TLAB_SCREENSHOTS`` (to look at them) or the test's tmp dir."""
    path = Path(os.environ.get("TLAB_SCREENSHOTS") or tmp_path / "shots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture()
def tab_factory(browser: Any, shots: Path) -> Iterator[Any]:
    tabs: list[Tab] = []

    def make(url: str) -> Tab:
        tabs.append(Tab(browser, url, shots))
        return tabs[-1]

    yield make
    for t in tabs:
        t.context.close()
