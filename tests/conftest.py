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


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_gpu_deselected", 0)
    if count:
        terminalreporter.write_line(f"{count} GPU tests deselected: no CUDA GPU here "
                                    f"(they run on a GPU machine: KERNELS_MODE=gpu)")

