"""Nothing a student reads points to material the repository does not have.

The course was built from notes that are not part of it. A student who meets "seed 003",
"the issue", "DESIGN.md" or a path under "shared/" has nothing to open. Every student-facing
file (lectures, labs, solutions, the kernels package, the grader and its messages, the READMEs)
must state the fact itself or cite a public source instead.
"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Folders a student reads, and the kinds of file in them that hold text they read.
STUDENT_FACING = ("notebooks", "labs", "solutions", "kernels", "grading")
TEXT_SUFFIXES = {".ipynb", ".md", ".py", ".cu", ".cuh", ".yaml", ".json", ".txt"}
TOP_LEVEL = ("README.md",)

# Whitespace may be a line break: "the\n  issue's target" in a wrapped paragraph counts.
FORBIDDEN = re.compile(r"seed\s+00|the\s+issue|DESIGN\.md|shared/", re.IGNORECASE)


def student_facing_files() -> list[Path]:
    files = [ROOT / name for name in TOP_LEVEL if (ROOT / name).exists()]
    for folder in STUDENT_FACING:
        files += sorted(p for p in (ROOT / folder).rglob("*")
                        if p.is_file() and p.suffix in TEXT_SUFFIXES
                        and "__pycache__" not in p.parts)
    return files


def forbidden_mentions(text: str) -> list[str]:
    """Each forbidden phrase in `text`, with its line, as `line N: ...`."""
    hits = []
    for match in FORBIDDEN.finditer(text):
        number = text.count("\n", 0, match.start()) + 1
        line = text.splitlines()[number - 1]
        hits.append(f"line {number}: {line.strip()[:120]}")
    return hits


def readable_text(path: Path) -> str:
    """What a reader sees: a notebook's cell sources and text outputs; other files as they are."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix != ".ipynb":
        return text
    parts = []
    for cell in json.loads(text)["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            parts += ["".join(v) for k, v in out.get("data", {}).items()
                      if k.startswith("text/") and not isinstance(v, dict)]
    return "\n".join(parts)


def test_the_pattern_catches_each_phrase():
    for phrase in ("Seed 003's table", "as the issue asks", "see DESIGN.md",
                   "`../shared/anchors/x.json`", "seed 001 timed",
                   "following the\n  issue's target"):
        assert forbidden_mentions(phrase), phrase
    for phrase in ("--seed 1234", "torch.manual_seed(0)", "an issue of the GPU", "shared memory"):
        assert not forbidden_mentions(phrase), phrase


def test_the_walk_covers_every_kind_of_student_facing_file():
    names = {p.relative_to(ROOT).parts[0] for p in student_facing_files()}
    assert {"README.md", "notebooks", "labs", "solutions", "kernels", "grading"} <= names


@pytest.mark.parametrize("path", student_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_reference_a_student_cannot_follow(path):
    hits = forbidden_mentions(readable_text(path))
    assert not hits, (f"{path.relative_to(ROOT)} points to material students do not have; "
                      "state the fact or cite a public source (notebooks/README.md lists the "
                      "course's sources):\n" + "\n".join(hits))


WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_every_widget_has_a_static_figure_beside_it(path):
    """GitHub and an unrun JupyterLab show a widget only through saved widget state; without it, the
    cell that makes the widget must also draw a static figure, so the notebook reads unrun."""
    nb = json.loads(path.read_text())
    saved_state = "application/vnd.jupyter.widget-state+json" in nb["metadata"].get("widgets", {})
    for i, cell in enumerate(nb["cells"]):
        kinds = [set(out.get("data", {})) for out in cell.get("outputs", [])]
        if any(WIDGET in k for k in kinds) and not saved_state:
            assert any("image/png" in k for k in kinds), (
                f"{path.name}, cell {i}: a widget with neither saved state nor a static figure")
