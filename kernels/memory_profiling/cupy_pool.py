"""CuPy's memory pool beside PyTorch's caching allocator: two caches, each blind to the other.

Both keep freed GPU memory for reuse instead of returning it to the driver. CuPy's default pool is
invisible to `torch.cuda.memory_allocated()` and to PyTorch's snapshots, and PyTorch's cache is
invisible to CuPy's pool: a process that uses both can run out of memory while each says it has
plenty free. `torch_backed_allocator()` makes CuPy allocate through PyTorch's allocator, so one
cache holds everything and the snapshot shows CuPy's arrays too. GPU only (CuPy needs a driver).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import runtime


@dataclass
class PoolFigures:
    torch_allocated: int
    torch_reserved: int
    cupy_used: int
    cupy_held: int  # bytes CuPy's pool holds from the driver: used + cached free blocks

    def table(self) -> str:
        mib = 2**20
        return (
            f"PyTorch: allocated {self.torch_allocated / mib:8.1f} MiB, "
            f"reserved {self.torch_reserved / mib:8.1f} MiB\n"
            f"CuPy:    used      {self.cupy_used / mib:8.1f} MiB, "
            f"held     {self.cupy_held / mib:8.1f} MiB"
        )


def figures() -> PoolFigures:
    runtime.require_cupy()
    import cupy

    pool = cupy.get_default_memory_pool()
    return PoolFigures(
        torch.cuda.memory_allocated(),
        torch.cuda.memory_reserved(),
        pool.used_bytes(),
        pool.total_bytes(),
    )


class _TorchBlock:
    """Owns one block of PyTorch's caching allocator; returns it when garbage-collected."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        torch.cuda.caching_allocator_delete(self.ptr)


def torch_backed_allocator():
    """A CuPy allocator that takes its memory from PyTorch's caching allocator:
    `cupy.cuda.set_allocator(torch_backed_allocator())`;
    `cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)` undoes it."""
    runtime.require_cupy()
    import cupy

    def malloc(nbytes: int):
        device = cupy.cuda.Device().id
        ptr = torch.cuda.caching_allocator_alloc(nbytes, device, torch.cuda.current_stream(device))
        # the block goes back to PyTorch's cache when CuPy drops its last reference to the memory
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, _TorchBlock(ptr), device_id=device)
        return cupy.cuda.MemoryPointer(mem, 0)

    return malloc


def demo(nbytes: int = 256 * 2**20) -> list[tuple[str, PoolFigures]]:
    """Allocate and free through both, and through CuPy on PyTorch's allocator: the figures."""
    runtime.require_cupy()
    import cupy

    steps = [("start", figures())]
    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = cupy.empty(nbytes, dtype=cupy.uint8)
    steps.append(("a torch tensor and a CuPy array", figures()))
    del t, a
    steps.append(("both freed (each cache keeps its block)", figures()))
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
    steps.append(("after free_all_blocks() and empty_cache()", figures()))
    cupy.cuda.set_allocator(torch_backed_allocator())
    try:
        a = cupy.empty(nbytes, dtype=cupy.uint8)
        steps.append(("CuPy array on PyTorch's allocator", figures()))
        del a
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    return steps
