"""The course's reference kernels.

Importing this package decides the execution mode (see `kernels.runtime`) before Triton is imported,
so import it first in every notebook and script.
"""

from kernels import runtime  # noqa: F401  (must run before any `@triton.jit`)

__all__ = ["runtime"]
