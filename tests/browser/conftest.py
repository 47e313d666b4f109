"""Fixtures of the browser test: one JupyterLab server and one chromium per test module, a page per test,
a screenshot of the page when a test fails (its path is in the failure's output)."""

from __future__ import annotations

import tempfile

import pytest

from tests.browser.jupyterlab import (
    CHROMIUM,
    CHROMIUM_FLAGS,
    JupyterLab,
    chromium_problem,
    copy_notebooks,
    screenshot,
)

NOTEBOOKS = [
    "labs/01_elementwise_add_lab.ipynb",
    "solutions/01_elementwise_add_lab.ipynb",
    "notebooks/00_benchmarking.ipynb",
    "notebooks/01_elementwise_add.ipynb",
]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.browser)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.call_failed = report.failed
    return report


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    problem = chromium_problem()
    if problem:  # a browser test that cannot run fails: it is never skipped silently
        pytest.fail(problem)
    scratch = tmp_path_factory.mktemp("jupyterlab")
    copy_notebooks(NOTEBOOKS, scratch / "course")
    with JupyterLab(scratch / "course", scratch) as server:
        yield server


@pytest.fixture(scope="module")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1400, "height": 1000},
        )
        context.set_default_timeout(60_000)
        yield context
        context.close()


@pytest.fixture
def page(browser, lab, request):
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    yield page
    if getattr(request.node, "call_failed", False):
        path = screenshot(page, f"FAILED-{request.node.name}")
        print(f"screenshot of the failing page: {path}\nJupyterLab log (tail):\n{lab.log_tail()}")
    page.close()
