"""The status page in a real headless Chromium (Debian's, driven by Selenium), on a real store.

The page polls ``/status.json``; the test advances a running job's round in the
scheduler's store the way the orchestrator does (``update`` + ``record_metrics``)
and waits, with a deadline, for the new round to appear on screen.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from hypha.jobfile import parse_job_toml
from hypha.scheduler.config import SchedulerSection
from hypha.scheduler.lifecycle import JobState
from hypha.scheduler.records import MetricRecord
from hypha.scheduler.servicer import SchedulerServicer
from hypha.scheduler.status_page import StatusPage, curves
from hypha.scheduler.store import JobStore
from hypha.v1 import common_pb2, scheduler_pb2
from tests.scheduler.test_servicer import DILOCO_TOML, FakeOrchestrator

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Chromium; where it is missing the test skips, except in CI (scripts/system-deps.sh)."""
    if not (shutil.which(CHROMIUM) and os.access(CHROMEDRIVER, os.X_OK)):
        if os.environ.get("CI") == "true":
            pytest.fail("chromium/chromedriver missing: .ci/run installs them with scripts/system-deps.sh")
        pytest.skip("chromium and chromium-driver are not installed (scripts/system-deps.sh)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
async def page(tmp_path: Path) -> AsyncIterator[StatusPage]:
    store = await JobStore.open(tmp_path / "scheduler.db")
    page = StatusPage(SchedulerServicer(store, FakeOrchestrator(tmp_path / "result", store)), "127.0.0.1:0")
    await page.start()
    try:
        yield page
    finally:
        await page.stop()
        await store.close()


async def on_screen(driver: Any, css: str, expected: str, timeout_s: float = 15.0) -> str:
    """Poll the element's text (the page refreshes every second) until it shows ``expected``."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def text() -> str:
        try:
            return str(driver.find_element(By.CSS_SELECTOR, css).text)
        except (NoSuchElementException, StaleElementReferenceException):
            return ""

    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        seen = await asyncio.to_thread(text)
        if seen == expected:
            return seen
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{css} shows {seen!r}, not {expected!r}, after {timeout_s:g}s")
        await asyncio.sleep(0.2)  # a poll interval with a deadline, not a wait for an outcome


async def test_a_running_jobs_round_advances_on_the_page(
    browser: Any, page: StatusPage, tmp_path: Path
) -> None:
    store = page.api.store
    peer_id = "k7w2c9q4x8v1m3n5b6z0a2s4d6f8g0h1"  # 32 characters, as a real peer id
    page.api.orchestrator.views = [  # type: ignore[attr-defined]
        scheduler_pb2.WorkerView(
            peer=common_pb2.PeerInfo(peer_id=peer_id, role=common_pb2.ROLE_WORKER, name="trainer-a"),
            capacity=common_pb2.Resources(cpu=4, memory_gb=8),
            healthy=True,
            samples_per_second=12.5,
        )
    ]
    job = await store.create(parse_job_toml(DILOCO_TOML), submitted_by="client")
    await store.transition(job.job_id, JobState.ALLOCATING)
    await store.transition(job.job_id, JobState.RUNNING, workers=[peer_id])
    await store.update(job.job_id, round=1, loss=2.5)
    await store.record_metrics(job.job_id, 0, {"loss": 2.5, "accuracy": 0.1}, peer_id)

    await asyncio.to_thread(browser.get, page.url)
    row = f'tr[data-job-id="{job.job_id}"]'
    await on_screen(browser, f"{row} .round", "1 / 4")
    await on_screen(browser, f"{row} .state", "running")

    await store.update(job.job_id, round=2, loss=1.25)
    figures = {"loss": 1.25, "accuracy": 0.6, "tensor_bytes_pulled": 15147706.0, "missing": 0.0}
    await store.record_metrics(job.job_id, 1, figures, peer_id)
    await store.record_metrics(
        job.job_id, 1, {"samples_per_second": 1234.5678, "sync_idle_seconds": 0.25}, peer_id
    )

    await on_screen(browser, f"{row} .round", "2 / 4")
    await on_screen(browser, f"{row} .loss", "1.2500")
    # Units and readable numbers, the job's accuracy in its row, workers by name.
    await on_screen(browser, f'{row} [data-metric="accuracy"] text', "accuracy 60 %")
    await on_screen(browser, f"{row} .accuracy", "60 %")
    await on_screen(browser, f'{row} [data-metric="tensor_bytes_pulled"] text', "pulled 15.1 MB")
    await on_screen(browser, f'{row} [data-metric="samples_per_second"] text', "throughput 1,235 samples/s")
    await on_screen(browser, f'{row} [data-metric="sync_idle_seconds"] text', "sync idle 0.25 s")
    await on_screen(browser, f"{row} .workers", "trainer-a")
    await on_screen(browser, f'#workers tr[data-worker-id="{peer_id}"] .name', "trainer-a")
    await on_screen(browser, f'#workers tr[data-worker-id="{peer_id}"] .throughput', "12.5")
    assert not await asyncio.to_thread(
        browser.find_elements, "css selector", f'{row} [data-metric="missing"]'
    )
    assert peer_id not in await asyncio.to_thread(lambda: browser.find_element("tag name", "body").text)
    shot = tmp_path / "status-page.png"
    assert await asyncio.to_thread(browser.save_screenshot, str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_the_document_holds_no_job_spec(page: StatusPage) -> None:
    job = await page.api.store.create(parse_job_toml(DILOCO_TOML), submitted_by="client")

    document = await page.document()

    (summary,) = document["jobs"]
    assert summary["job_id"] == job.job_id and "spec" not in summary
    assert "hf_secret" not in repr(document)  # the model token in the spec never reaches the page


def test_curves_average_each_round_over_its_workers() -> None:
    points = [
        MetricRecord("j", 1, "w1", "loss", 2.0, 0.0),
        MetricRecord("j", 0, "w1", "loss", 4.0, 0.0),
        MetricRecord("j", 1, "w2", "loss", 1.0, 0.0),
        MetricRecord("j", 1, "w2", "accuracy", float("nan"), 0.0),
    ]

    assert curves(points) == {"loss": [[0.0, 4.0], [1.0, 1.5]]}


def test_the_page_is_loopback_only_unless_made_public() -> None:
    with pytest.raises(ValidationError, match="not a loopback address"):
        SchedulerSection(status_page_listen="0.0.0.0:8080")

    assert SchedulerSection(status_page_listen="0.0.0.0:8080", status_page_public=True).status_page_public
    assert SchedulerSection(status_page_listen="[::1]:0").status_page_listen == "[::1]:0"
