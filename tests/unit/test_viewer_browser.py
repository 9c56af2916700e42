"""`skylift view`'s report in a real headless browser (Debian's chromium, driven by playwright;
.ci/run installs chromium): it loads with no console error, a sample's tokens are coloured by the
trainer-vs-engine logprob gap, the filters narrow the list, the step-time chart is drawn. On the
demo's task (single turn) and on a multi-turn calculator-tool run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from viewer_runs import write_run

from skylift.viewer import build_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The report of each task's run, built before the browser starts (playwright's sync API runs
    an event loop on this thread; the run's generator needs one of its own)."""
    return {
        task: build_report(write_run(tmp_path_factory.mktemp(task), task)) for task in ("addition", "tools")
    }


@pytest.fixture(scope="module")
def browser(reports: dict[str, Path]) -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


def open_report(browser: Any, index: Path) -> tuple[Any, list[str]]:
    """A page showing the report at `index`, and the list its console errors go to."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(index.as_uri())
    page.wait_for_selector(".sample")
    return page, errors


def _shown(page: Any) -> int:
    return page.locator(".sample").count()


def _background(page: Any, selector: str) -> str:
    return page.eval_on_selector(selector, "node => getComputedStyle(node).backgroundColor")


@pytest.mark.parametrize("task", ["addition", "tools"])
def test_the_report_in_a_browser(reports: dict[str, Path], browser: Any, task: str) -> None:
    page, errors = open_report(browser, reports[task])
    try:
        total = _shown(page)
        assert total == (8 if task == "addition" else 12)  # the last step's samples
        assert page.inner_text("#f-count") == f"{total} of {total} samples"
        # tokens coloured by the gap: the fixture's 0.2 and -0.15 gaps saturate (scale 0.05), the
        # 2e-3 noise stays near white
        coloured = page.eval_on_selector_all(
            ".tok[data-diff]",
            "nodes => nodes.map(n => [Number(n.dataset.diff), getComputedStyle(n).backgroundColor])",
        )
        assert coloured
        up = {c for d, c in coloured if d > 0.1}
        down = {c for d, c in coloured if d < -0.1}
        near = {c for d, c in coloured if abs(d) < 0.003}
        assert up == {"rgb(243, 115, 115)"} and down == {"rgb(108, 161, 248)"}  # saturated red, blue
        assert near and all(int(c.split(",")[1]) > 235 for c in near)  # green channel: near white
        # the filters narrow the list
        page.fill("#f-reward-min", "0.5")
        narrowed = _shown(page)
        assert 0 < narrowed < total and page.inner_text("#f-count") == f"{narrowed} of {total} samples"
        rewards = page.eval_on_selector_all(".sample", "nodes => nodes.map(n => Number(n.dataset.reward))")
        assert all(r >= 0.5 for r in rewards)
        page.fill("#f-reward-min", "")
        assert _shown(page) == total
        page.fill("#f-diff", "0.5")  # no token is that far apart
        assert _shown(page) == 0 and page.locator("text=no sample passes the filters").count() == 1
        page.fill("#f-diff", "")
        if task == "tools":
            page.select_option("#f-finish", "length")
            assert _shown(page) == 3  # one cut-off sample per prompt
            page.select_option("#f-finish", "")
            assert page.locator(".msg.tool").count() == 6 and page.locator(".msg.tool-call").count() == 6
        page.click("button[data-tab=eval]")
        page.wait_for_selector(".sample")
        page.select_option("#f-correct", "wrong")
        wrong = _shown(page)
        assert 0 < wrong < total and page.locator(".sample .badge.good:text-is('correct')").count() == 0
        page.click("button[data-tab=times]")
        bars = page.locator("#times svg rect").count()
        assert bars == 2 * 6  # two steps, six non-zero parts each (no evaluation time)
        assert page.locator("#times").is_visible() and not page.locator("#filters").is_visible()
        page.click("button[data-tab=train]")
        page.wait_for_selector(".sample")
        assert errors == []
    finally:
        page.close()
