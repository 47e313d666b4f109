import pytest

import kernels  # noqa: F401  - first, so TRITON_INTERPRET is set before any test imports triton
from kernels import runtime


def pytest_collection_modifyitems(config, items):
    """Without a GPU, tests marked `gpu` are deselected, and the summary says how many: a test that
    cannot run here is neither a pass nor a silent skip."""
    if runtime.ON_GPU:
        return
    gpu_only = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_only:
        config.hook.pytest_deselected(items=gpu_only)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config._gpu_deselected = len(gpu_only)


def pytest_sessionfinish(session):
    """An xdist worker hands its count to the controller, which writes the summary."""
    if hasattr(session.config, "workeroutput"):
        count = getattr(session.config, "_gpu_deselected", 0)
        session.config.workeroutput["gpu_deselected"] = count


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded
def pytest_testnodedown(node, error):
    """On the xdist controller: every worker collects every test, so any one's count is the
    run's."""
    count = getattr(node, "workeroutput", {}).get("gpu_deselected", 0)
    node.config._gpu_deselected = max(count, getattr(node.config, "_gpu_deselected", 0))


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_gpu_deselected", 0)
    if count:
        terminalreporter.write_line(f"{count} GPU tests deselected: no CUDA GPU here "
                                    f"(they run on a GPU machine: KERNELS_MODE=gpu)")

