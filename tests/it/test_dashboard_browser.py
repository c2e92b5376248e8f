"""The live dashboard in a real browser (Debian's headless chromium through
selenium): it shows the running job's graph, a checkpoint history that grows while
the job runs, the latest checkpoint's subtasks, and its exceptions.

Skipped only where chromium is missing and ``SPILLOVER_REQUIRE_BROWSER`` is unset;
CI sets it (``.ci/run`` installs the browser), so there it fails rather than skips.
``SPILLOVER_DASHBOARD_SCREENSHOT=PATH`` saves what the browser shows (docs/img)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spillover.deploy.local import LocalExecutor
from spillover.rest import JobServer, serve
from support.rest_jobs import backpressured, config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

if not (CHROMIUM and DRIVER) and not os.environ.get("SPILLOVER_REQUIRE_BROWSER"):
    pytest.skip(
        "chromium and chromium-driver are not installed (CI installs them)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard never showed {what}")
        time.sleep(0.1)


@pytest.fixture
def browser() -> Iterator[Any]:
    assert CHROMIUM and DRIVER, "SPILLOVER_REQUIRE_BROWSER is set: install chromium"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JobServer]:
    monkeypatch.setenv("SPILLOVER_HOME", str(tmp_path / "home"))
    server = serve(LocalExecutor(backpressured(), config(tmp_path)))
    runner = threading.Thread(target=lambda: server.job.run(timeout=180), daemon=True)
    runner.start()
    yield server
    if not server.job.ended:
        server.job.executor.cancel()
    runner.join(timeout=60)
    server.close()


def test_the_dashboard_shows_the_running_job(browser: Any, served: JobServer) -> None:
    browser.get(served.url + "/")
    find = browser.find_elements
    _until("the job running", lambda: browser.find_element(By.ID, "state").text == "RUNNING")
    vertices = _until("the job graph", lambda: find(By.CSS_SELECTOR, "#graph .vertex"))
    assert [v.get_attribute("data-id") for v in vertices] == ["source", "sink"]
    _until(
        "records/s on the source",
        lambda: "out/s" in browser.find_element(By.CSS_SELECTOR, "#graph .rate").text,
    )
    points = len(_until("checkpoints", lambda: find(By.CSS_SELECTOR, "#chart-duration .point")))
    # It updates while the job runs: more checkpoints appear without a reload.
    _until("new checkpoints", lambda: len(find(By.CSS_SELECTOR, "#chart-duration .point")) > points)
    for chart in ("chart-persisted", "chart-start-delay", "chart-alignment"):
        assert find(By.CSS_SELECTOR, f"#{chart} .point"), chart
    rows = _until(
        "the latest checkpoint's subtasks", lambda: find(By.CSS_SELECTOR, "#subtasks tbody tr")
    )
    names = sorted(r.find_elements(By.TAG_NAME, "td")[0].text for r in rows)
    assert names == ["sink#0", "sink#1", "source#0", "source#1"]
    assert "restarts: 0" in browser.find_element(By.ID, "restarts").text
    assert "no exceptions" in browser.find_element(By.ID, "exceptions").text
    shot = os.environ.get("SPILLOVER_DASHBOARD_SCREENSHOT")
    if shot:
        browser.save_screenshot(shot)

    served.job.executor.cancel()
    _until("the job cancelled", lambda: browser.find_element(By.ID, "state").text == "CANCELED")
