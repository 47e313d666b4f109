"""CUDA C through CuPy: compiling the course's `.cu` files and launching them on PyTorch tensors.

The CUDA C lives in real `.cu` files next to their wrappers, so an editor highlights it, `nvcc`
compiles it in CI (no GPU needed) and the same text is what CuPy compiles at run time with NVRTC.

Launching on PyTorch tensors takes two decisions worth seeing once:

* **Pointers, not arrays.** CuPy has no bfloat16 dtype, so instead of converting tensors we pass
  their device addresses (`tensor.data_ptr()`) as 64-bit integers; the kernel's `const T*` parameter
  receives them. The wrapper, not CuPy, is then responsible for shapes, dtypes and contiguity
  (`kernels.validate`).
* **PyTorch's stream.** The kernel is launched on `torch.cuda.current_stream()`, so it is ordered
  with the PyTorch work before and after it, and is captured when that stream is recording a CUDA
  graph.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from kernels import runtime

KERNELS_DIR = Path(__file__).resolve().parent
# Headers that several topics share (elementwise.cuh: the fp16/bf16 conversions and 16-byte
# vectors).
SHARED_INCLUDE_DIR = KERNELS_DIR / "include"


def _site_packages_cuda_dirs() -> list[Path]:
    """CUDA toolkit pieces installed as pip wheels (nvidia-cuda-nvcc, nvidia-cuda-runtime, ...)."""
    found = []
    for entry in map(Path, sys.path):
        for sub in ("nvidia/cu13", "nvidia/cuda_runtime", "nvidia/cuda_nvcc"):
            if (entry / sub).is_dir():
                found.append(entry / sub)
    return found


def cuda_include_dirs() -> list[str]:
    """The course's shared headers, then the directories of cuda_fp16.h and cuda_bf16.h.

    The toolkit's directories come before the wheels'."""
    candidates = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    candidates += [d / "include" for d in _site_packages_cuda_dirs()]
    dirs = [str(SHARED_INCLUDE_DIR)]
    for d in candidates:
        if (d / "cuda_fp16.h").is_file() and str(d) not in dirs:
            dirs.append(str(d))
    return dirs


def nvcc_path() -> str | None:
    """`nvcc` from PATH, or from the nvidia-cuda-nvcc wheel that the dev install brings."""
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    for d in _site_packages_cuda_dirs():
        if (d / "bin" / "nvcc").is_file():
            return str(d / "bin" / "nvcc")
    return None


def source_path(relative: str) -> Path:
    """Absolute path of a course `.cu` file, e.g.
    source_path('elementwise_add/add_vectorized.cu')."""
    path = KERNELS_DIR / relative
    if not path.is_file():
        raise FileNotFoundError(path)
    return path


@functools.cache
def _module_from_file(path: Path):
    import cupy

    options = ("-std=c++17", f"-I{path.parent}", *(f"-I{d}" for d in cuda_include_dirs()))
    return cupy.RawModule(code=path.read_text(), options=options)


def module_from_source(code: str, include_dir: Path | None = None):
    """A CuPy RawModule from CUDA C text (used by labs, where the student's code is a string)."""
    runtime.require_cupy()
    import cupy

    includes = ([f"-I{include_dir}"] if include_dir else []) + [
        f"-I{d}" for d in cuda_include_dirs()
    ]
    return cupy.RawModule(code=code, options=("-std=c++17", *includes))


def load_kernel(relative: str, name: str):
    """The `extern "C"` kernel `name` of the course's `.cu` file `relative`, compiled once."""
    runtime.require_cupy()
    return _module_from_file(source_path(relative)).get_function(name)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive integers: how many blocks of b cover a."""
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pointer(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def launch(
    kernel, grid: int, block: int, args: tuple, device: torch.device, shared_mem: int = 0
) -> None:
    """Launch a CuPy kernel on PyTorch's current stream of `device`, with `shared_mem` bytes of
    dynamic shared memory. Past 48 KB a kernel must opt in to more (CuPy's
    `max_dynamic_shared_size_bytes`, cudaFuncSetAttribute underneath), which this makes where the
    kernel has not yet; the device's limit per block is `runtime.shared_memory_budget()`."""
    import cupy

    limit = runtime.shared_memory_budget()
    if shared_mem > limit:
        raise ValueError(
            f"launch: {shared_mem} bytes of dynamic shared memory requested; this GPU gives a "
            f"block at most {limit}"
        )
    with (
        cupy.cuda.Device(device.index or 0),
        cupy.cuda.Stream.from_external(torch.cuda.current_stream(device)),
    ):
        if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
            kernel.max_dynamic_shared_size_bytes = shared_mem
        kernel((grid,), (block,), args, shared_mem=shared_mem)
