"""What the grader trusts, and how it checks it: cell checksums, the grader's own code, content
hashes.

* **Cell checksums**, in nbgrader's format (`nbgrader.utils.compute_checksum`): `make_labs` writes
one
  into every nbgrader cell of a generated lab, as `nbgrader generate_assignment` does. A locked cell
  whose text no longer matches its checksum (or the source notebook) was modified; the grader uses
  the source's copy anyway and says so in the report.
* **The grader's own code**: a submission runs in the grading process, so it could replace the
  grader's functions (`kernels.testing.compare = lambda ...`). `GraderGuard` records the identity of
  every function the checks depend on before the student's code is imported and compares after each
  graded function. This stops naive tampering, not a determined attacker (see grading/README.md).
* **Content hashes** decide whether an instructor's resumed run may reuse an earlier result: the
  student's notebook, its source, the grader's code and the options that change a result.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------
# nbgrader checksums


def _nbgrader(cell) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {}) or {}


def is_grade(cell) -> bool:
    return bool(_nbgrader(cell).get("grade", False))


def is_solution(cell) -> bool:
    return bool(_nbgrader(cell).get("solution", False))


def is_locked(cell) -> bool:
    """nbgrader's rule: solution cells are never locked, grade cells always are."""
    if is_solution(cell):
        return False
    if is_grade(cell):
        return True
    return bool(_nbgrader(cell).get("locked", False))


def compute_checksum(cell) -> str:
    """The checksum nbgrader stores in `metadata.nbgrader.checksum` (same algorithm and digest)."""
    m = hashlib.md5()
    m.update(cell["source"].encode("utf-8"))
    m.update(cell["cell_type"].encode("utf-8"))
    m.update(str(is_grade(cell)).encode("utf-8"))
    m.update(str(is_solution(cell)).encode("utf-8"))
    m.update(str(is_locked(cell)).encode("utf-8"))
    m.update(_nbgrader(cell)["grade_id"].encode("utf-8"))
    if is_grade(cell):
        m.update(str(float(_nbgrader(cell)["points"])).encode("utf-8"))
    return m.hexdigest()


def add_checksums(nb) -> None:
    """Write nbgrader checksums into every graded, solution or locked cell (in place)."""
    for cell in nb["cells"]:
        if "nbgrader" in cell.get("metadata", {}) and (
            is_grade(cell) or is_solution(cell) or is_locked(cell)
        ):
            cell["metadata"]["nbgrader"]["checksum"] = compute_checksum(cell)


def checksum_status(cell) -> bool | None:
    """True if the cell matches its stored checksum, False if not, None if it carries none."""
    stored = _nbgrader(cell).get("checksum")
    if not stored:
        return None
    try:
        return compute_checksum(cell) == stored
    except (KeyError, TypeError, ValueError):
        return False


# --------------------------------------------------------------------------------------------------
# The grader's own code


# Module attributes (every function and class in these modules) and single objects the checks rely
# on.
GUARDED_MODULES = (
    "grading.harness",
    "grading.watch",
    "grading.cases",
    "grading.correctness",
    "grading.diagnosis",
    "grading.graph",
    "grading.performance",
    "grading.results",
    "grading.spec",
    "kernels.testing",
    "kernels.bench",
    "kernels.validate",
)
GUARDED_OBJECTS = (
    "torch.equal",
    "torch.isnan",
    "torch.isinf",
    "torch.where",
    "torch.nonzero",
    "torch.argmax",
    "torch.Tensor.__eq__",
    "torch.Tensor.__ne__",
    "torch.Tensor.__le__",
    "torch.Tensor.abs",
    "torch.Tensor.clone",
    "torch.Tensor.copy_",
    "torch.Tensor.fill_",
    "torch.Tensor.to",
    "torch.Tensor.double",
    "torch.Tensor.sum",
    "torch.Tensor.item",
    "torch.Tensor.data_ptr",
    "torch.cuda.synchronize",
    "triton.runtime.jit.JITFunction.run",
    "triton.runtime.interpreter.InterpretedFunction.run",
    "kernels.cuda.launch",
)


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


class GraderGuard:
    """Remembers what the grader's functions are, to notice a submission that replaces one."""

    def __init__(self, extra_modules: tuple[str, ...] = ()):
        self._snapshot = self._take(GUARDED_MODULES + tuple(extra_modules))

    @staticmethod
    def _take(modules) -> dict[str, int]:
        """The identity of every module attribute (functions, classes, the frozen sets and tuples
        the checks read), and of every method of the classes the module defines."""
        seen = {}
        for name in modules:
            mod = importlib.import_module(name)
            for attr, value in vars(mod).items():
                if attr.startswith("__") or isinstance(value, types.ModuleType):
                    continue
                seen[f"{name}.{attr}"] = id(value)
                if isinstance(value, type) and value.__module__ == name:
                    for method in vars(value):
                        found = getattr(value, method, None)
                        if callable(found) and found is getattr(value, method, None):
                            seen[f"{name}.{attr}.{method}"] = id(found)
        for dotted in GUARDED_OBJECTS:
            try:
                seen[dotted] = id(_resolve(dotted))
            except (ImportError, AttributeError):
                pass
        return seen

    def changed(self) -> list[str]:
        """Names whose object is no longer the one recorded (empty if nothing was replaced)."""
        changed = []
        for dotted, ident in self._snapshot.items():
            try:
                now = id(_resolve(dotted))
            except (ImportError, AttributeError):
                changed.append(dotted)
                continue
            if now != ident:
                changed.append(dotted)
        return changed


# --------------------------------------------------------------------------------------------------
# Content hashes


@functools.cache
def grader_version() -> str:
    """A hash of the code and tables a grade depends on: the grading package, the course kernels and
    the expected-results tables. Two runs with the same version grade the same way."""
    h = hashlib.sha256()
    patterns = [
        ("grading", ("*.py", "*.json")),
        ("kernels", ("*.py", "*.cu", "*.cuh")),
        ("data/expected", ("*.yaml",)),
    ]
    for folder, globs in patterns:
        files = sorted(
            {p for g in globs for p in (REPO / folder).rglob(g) if "__pycache__" not in p.parts}
        )
        for p in files:
            h.update(str(p.relative_to(REPO)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def content_hash(notebook: Path, source: Path, options: dict) -> str:
    """What a lab's result depends on: the notebook, its source, the grader, the options."""
    h = hashlib.sha256()
    for part in (
        notebook.read_bytes(),
        source.read_bytes() if source.exists() else b"",
        grader_version().encode(),
        repr(sorted(options.items())).encode(),
    ):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:32]
