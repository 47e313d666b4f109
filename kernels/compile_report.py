"""Run a script that compiles kernels for a GPU this machine may not have, and read what it says.

The script prints one JSON line per compiled variant, each after ptxas's report on that variant
(TRITON_DUMP_PTXAS_LOG=1). A process of its own, because a process that runs Triton's interpreter
(CPU mode) cannot compile. Used by the Gluon attention kernels (flash_attention/gluon_offline.py)
and the matrix multiply's Hopper kernels (matmul/offline.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


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
