"""The attention benchmarks (kernels/flash_attention/benchmark*.py): one module per JSON under
data/results/<gpu>/, each stating the targets of its committed runs as those runs recorded them."""

import importlib
import json

import pytest

from kernels.bench import RESULTS_DIR
from kernels.flash_attention import benchmark

OWN_FILES = ["host", "gluon", "gluon_backward", "flash_attn_cute"]


@pytest.mark.parametrize("path", sorted(RESULTS_DIR.glob("*/03_flash_attention.json")),
                         ids=lambda p: p.parent.name)  # fmt: skip
def test_the_triton_benchmark_restates_its_committed_checks(path):
    saved = json.loads(path.read_text())
    assert saved["checks"] and benchmark.performance_targets(saved) == saved["checks"]


@pytest.mark.parametrize("name", OWN_FILES)
def test_each_benchmark_with_a_file_of_its_own_restates_its_committed_checks(name):
    """benchmark_<name>.py writes 03_flash_attention_<name>.json ({"fingerprint", name, "seconds",
    "checks"}); its `targets` of the committed measurement give the committed checks."""
    module = importlib.import_module(f"kernels.flash_attention.benchmark_{name}")
    paths = sorted(RESULTS_DIR.glob(f"*/03_flash_attention_{name}.json"))
    assert paths, f"no committed run of benchmark_{name}"
    for path in paths:
        saved = json.loads(path.read_text())
        assert set(saved) == {"fingerprint", name, "seconds", "checks"}
        assert module.targets(saved[name]) == saved["checks"]
