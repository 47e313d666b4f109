"""CUDA C without a GPU: compile it with `nvcc`, and read what the compiler says about each kernel.

CuPy compiles a lab's CUDA C only where it can run it, on a GPU. `nvcc` (installed by `make setup`
as the nvidia-cuda-nvcc wheel, or a CUDA toolkit's) compiles the same text anywhere, for a GPU
architecture named by hand. What it reports is real feedback before any run:

* the errors, with their lines;
* per kernel, the registers each thread uses (more registers, fewer threads resident on an SM);
* bytes spilled to local memory (registers that did not fit: slow loads and stores) and the stack
  frame (an array indexed at run time lives there).

The code is compiled, never run: that it compiles says nothing about whether it is right.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernels import cuda

# Hopper, the GPU the course's numbers come from; sm_80 (Ampere) compiles the same course code.
DEFAULT_ARCH = "sm_90"


@dataclass
class KernelResources:
    """What ptxas reports for one kernel."""

    name: str
    registers: int = 0
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack_frame: int = 0  # bytes

    def describe(self) -> str:
        spilled = self.spill_stores + self.spill_loads
        spills = (
            f"{self.spill_stores} bytes spill stores and {self.spill_loads} bytes spill loads"
            if spilled
            else "no spills"
        )
        stack = f", a {self.stack_frame}-byte stack frame" if self.stack_frame else ""
        return f"{self.name}: {self.registers} registers, {spills}{stack}"


@dataclass
class CompileReport:
    """nvcc's verdict on one source: `ok`, its error lines, and each kernel's resources."""

    arch: str
    ok: bool
    errors: list[str] = field(default_factory=list)
    kernels: list[KernelResources] = field(default_factory=list)


def compile_report(code: str, arch: str = DEFAULT_ARCH) -> CompileReport:
    """Compile CUDA C text for `arch` with nvcc (`-Xptxas -v`), nothing run."""
    nvcc = cuda.nvcc_path()
    if nvcc is None:
        return CompileReport(arch, False, ["nvcc not found: `make setup` installs it"])
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.cu"
        source.write_text(code)
        includes = [f"-I{cuda.SHARED_INCLUDE_DIR}", *(f"-I{d}" for d in cuda.cuda_include_dirs())]
        command = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", *includes]
        proc = subprocess.run(
            [*command, "-o", str(Path(folder) / "kernel.cubin"), str(source)],
            capture_output=True,
            text=True,
        )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [ln.replace(str(source), source.name).strip() for ln in output.splitlines()]
        return CompileReport(arch, False, [ln for ln in errors if "error" in ln] or errors[-10:])
    return CompileReport(arch, True, [], resources(output))


def resources(ptxas_output: str) -> list[KernelResources]:
    """Each kernel's registers, spills and stack frame, from `ptxas -v`'s lines."""
    found: dict[str, KernelResources] = {}
    current = None
    for line in ptxas_output.splitlines():
        if m := re.search(r"(?:Compiling entry function|Function properties for) '?(\w+)'?", line):
            current = found.setdefault(m.group(1), KernelResources(m.group(1)))
        elif current and (
            m := re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                r"(\d+) bytes spill loads",
                line,
            )
        ):
            current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current and (m := re.search(r"Used (\d+) registers", line)):
            current.registers = int(m.group(1))
    return list(found.values())


def feedback(name: str, code: str, arch: str = DEFAULT_ARCH) -> str:
    """What a check cell says of CUDA C it cannot run: compiled or not, and each kernel's
    registers and spills."""
    report = compile_report(code, arch)
    head = f"{name}: CUDA C compiled with nvcc for {arch}, not run (no GPU here: no points)"
    if not report.ok:
        return f"{head}: it does not compile:\n" + "\n".join(f"  {ln}" for ln in report.errors[:12])
    lines = [f"  {k.describe()}" for k in report.kernels] or ["  (no kernel in it)"]
    spilled = any(k.spill_stores or k.spill_loads or k.stack_frame for k in report.kernels)
    advice = (
        [
            "  spills and stack frames live in local memory, slow on a GPU: keep fewer values "
            "per thread, and index arrays only by compile-time constants"
        ]
        if spilled
        else []
    )
    return "\n".join([f"{head}: it compiles.", *lines, *advice])
