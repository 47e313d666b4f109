"""kernels/compile_report.py keeps what an offline compile reported: a second call with the same
script, arguments, target and Triton, whose kernels/ modules are unchanged, does not compile again;
a change to any of them does, and so does KERNELS_COMPILE_CACHE=0. A failed compile is never
kept."""

import json

import pytest

from kernels import compile_report

# Stands in for a compile: appends a line to a log (how many times it ran), imports a module of
# kernels/ from its file (as a compile imports the kernel's module), and prints a report.
SCRIPT = """
import importlib.util, json, sys
with open(sys.argv[1], "a") as log:
    log.write("ran\\n")
if sys.argv[2] == "fail":
    sys.exit("no such kernel")
spec = importlib.util.spec_from_file_location("kernel_module", sys.argv[3])
sys.modules["kernel_module"] = importlib.util.module_from_spec(spec)
print("ptxas info    : Used 40 registers, 8 bytes spill stores")
print(json.dumps({"variant": sys.argv[2]}))
"""
MODULE = str(compile_report.KERNELS_DIR / "compile_report.py")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_report, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("KERNELS_COMPILE_CACHE", raising=False)
    return tmp_path / "cache"


def compile_(log, variant="a", arch="sm_90"):
    return compile_report.run_compile_script(SCRIPT, [str(log), variant, MODULE], "failed", arch)


def test_a_second_identical_compile_is_read_back(tmp_path, cache):
    log = tmp_path / "runs.log"
    first = compile_(log)
    assert first == [{"variant": "a", "registers": 40, "spill_bytes": 8}]
    assert compile_(log) == first
    assert log.read_text().count("ran") == 1
    (entry,) = [json.loads(p.read_text()) for p in cache.iterdir()]
    assert entry["made"] == first and list(entry["modules"]) == [MODULE]


def test_another_target_argument_or_module_compiles_again(tmp_path, cache, monkeypatch):
    log = tmp_path / "runs.log"
    compile_(log)
    compile_(log, arch="sm_80")
    compile_(log, variant="b")
    assert log.read_text().count("ran") == 3
    monkeypatch.setattr(compile_report, "_digest", lambda path: "the module, edited")
    compile_(log)
    assert log.read_text().count("ran") == 4
    monkeypatch.setenv("KERNELS_COMPILE_CACHE", "0")
    compile_(log)
    assert log.read_text().count("ran") == 5


def test_a_failed_compile_is_not_kept(tmp_path, cache):
    log = tmp_path / "runs.log"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed:\n.*no such kernel"):
            compile_(log, variant="fail")
    assert log.read_text().count("ran") == 2
    assert not cache.exists() or not any(cache.iterdir())
