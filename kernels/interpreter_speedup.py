"""CPU mode: work that Triton's interpreter repeats on every helper call and operation, done once.

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

Two more costs are paid on every operation of every program, and `install` removes them too, with
the same results:

* the interpreter's `_get_np_dtype` builds its table of 18 NumPy dtypes anew on every call (tens
  of thousands of calls a launch): the table is now built once;
* each `tl.block_type` builds its shape as a `triton.language` tuple whose type holds one
  `constexpr_type` per dimension, and its name from that tuple: both now come from a table of the
  shapes seen before (a shape of plain ints; anything else is built as before, errors included).
  Each type still gets a shape tuple of its own; only the tuple's immutable type is shared.

Grading the course's flash attention solution in this process (check_function, 2-core machine)
took 18.6 s of CPU time without these two and 13.3 s with them.
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
    interpreter._get_np_dtype = _np_dtype_from_table(interpreter._get_np_dtype)
    tl.core.block_type.__init__ = _block_type_init_from_table(tl.core.block_type.__init__)


def _np_dtype_from_table(get_np_dtype):
    """`_get_np_dtype` with its table built once: every scalar dtype the original knows, asked of
    the original itself; pointers, and blocks of pointers, are uint64 there too."""
    import numpy as np
    import triton.language as tl

    scalars = [
        value
        for value in vars(tl).values()
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type))
    ]
    table = {}
    for scalar in scalars:
        try:
            table[scalar] = get_np_dtype(scalar)
        except KeyError:  # a dtype the interpreter has no NumPy type for: asked of it, it fails
            pass
    pointer = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = table.get(tt_dtype)
        return get_np_dtype(tt_dtype) if found is None else found

    np_dtype.__wrapped__ = get_np_dtype  # for the tests: the same answers as the original
    return np_dtype


def _block_type_init_from_table(block_type_init):
    """`block_type.__init__` that builds the parts of a shape of plain ints (its tuple's type, its
    element count, its text) once per shape; any other shape goes to the original."""
    from triton.language import core

    seen = {}

    def init(self, element_ty, shape):
        dims = shape.values if type(shape) is core.tuple else shape
        if type(dims) is not list:
            return block_type_init(self, element_ty, shape)
        ints = []
        for dim in dims:
            if type(dim) is core.constexpr:
                dim = dim.value
            if type(dim) is not int:
                return block_type_init(self, element_ty, shape)
            ints.append(dim)
        key = tuple(ints)
        parts = seen.get(key)
        if parts is None:
            block_type_init(self, element_ty, shape)
            seen[key] = (self.shape.type, self.numel, str(self.shape))
            return None
        tuple_type, numel, text = parts
        self.element_ty = element_ty
        self.shape = core.tuple(ints, tuple_type)
        self.numel = numel
        self.name = f"<{text}, {element_ty}>"
        return None

    init.__wrapped__ = block_type_init  # for the tests: the same types as the original
    return init
