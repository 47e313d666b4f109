"""Every course .cu file compiles with nvcc for every architecture a student may bring (sm_75 to
sm_120, runtime.COMPILE_ARCHS) and spills nothing.

The vectorized kernels really issue 16-byte loads. No GPU needed: this is what CI checks of the
CUDA C."""

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kernels import cuda, runtime

CU_FILES = sorted(cuda.KERNELS_DIR.rglob("*.cu"))
ARCHS = list(runtime.COMPILE_ARCHS)


# nvcc and ptxas take most of this file's time (step 5's tensor-core kernels: about 35 s an
# architecture on CI's CPU). A compile depends only on nvcc, its flags and the course's CUDA text,
# so its cubin and ptxas report are kept outside the clone, keyed by all three, as
# tools/compile_all.py keeps Triton's: a fresh clone on the same machine compiles what changed.
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpu-kernels-course"
NVCC_CACHE = CACHE / "nvcc"


@functools.cache
def _course_cuda_text() -> bytes:
    """Every .cu and header of the course, with its path: a change to any of them is a new key."""
    files = sorted(p for p in cuda.KERNELS_DIR.rglob("*") if p.suffix in {".cu", ".cuh", ".h"})
    return b"".join(str(p.relative_to(cuda.KERNELS_DIR)).encode() + p.read_bytes() for p in files)


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def compile_cubin(source: Path, arch: str, tmp_path: Path) -> tuple[Path, str]:
    nvcc = cuda.nvcc_path()
    assert nvcc, "nvcc not found: install the dev extras (nvidia-cuda-nvcc) or a CUDA toolkit"
    cubin = tmp_path / f"{source.stem}_{arch}.cubin"
    flags = [f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", f"-I{source.parent}",
             *(f"-I{d}" for d in cuda.cuda_include_dirs())]  # fmt: skip
    # the clone's folders (its kernels/, its .venv's headers) by their place in it, so a clone
    # elsewhere finds the same key
    where = [f.replace(str(cuda.KERNELS_DIR.parent), "<clone>") for f in flags]
    where.append(str(source.relative_to(cuda.KERNELS_DIR)))
    key = hashlib.sha256(
        "\0".join([_nvcc_version(nvcc), *where]).encode() + _course_cuda_text()
    ).hexdigest()[:32]
    kept = NVCC_CACHE / key
    if (kept / "report.txt").is_file():
        shutil.copyfile(kept / "out.cubin", cubin)
        return cubin, (kept / "report.txt").read_text()
    proc = subprocess.run([nvcc, "-cubin", *flags, "-o", str(cubin), str(source)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    NVCC_CACHE.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=NVCC_CACHE))  # renamed whole: never half written
    shutil.copyfile(cubin, staging / "out.cubin")
    (staging / "report.txt").write_text(proc.stderr)
    try:
        staging.rename(kept)
    except OSError:  # another worker kept the same compile first
        shutil.rmtree(staging, ignore_errors=True)
    return cubin, proc.stderr


def test_there_are_cuda_sources():
    assert {p.name for p in CU_FILES} >= {"add_naive.cu", "add_vectorized.cu"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_compiles_without_spills(source, arch, tmp_path):
    _, report = compile_cubin(source, arch, tmp_path)
    kernels_compiled = re.findall(r"Compiling entry function '(\w+)'", report)
    assert kernels_compiled, f"no kernel compiled from {source.name}:\n{report}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == len(kernels_compiled)
    assert all(s == ("0", "0") for s in spills), report
    frames = re.findall(r"(\d+) bytes stack frame", report)
    assert all(f == "0" for f in frames), f"local-memory stack frame in {source.name}:\n{report}"


def _sass(cubin: Path) -> str:
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run(
        [str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def _functions(sass: str) -> dict[str, str]:
    parts = re.split(r"\s+Function : (\w+)", sass)
    return dict(zip(parts[1::2], parts[2::2]))


def test_vectorized_kernels_issue_16_byte_accesses(tmp_path):
    cubin, _ = compile_cubin(
        cuda.source_path("elementwise_add/add_vectorized.cu"), "sm_90", tmp_path
    )
    functions = _functions(_sass(cubin))
    assert len(functions) == 9
    for name, body in functions.items():
        assert "LDG.E.128" in body and "STG.E.128" in body, (
            f"{name} does not use 16-byte loads/stores"
        )


def test_naive_kernels_use_narrow_accesses(tmp_path):
    """The contrast notebook 01 draws: one element per thread means 2- or 4-byte loads."""
    cubin, _ = compile_cubin(cuda.source_path("elementwise_add/add_naive.cu"), "sm_90", tmp_path)
    for name, body in _functions(_sass(cubin)).items():
        assert "LDG.E.128" not in body, name
