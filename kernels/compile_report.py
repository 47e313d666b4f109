"""Run a script that compiles kernels for a GPU this machine may not have, and read what it says.

The script prints one JSON line per compiled variant, each after ptxas's report on that variant
(TRITON_DUMP_PTXAS_LOG=1). A process of its own, because a process that runs Triton's interpreter
(CPU mode) cannot compile. Used by the Gluon attention kernels (flash_attention/gluon_offline.py)
and the matrix multiply's Hopper kernels (matmul/offline.py).

What a compile reports depends only on the script, its arguments, the target, Triton (which brings
its ptxas) and the course files it read, so the parsed report is kept outside the clone
(~/.cache/gpu-kernels-course/compile-reports, or under KERNELS_CACHE_DIR), keyed by the first four
and kernels/'s data files (CUDA C, tables), with the digest of every kernels/ module the compile
imported: an entry whose modules changed since is compiled again. The tests and lectures that
read a report compile once per change to what they compile, not once per run.
KERNELS_COMPILE_CACHE=0 always compiles.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
CACHE_DIR = (
    Path(os.environ.get("KERNELS_CACHE_DIR", Path.home() / ".cache" / "gpu-kernels-course"))
    / "compile-reports"
)
# Appended to the script: the kernels/ modules the compile imported, as its last line.
_LIST_MODULES = f"""
import json as _json, sys as _sys
print(_json.dumps({{"kernels_modules": sorted({{
    m.__file__ for m in list(_sys.modules.values())
    if (getattr(m, "__file__", None) or "").startswith({str(KERNELS_DIR)!r})}})}}), flush=True)
"""


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


@functools.cache
def _course_data() -> bytes:
    """kernels/'s files other than modules and notes (CUDA C, tables), with their paths."""
    files = sorted(
        p
        for p in KERNELS_DIR.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc", ".md") and "__pycache__" not in p.parts
    )
    return b"".join(str(p.relative_to(KERNELS_DIR)).encode() + p.read_bytes() for p in files)


def _cache_key(script: str, args: list[str], arch: str) -> str:
    import triton  # the child's: the same interpreter and PYTHONPATH

    parts = [script, *args, arch, triton.__version__, triton.__file__, sys.version]
    return hashlib.sha256("\0".join(parts).encode() + _course_data()).hexdigest()[:32]


def _still_valid(entry: dict) -> bool:
    """Whether every kernels/ module the kept compile imported is as it was then."""
    return all(_digest(path) == digest for path, digest in entry["modules"].items())


def compile_env(arch: str) -> dict[str, str]:
    """The environment of a process that compiles for `arch` without launching anything."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KERNELS_GPU_PROFILE")
    }
    env.update(
        KERNELS_COMPILE_ONLY="1",  # compile for real: nothing here launches a kernel
        KERNELS_MODE="cpu",  # answer for the target, not this GPU (an A100 building sm_90)
        KERNELS_TARGET_ARCH=arch,
        TRITON_DUMP_PTXAS_LOG="1",  # ptxas -v: registers and spills, printed to stdout
        TRITON_ALWAYS_COMPILE="1",  # so ptxas runs (and reports) even when cached
    )
    return env


def run_compile_script(script: str, args: list[str], failure: str, arch: str) -> list[dict]:
    """`python -c script *args` in `compile_env(arch)`: each JSON line it printed, with from
    ptxas's report before it the registers a thread (`registers`) and the bytes spilled to local
    memory (`spill_bytes`). RuntimeError starting with `failure` if the script failed."""
    use_cache = os.environ.get("KERNELS_COMPILE_CACHE", "1") != "0"
    kept = CACHE_DIR / f"{_cache_key(script, args, arch)}.json"
    if use_cache and kept.is_file():
        try:
            entry = json.loads(kept.read_text())
            if _still_valid(entry):
                return entry["made"]
        except (ValueError, KeyError, TypeError, AttributeError):  # damaged: compile again
            pass
    made, modules = _compile(script, args, failure, arch)
    if use_cache:
        entry = {"made": made, "modules": {path: _digest(path) for path in modules}}
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.tmp")  # renamed whole: never read half-written
        partial.write_text(json.dumps(entry))
        partial.replace(kept)
    return made


def _compile(script: str, args: list[str], failure: str, arch: str):
    """The reports, and the kernels/ modules the compile imported."""
    done = subprocess.run(
        [sys.executable, "-c", script + _LIST_MODULES, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=compile_env(arch),
    )
    if done.returncode != 0:  # the error, without the binding's reference-leak report after it
        error = done.stderr.split("nanobind: leaked")[0]
        raise RuntimeError(f"{failure}:\n" + error[-3000:])
    made, ptxas, modules = [], "", []
    for line in done.stdout.splitlines():
        if not line.startswith("{"):  # ptxas's report on the variant compiled next
            ptxas += line + "\n"
            continue
        one = json.loads(line)
        if "kernels_modules" in one:
            modules = one["kernels_modules"]
            continue
        one["registers"] = max(map(int, re.findall(r"Used (\d+) registers", ptxas)), default=None)
        one["spill_bytes"] = sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas)))
        made.append(one)
        ptxas = ""
    return made, modules
