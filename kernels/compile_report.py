"""Run a script that compiles kernels for a GPU this machine may not have, and read what it says.

The script prints one JSON line per compiled variant, each after ptxas's report on that variant
(TRITON_DUMP_PTXAS_LOG=1). A process of its own, because a process that runs Triton's interpreter
(CPU mode) cannot compile. Used by the Gluon attention kernels (flash_attention/gluon_offline.py)
and the matrix multiply's Hopper kernels (matmul/offline.py).

What a compile reports depends only on the script, its arguments, the target, Triton (which brings
its ptxas) and the course's kernel sources, so the parsed report is kept outside the clone, keyed by
all of them (~/.cache/gpu-kernels-course/compile-reports, or under KERNELS_CACHE_DIR): the tests
and lectures that read it compile once per change, not once per run. KERNELS_COMPILE_CACHE=0 always
compiles.
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


@functools.cache
def _course_sources() -> bytes:
    """Every file of kernels/ (sources and the tables they read) with its path: a change to any of
    them is a new key."""
    files = sorted(
        p for p in KERNELS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    return b"".join(str(p.relative_to(KERNELS_DIR)).encode() + p.read_bytes() for p in files)


def _cache_key(script: str, args: list[str], arch: str) -> str:
    import triton  # the child's: the same interpreter and PYTHONPATH

    parts = [script, *args, arch, triton.__version__, triton.__file__, sys.version]
    return hashlib.sha256("\0".join(parts).encode() + _course_sources()).hexdigest()[:32]


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
            return json.loads(kept.read_text())
        except ValueError:  # a damaged entry: compile again
            pass
    made = _compile(script, args, failure, arch)
    if use_cache:
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.tmp")  # renamed whole: never read half-written
        partial.write_text(json.dumps(made))
        partial.replace(kept)
    return made


def _compile(script: str, args: list[str], failure: str, arch: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=compile_env(arch),
    )
    if done.returncode != 0:  # the error, without the binding's reference-leak report after it
        error = done.stderr.split("nanobind: leaked")[0]
        raise RuntimeError(f"{failure}:\n" + error[-3000:])
    made, ptxas = [], ""
    for line in done.stdout.splitlines():
        if not line.startswith("{"):  # ptxas's report on the variant compiled next
            ptxas += line + "\n"
            continue
        one = json.loads(line)
        one["registers"] = max(map(int, re.findall(r"Used (\d+) registers", ptxas)), default=None)
        one["spill_bytes"] = sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas)))
        made.append(one)
        ptxas = ""
    return made
