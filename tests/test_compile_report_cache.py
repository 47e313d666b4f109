"""kernels/compile_report.py keeps what an offline compile reported, keyed by everything it depends
on: a second call with the same script, arguments, target, Triton and kernel sources does not
compile again; a change to any of them does, and so does KERNELS_COMPILE_CACHE=0. A failed compile
is never kept."""

import json

import pytest

from kernels import compile_report

# Stands in for a compile: appends a line to a log (how many times it ran) and prints a report.
SCRIPT = """
import json, sys
with open(sys.argv[1], "a") as log:
    log.write("ran\\n")
if sys.argv[2] == "fail":
    sys.exit("no such kernel")
print("ptxas info    : Used 40 registers, 8 bytes spill stores")
print(json.dumps({"variant": sys.argv[2]}))
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_report, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.delenv("KERNELS_COMPILE_CACHE", raising=False)
    return tmp_path / "cache"


def test_a_second_identical_compile_is_read_back(tmp_path, cache):
    log = tmp_path / "runs.log"
    first = compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_90")
    assert first == [{"variant": "a", "registers": 40, "spill_bytes": 8}]
    assert compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_90") == first
    assert log.read_text().count("ran") == 1
    assert [json.loads(p.read_text()) for p in cache.iterdir()] == [first]


def test_another_target_argument_or_source_compiles_again(tmp_path, cache, monkeypatch):
    log = tmp_path / "runs.log"
    compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_90")
    compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_80")
    compile_report.run_compile_script(SCRIPT, [str(log), "b"], "failed", "sm_90")
    assert log.read_text().count("ran") == 3
    monkeypatch.setattr(compile_report, "_course_sources", lambda: b"a kernel edited")
    compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_90")
    assert log.read_text().count("ran") == 4
    monkeypatch.setenv("KERNELS_COMPILE_CACHE", "0")
    compile_report.run_compile_script(SCRIPT, [str(log), "a"], "failed", "sm_90")
    assert log.read_text().count("ran") == 5


def test_a_failed_compile_is_not_kept(tmp_path, cache):
    log = tmp_path / "runs.log"
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed:\n.*no such kernel"):
            compile_report.run_compile_script(SCRIPT, [str(log), "fail"], "failed", "sm_90")
    assert log.read_text().count("ran") == 2
    assert not cache.exists() or not any(cache.iterdir())
