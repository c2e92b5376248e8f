"""The live dashboard in a real browser (Debian's headless chromium through
selenium): it shows the running job's graph, a checkpoint history that grows while
the job runs, the latest checkpoint's subtasks, and its exceptions.

Skipped only where chromium is missing and ``SPILLOVER_REQUIRE_BROWSER`` is unset;
CI sets it (``.ci/run`` installs the browser), so there it fails rather than skips.
``SPILLOVER_DASHBOARD_SCREENSHOT=PATH`` saves what the browser shows (docs/img)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spillover.rest import JobServer
from support import rest_jobs

served = rest_jobs.served  # the fixture: the backpressured job, served

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")

if not (CHROMIUM and DRIVER) and not os.environ.get("SPILLOVER_REQUIRE_BROWSER"):
    pytest.skip(
        "chromium and chromium-driver are not installed (CI installs them)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

# What the page shows, read in one script: the page redraws every second
# (replaceChildren), so elements found in one call may be gone by the next.
_READ = """
const text = id => (document.getElementById(id) || {}).textContent || "";
const newest = chart => Math.max(-1, ...[...document.querySelectorAll(`#${chart} .point title`)]
    .map(t => parseInt(t.textContent.split(" ")[1], 10)));
return {
  state: text("state"),
  vertices: [...document.querySelectorAll("#graph .vertex")].map(v => v.getAttribute("data-id")),
  rates: [...document.querySelectorAll("#graph .rate")].map(r => r.textContent),
  newest: Object.fromEntries(["chart-duration", "chart-persisted", "chart-start-delay",
      "chart-alignment"].map(c => [c, newest(c)])),
  subtasks: [...document.querySelectorAll("#subtasks tbody tr")]
      .map(r => r.querySelector("td").textContent),
  restarts: text("restarts"),
  exceptions: text("exceptions"),
};
"""


def _until(
    what: str, browser: Any, check: Callable[[dict[str, Any]], Any], timeout: float = 60.0
) -> dict[str, Any]:
    """The page's values (``_READ``) once ``check`` holds for them."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            page: dict[str, Any] = browser.execute_script(_READ)
        except StaleElementReferenceException:  # a redraw in between: read again
            page = {}
        if page and check(page):
            return page
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard never showed {what}; last read {page}")
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


def test_the_dashboard_shows_the_running_job(browser: Any, served: JobServer) -> None:
    browser.get(served.url + "/")
    _until("the job running", browser, lambda p: p["state"] == "RUNNING")
    page = _until("the job graph", browser, lambda p: p["vertices"])
    assert page["vertices"] == ["source", "sink"]
    _until("records/s on the source", browser, lambda p: p["rates"] and "out/s" in p["rates"][0])
    first = _until("checkpoints", browser, lambda p: p["newest"]["chart-duration"] >= 0)
    seen = first["newest"]["chart-duration"]
    # It updates while the job runs: newer checkpoints appear without a reload (the
    # chart keeps the last 100, so their number stops growing; their ids do not).
    page = _until("new checkpoints", browser, lambda p: p["newest"]["chart-duration"] > seen)
    for chart in ("chart-persisted", "chart-start-delay", "chart-alignment"):
        assert page["newest"][chart] >= 0, chart
    page = _until("the latest checkpoint's subtasks", browser, lambda p: p["subtasks"])
    assert sorted(page["subtasks"]) == ["sink#0", "sink#1", "source#0", "source#1"]
    assert "restarts: 0" in page["restarts"]
    assert "no exceptions" in page["exceptions"]
    shot = os.environ.get("SPILLOVER_DASHBOARD_SCREENSHOT")
    if shot:
        browser.save_screenshot(shot)

    served.job.executor.cancel()
    _until("the job cancelled", browser, lambda p: p["state"] == "CANCELED")
