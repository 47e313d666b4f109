"""Run a script that compiles kernels for a GPU this machine may not have, and read what it says.

The script prints one JSON line per compiled variant, each after ptxas's report on that variant
(TRITON_DUMP_PTXAS_LOG=1). A process of its own, because a process that runs Triton's interpreter
(CPU mode) cannot compile. Used by the Gluon attention kernels (flash_attention/gluon_offline.py)
and the matrix multiply's Hopper kernels (matmul/offline.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys


def run_compile_script(script: str, args: list[str], failure: str) -> list[dict]:
    """`python -c script *args`: each JSON line it printed, with from ptxas's report before it the
    registers a thread (`registers`) and the bytes spilled to local memory (`spill_bytes`).
    RuntimeError starting with `failure` if the script failed."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=900
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
