"""Every Triton kernel of the course compiles for every architecture a student may bring, without a
GPU: sm_75 (T4), sm_80 (A100), sm_86 (A10, RTX 30xx), sm_89 (L4, RTX 40xx), sm_90 (H100, H200),
sm_100 (B200) and sm_120 (RTX 50xx).

`tools/compile_all.py` compiles each kernel in the configurations its wrappers launch, one process
per architecture in which `runtime.features()` answers for that target, so each kernel compiles the
path that GPU takes. `kernels/feature_table.py` says which kernels cannot exist where; this test
checks that it names every kernel in `kernels/`, that those kernels are never compiled there, and
that everything else compiles and fits the target's shared memory. A Hopper instruction added
without a gate fails here: ptxas refuses it for sm_80. The compiler is the GPU stacks' Triton
(constraints-gpu.txt and constraints-gpu-cu12.txt both pin it), installed beside the venv by
tools/triton_alt.py, not the CPU stack's, which no GPU student runs. Triton's cache, outside the
clone (~/.cache/gpu-kernels-course/triton), makes a second run take seconds. The suite compiles each
kernel's first configuration on every architecture (about 30 s of CPU an architecture from a cold
cache); COMPILE_CONFIGS=all compiles every configuration the wrappers launch (about 3 minutes an
architecture).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import feature_table, runtime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import triton_alt  # noqa: E402 - a script's module, beside the package

pytestmark = pytest.mark.cpu


def jit_functions() -> dict[str, str]:
    """ "module:name" -> the source of every @triton.jit / @gluon.jit function defined in kernels/
    (through autotuners, heuristics and the interpreter's wrapper)."""
    from triton.runtime.jit import KernelInterface

    found = {}
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        text = path.read_text()
        if "@triton.jit" not in text and "@gluon.jit" not in text:
            continue
        module_name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if not isinstance(value, KernelInterface):
                continue
            while hasattr(value, "fn"):
                value = value.fn
            if value.__module__ == module_name:
                key = f"{module_name.removeprefix('kernels.')}:{value.__name__}"
                found[key] = inspect.getsource(value)
    return found


def launched_kernels() -> set[str]:
    """The jit functions no other jit function calls: the kernels a wrapper launches."""
    sources = jit_functions()
    return {
        key
        for key in sources
        if not any(
            re.search(rf"(?<!def )\b{key.split(':')[1]}\s*[(,]", src)  # a call, not a namesake
            for other, src in sources.items()
            if other != key
        )
    }


def test_the_feature_table_names_every_kernel():
    assert launched_kernels() == set(feature_table.KERNELS)


# Runs the command after it with the GPU stacks' Triton first on PYTHONPATH.
GPU_STACKS_TRITON = (sys.executable, str(ROOT / "tools" / "triton_alt.py"), "--stack", "gpu-cu12",
                     "--")  # fmt: skip


def test_both_gpu_stacks_pin_the_triton_this_check_compiles_with():
    assert triton_alt.stack_triton("gpu") == triton_alt.stack_triton("gpu-cu12")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("compile") / "rows.json"
    done = subprocess.run(
        [*GPU_STACKS_TRITON, sys.executable, str(ROOT / "tools" / "compile_all.py"), "--json",
         str(out), "--configs", os.environ.get("COMPILE_CONFIGS", "first")],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=3600,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert f"Triton {triton_alt.stack_triton('gpu-cu12')} from" in said, said[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("arch", runtime.COMPILE_ARCHS)
def test_every_kernel_compiles_for(compiled, arch):
    rows = [row for row in compiled if row["arch"] == arch]
    failed = [f"{r['kernel']} [{r['config']}]: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed)
    expected = {key for key in feature_table.KERNELS if arch not in feature_table.cannot_exist(key)}
    assert {row["kernel"] for row in rows} == expected


UNGATED = """
import os
import re
os.environ["KERNELS_COMPILE_ONLY"] = "1"
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

@triton.jit
def waits(x_ptr):
    tl.extra.cuda.gdc_wait()
    tl.store(x_ptr, 1.0)

for cc in (80, 90):
    try:
        triton.compile(ASTSource(waits, {"x_ptr": "*fp32"}, {}), target=GPUTarget("cuda", cc, 32))
        print(cc, "compiled")
    except Exception as exc:
        print(cc, "failed", str(exc).splitlines()[0][:200])
"""


def test_an_ungated_hopper_instruction_fails_for_sm80(tmp_path):
    """What the compile check relies on: griddepcontrol (PDL) compiles for sm_90, not for sm_80."""
    script = tmp_path / "ungated.py"  # a file: Triton reads a kernel's source through inspect
    script.write_text(UNGATED)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [*GPU_STACKS_TRITON, sys.executable, str(script)], capture_output=True, text=True,
        timeout=600, env=env,
    )
    lines = done.stdout.splitlines()
    assert "90 compiled" in lines, done.stdout + done.stderr[-2000:]
    assert any(line.startswith("80 failed") for line in lines), done.stdout + done.stderr[-2000:]


def test_the_where_it_runs_table_is_the_generated_one():
    """notebooks/WHERE_IT_RUNS.md is what tools/where_it_runs.py prints from the feature table:
    regenerate it (`python tools/where_it_runs.py`) after changing the table."""
    sys.path.insert(0, str(ROOT / "tools"))
    import where_it_runs

    committed = (ROOT / "notebooks" / "WHERE_IT_RUNS.md").read_text()
    assert committed == where_it_runs.table()
