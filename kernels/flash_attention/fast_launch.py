"""Eager launches at the cost of the launch itself: Triton's per-call host work, done once per call
signature.

Every `kernel[grid](*args)` call does the same work on the host before the driver sees it: bind the
arguments to the kernel's signature, work out each one's *specialization* (its dtype, whether a
pointer is 16-byte aligned, whether an integer is 1 or a multiple of 16), look the compiled kernel
up by that key and, for an autotuned kernel, look its configuration up by the autotuning key. A
wrapper adds its own: argument checks, output allocation, the grid. With thirty arguments that is
tens of microseconds of Python, more than the GPU time of a decode step (PERFORMANCE.md in this
folder has the measurements).

A call site knows which facts about its arguments can change any of that, and can key on them
itself: `LaunchCache` keeps, per key the caller builds, the compiled kernel Triton chose the first
time, the configuration's constants and the constexpr values, and launches the compiled kernel
through its own launcher afterwards (`CompiledKernel[grid](*all_args)`, what `JITFunction.run`
ends with). The key must determine everything Triton specializes on; `int_facts` gives those facts
for integers that vary between calls (a KV cache's length) without keying on their exact values.

When something instruments Triton's launches (a profiler, or the course's grader, which counts
launches and checks whose kernels run), `JITFunction.run` is wrapped and every call takes the
ordinary path, so the instrument sees every launch. The Triton interpreter (CPU mode) always takes
the ordinary path.
"""

from __future__ import annotations

from triton import knobs
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from kernels import runtime

# False: every launch takes Triton's ordinary path (the benchmark's before-and-after comparison).
ENABLED = True


def aligned(*tensors) -> tuple:
    """What Triton specializes a pointer argument on: 16-byte alignment of the data."""
    return tuple(t.data_ptr() % 16 == 0 for t in tensors)


def _plain_run():
    """Triton's own `JITFunction.run`, or None if something had already wrapped it at import."""
    run = JITFunction.run
    plain = f"{run.__module__}.{run.__qualname__}" == "triton.runtime.jit.JITFunction.run"
    return run if plain else None


_PLAIN_RUN = _plain_run()


def launches_are_plain() -> bool:
    """True unless someone wrapped Triton's launch path (profilers, launch counters) or set a
    launch hook: then every launch goes through it. (Recent Triton releases keep the hook as a
    chain of callables, empty by default; older ones as None.)"""
    hook = knobs.runtime.launch_enter_hook
    return JITFunction.run is _PLAIN_RUN and (hook is None or not getattr(hook, "calls", True))


class LaunchCache:
    """The compiled kernel of one `@triton.jit` kernel (autotuned or not), per caller-built key."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        self.entries: dict = {}
        self.broken = False  # the direct launch was refused once: ordinary launches only

    def clear(self) -> None:
        self.entries.clear()

    def launch(self, key, grid, args: tuple, constants: dict) -> None:
        """`kernel[grid](*args, **constants)`; after the first call per key, the compiled kernel's
        launcher directly (what `JITFunction.run` ends with), on the current stream.

        The key must determine the grid, the configuration and everything Triton specializes on.
        grid(meta) -> (x, y, z), meta holding `constants` and the autotuned configuration's values;
        `args` are the leading (run-time) arguments, `constants` the constexpr keywords (and
        launch options such as num_warps)."""
        entry = self.entries.get(key)
        if entry is not None and ENABLED and launches_are_plain():
            run, function, packed, tail, (x, y, z), device = entry
            try:
                run(x, y, z, driver.active.get_current_stream(device), function, packed, None,
                    None, None, *args, *tail)  # fmt: skip
                return
            except (TypeError, ValueError, SystemError):
                # A launcher that takes other arguments (another Triton release) refuses them
                # before launching anything: from now on take the ordinary path.
                self.broken = True
                self.entries.clear()
        compiled = self.kernel[grid](*args, **constants)
        if runtime.ON_GPU and key is not None and not self.broken and launches_are_plain():
            config = getattr(self.kernel, "best_config", None)
            meta = {**constants, **(config.kwargs if config is not None else {})}
            tail = tuple(meta[name] for name in self.fn.arg_names[len(args) :])
            compiled._init_handles()
            device = driver.active.get_current_device()
            self.entries[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail,
                                 grid(meta), device)  # fmt: skip
