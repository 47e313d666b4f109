import pytest

import kernels  # noqa: F401  - first, so TRITON_INTERPRET is set before any test imports triton
from kernels import runtime


def pytest_collection_modifyitems(config, items):
    """Tests of the other mode are deselected, and the summary says how many: without a GPU those
    marked `gpu`; on a GPU those marked `cpu` (the CPU path: the interpreter, the "needs a GPU"
    errors, the committed GPU runs standing in). A test that cannot run here is neither a pass nor
    a silent skip."""
    other = "cpu" if runtime.ON_GPU else "gpu"
    left_out = [item for item in items if item.get_closest_marker(other)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker(other)]
        config._mode_deselected = len(left_out)


def pytest_sessionfinish(session):
    """An xdist worker hands its count to the controller, which writes the summary."""
    if hasattr(session.config, "workeroutput"):
        count = getattr(session.config, "_mode_deselected", 0)
        session.config.workeroutput["mode_deselected"] = count


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded
def pytest_testnodedown(node, error):
    """On the xdist controller: every worker collects every test, so any one's count is the
    run's."""
    count = getattr(node, "workeroutput", {}).get("mode_deselected", 0)
    node.config._mode_deselected = max(count, getattr(node.config, "_mode_deselected", 0))


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_mode_deselected", 0)
    if count and runtime.ON_GPU:
        terminalreporter.write_line(f"{count} CPU-path tests deselected: this is a GPU machine "
                                    f"(they run without one, or with KERNELS_MODE=cpu)")
    elif count:
        terminalreporter.write_line(f"{count} GPU tests deselected: no CUDA GPU here "
                                    f"(they run on a GPU machine: KERNELS_MODE=gpu)")

