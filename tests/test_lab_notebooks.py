"""The untouched lab runs top to bottom: its check cells say "not implemented yet", never a
traceback."""

import nbformat
from nbclient import NotebookClient

from grading.notebooks import LABS_DIR, role


def test_untouched_lab_executes_and_reports_not_implemented():
    path = LABS_DIR / "01_elementwise_add_lab.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(LABS_DIR)}}
    ).execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors, errors[0]["ename"] if errors else ""
    checks = [c for c in nb.cells if role(c) == "check"]
    assert len(checks) == 3
    for cell in checks:
        text = "".join(o.get("text", "") for o in cell.outputs)
        assert (
            "not implemented yet" in text or "needs a GPU" in text.lower() or "NEEDS A GPU" in text
        ), text
    assert any("NOT IMPLEMENTED" in "".join(o.get("text", "") for o in c.outputs) for c in checks)
