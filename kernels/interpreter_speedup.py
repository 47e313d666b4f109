"""CPU mode: stop Triton's interpreter from re-patching `triton.language` on every helper call.

Under ``TRITON_INTERPRET=1`` a kernel launch swaps the builtins of `triton.language` (``tl.load``,
``tl.sum``, ...) for NumPy versions in place, runs every program, and swaps them back. Triton 3.9
also does the swap at the start of every call of a ``@triton.jit`` *helper* from inside a kernel
(``InterpretedFunction.__call__`` calls ``_patch_lang``), although the launch around it has
already done it, so the second swap only rebuilds what is there. It is not cheap: it walks the
modules with ``inspect.getmembers``, and a kernel that calls a helper in its inner loop pays for
the walk on every trip of every program. Grading the course's Kahan sum, which calls helpers on
every trip, spent 111 s of 143 s (under cProfile) in it; with this module the same grading test
takes 10 s instead of 38 s.

`install` makes that swap a no-op when every `triton.language` module the function sees is
already swapped, and changes nothing else: a launch still swaps and restores, and a function whose
module sees a `triton.language` module that is not swapped yet is handled as before. On a GPU
nothing here runs.
"""

from __future__ import annotations

import inspect


class _NothingToRestore:
    def restore(self) -> None:
        pass


def install() -> None:
    """Wrap the interpreter's `_patch_lang` (calling it again is harmless)."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    if getattr(patch_lang, "skips_repeats", False):
        return

    def patch_lang_unless_patched(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        # A swapped module's `load` is the interpreter's wrapper, which is no registered builtin.
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return _NothingToRestore()
        return patch_lang(fn)

    patch_lang_unless_patched.skips_repeats = True
    interpreter._patch_lang = patch_lang_unless_patched
