"""The student's path in a real browser: JupyterLab opens the course, the lab and its solution run from the
Run menu, the check cells say what they should, the explorers' widgets respond, and figures appear.

Screenshots go to build/test-artifacts/browser/ (`make test` lists them at the end).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kernels import runtime
from tests.browser.jupyterlab import (
    cell,
    open_notebook,
    output_text,
    run_all,
    run_up_to,
    screenshot,
)

LAB = "labs/01_elementwise_add_lab.ipynb"
SOLUTION = "solutions/01_elementwise_add_lab.ipynb"


def code_cells(state) -> list[tuple[int, dict]]:
    return [(i, c) for i, c in enumerate(state["cells"]) if c["type"] == "code"]


def assert_ran_in_order_without_errors(page, state) -> None:
    code = code_cells(state)
    failed = [(i, output_text(page, i)[-600:]) for i, c in code if c["error"]]
    assert not failed, f"cell {failed[0][0]} raised:\n{failed[0][1]}"
    counts = [c["count"] for _, c in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"cells did not run once each, in order: {counts}"
    )


def assert_setup_check_shows_this_environment(page, state) -> None:
    first = code_cells(state)[0][0]
    text = output_text(page, first)
    assert ("GPU mode" if runtime.ON_GPU else "CPU mode") in text, text
    for word in ("torch", "triton", "cupy", "TF32"):
        assert word in text, text
    # `make lab` and this server run this environment's Python as the kernel, with no set-up of its own
    assert str(Path(sys.prefix)) in text, (
        f"the kernel is not this environment's Python ({sys.prefix}):\n{text}"
    )


def check_cells(state) -> list[int]:
    return [i for i, c in code_cells(state) if "grading.check(" in c["source"]]


def test_untouched_lab_runs_and_its_checks_say_not_implemented(page, lab):
    state = open_notebook(page, lab, LAB, "lab")
    state = run_all(page)
    assert_ran_in_order_without_errors(page, state)
    assert_setup_check_shows_this_environment(page, state)
    checks = check_cells(state)
    assert len(checks) == 3, checks
    texts = {i: output_text(page, i) for i in checks}
    for i, text in texts.items():
        assert "Traceback" not in text and "Error" not in text, text
        assert (
            "NOT IMPLEMENTED" in text and "not implemented yet" in text or "NEEDS A GPU" in text
        ), text
    assert (
        sum("not implemented yet" in t for t in texts.values()) >= 2
    )  # the Triton ones, in any mode
    print(f"screenshot: {screenshot(page, 'lab-01-untouched', cell(page, checks[1]))}")


def test_solution_runs_and_its_checks_pass(page, lab):
    state = open_notebook(page, lab, SOLUTION, "solution")
    state = run_all(page)
    assert_ran_in_order_without_errors(page, state)
    assert_setup_check_shows_this_environment(page, state)
    checks = check_cells(state)
    assert len(checks) == 3, checks
    texts = [output_text(page, i) for i in checks]
    for text in texts:
        assert "FAIL" not in text and "Traceback" not in text, text
    cupy, add, residual = texts
    assert "PASS  add: 3/3 points" in add and add.count("PASS") > 10, add
    assert "PASS  residual_add: 4/4 points" in residual, residual
    assert (
        "PASS  add_vectorized: 3/3 points" if runtime.cupy_status()[0] else "NEEDS A GPU"
    ) in cupy, cupy
    print(f"screenshot: {screenshot(page, 'solution-01-checks', cell(page, checks[1]))}")


def explorer_cell(state, marker: str) -> int:
    found = [i for i, c in code_cells(state) if c["source"].startswith(marker)]
    assert len(found) == 1, f"no single cell starting with {marker!r}"
    return found[0]


def figure_sources(locator) -> list[str]:
    """The `src` of every rendered (decoded, non-empty) image under `locator`."""
    return locator.evaluate("""node => Array.from(node.querySelectorAll('img'))
        .filter(img => img.complete && img.naturalWidth > 0).map(img => img.src)""")


def wait_for_change(page, locator, old_text: str, old_figures: list[str] | None) -> None:
    """Wait until the widget output shows a different readout and a rendered figure (a different one,
    unless `old_figures` is None: a change the picture cannot show)."""
    try:
        page.wait_for_function(
            """([node, oldText, oldFigures]) => {
              const imgs = Array.from(node.querySelectorAll('img')).filter(i => i.complete && i.naturalWidth > 0);
              const text = node.querySelector('.widget-html').innerText;
              return text !== oldText && imgs.length > 0 && imgs.every(i => !(oldFigures || []).includes(i.src));
            }""",
            arg=[locator.element_handle(), old_text, old_figures],
            timeout=60_000,
        )
    except Exception as exc:
        raise AssertionError(
            f"the widget did not answer: {exc}\nit shows:\n{locator.inner_text()[-3000:]}"
        ) from None


def test_roofline_explorer_renders_responds_and_draws(page, lab):
    state = open_notebook(page, lab, "notebooks/00_benchmarking.ipynb", "roofline")
    state = run_all(page)
    assert_ran_in_order_without_errors(page, state)
    assert_setup_check_shows_this_environment(page, state)
    figures = [
        i
        for i, _ in code_cells(state)
        if figure_sources(cell(page, i).locator(".jp-Cell-outputArea"))
    ]
    assert len(figures) >= 3, (
        f"matplotlib figures expected in several cells, found them in {figures}"
    )

    explorer = cell(page, explorer_cell(state, "# Roofline explorer"))
    widget = explorer.locator(".jp-Cell-outputArea .widget-vbox").first
    widget.scroll_into_view_if_needed()
    op = widget.locator(".widget-dropdown select")
    readout = widget.locator(".widget-html")
    assert "linear layer" in readout.inner_text() and "flop/byte" in readout.inner_text()
    before_text, before_figures = readout.inner_text(), figure_sources(widget)
    assert before_figures, "the explorer drew no figure"
    op.select_option(label="fp16 add, c = a + b")
    wait_for_change(page, widget, before_text, before_figures)
    after = readout.inner_text()
    assert "fp16 add" in after and "memory-bound" in after, after
    # the size slider answers the keyboard, as a student's arrow keys
    before_text, before_figures = after, figure_sources(widget)
    widget.locator(".widget-slider .noUi-handle, .widget-slider [role=slider]").first.press(
        "ArrowRight"
    )
    wait_for_change(page, widget, before_text, before_figures)
    assert readout.inner_text() != after
    print(f"screenshot: {screenshot(page, 'notebook-00-roofline-explorer', widget)}")
    print(f"screenshot: {screenshot(page, 'notebook-00-roofline-explorer-widget', element=widget)}")


def test_block_size_explorer_responds(page, lab):
    state = open_notebook(page, lab, "notebooks/01_elementwise_add.ipynb", "blocks")
    index = explorer_cell(state, "# Block size / vector width explorer")
    state = run_up_to(
        page, index
    )  # the cells after it (part 7's 32-layer simulation) are not needed here
    state = {**state, "cells": state["cells"][: index + 1]}
    assert_ran_in_order_without_errors(page, state)
    explorer = cell(page, index)
    widget = explorer.locator(".jp-Cell-outputArea .widget-vbox").first
    widget.scroll_into_view_if_needed()
    readout = widget.locator(".widget-html")
    assert (
        "16 elements per operand" in readout.inner_text()
        and "2 load(s) of 16 bytes" in readout.inner_text()
    )
    before_text, before_figures = readout.inner_text(), figure_sources(widget)
    assert before_figures, "the explorer drew no figure"
    widget.locator(
        ".widget-toggle-buttons button", has_text="1024"
    ).click()  # BLOCK 1024, 8 warps, fp16
    wait_for_change(page, widget, before_text, before_figures)
    assert (
        "4 float16 elements per operand" in readout.inner_text()
        and "1 load(s) of 8 bytes" in readout.inner_text()
    )
    before_text = readout.inner_text()
    widget.locator(
        ".widget-checkbox input"
    ).check()  # odd n: one load per element (the plots barely move)
    wait_for_change(page, widget, before_text, None)
    assert "4 load(s) of 2 bytes" in readout.inner_text(), readout.inner_text()
    print(f"screenshot: {screenshot(page, 'notebook-01-block-size-explorer', widget)}")
    print(
        f"screenshot: {screenshot(page, 'notebook-01-block-size-explorer-widget', element=widget)}"
    )
