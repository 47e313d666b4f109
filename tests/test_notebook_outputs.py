"""A lecture's committed outputs match today's code, and say where they came from.

`test_notebook_numbers.py` holds the prose to the outputs; this file holds the outputs to the rest
of the repository:

* a cell that prints a function's source (`inspect.getsource`) prints today's source: the function
  is imported here (CPU mode) and its source looked for in the committed output;
* the anchors table of notebooks/README.md is the one `tools/anchors.py` writes from data/results;
* the reading table of notebooks/README.md lists every lecture in notebooks/;
* a lecture says, before its first code cell, where its outputs come from: a lecture committed from
  CPU mode says "CPU mode", and a lecture committed from a GPU names that GPU, the one its set-up
  cell printed; every "measured here" line names that GPU too.
"""

import ast
import inspect
import json
import re
from pathlib import Path

import pytest

import kernels  # noqa: F401  (decides the mode before Triton is imported)

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ORIGIN = re.compile(r"where the outputs come from", re.IGNORECASE)


def _output_text(cell) -> str:
    return "".join("".join(out.get("text", "")) for out in cell.get("outputs", []))


def _imports(nb: dict) -> dict:
    """A namespace with every module-level import the notebook's code cells make."""
    namespace: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        tree = _parse("".join(cell["source"]))
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), "<imports>", "exec"), namespace)
                except ImportError:  # a GPU-only package: its sources are not printed here
                    pass
    return namespace


def _parse(source: str) -> ast.Module | None:
    """The cell's code, IPython's magics and shell lines left out."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _printed_sources(tree: ast.Module) -> list[str]:
    """The expressions whose source a cell prints, outside the functions it defines."""
    found = []

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if (isinstance(node, ast.Call) and node.args
                and ast.unparse(node.func) in ("inspect.getsource", "kernel_source")):
            found.append(ast.unparse(node.args[0]))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _aliases(source: str, namespace: dict) -> dict:
    """The cell's `name = a.b.c` assignments, evaluated, so `getsource(name)` resolves."""
    local = dict(namespace)
    tree = _parse(source)
    for node in tree.body if tree else ():
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, (ast.Attribute, ast.Name))):
            try:
                local[node.targets[0].id] = eval(ast.unparse(node.value), local)
            except Exception:
                pass
    return local


def _python_function(obj):
    """Through @triton.jit, @triton.autotune and interpreter wrappers to the Python function."""
    while not (inspect.isfunction(obj) or inspect.ismethod(obj)) and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def stale_sources(nb: dict) -> list[str]:
    """'cell N: NAME' for each printed source that is not today's source of NAME."""
    namespace = _imports(nb)
    stale = []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        tree = _parse(source) if cell["cell_type"] == "code" else None
        if tree is None or not _printed_sources(tree):
            continue
        printed = _output_text(cell)
        local = _aliases(source, namespace)
        for expr in _printed_sources(tree):
            try:
                today = inspect.getsource(_python_function(eval(expr, local)))
            except Exception as error:  # the name itself is gone: as stale as a changed body
                stale.append(f"cell {i}: {expr} no longer resolves ({type(error).__name__})")
                continue
            name = re.search(r"def (\w+)\(", today).group(1)
            if f"def {name}(" in printed:
                if today not in printed:
                    stale.append(f"cell {i}: {expr} prints an older source than today's")
            elif printed.strip() and printed.strip() not in today:
                stale.append(f"cell {i}: {expr}: the printed part is not in today's source")
    return stale


def setup_mode(nb: dict) -> tuple[str, str | None]:
    """('cpu', None) or ('gpu', GPU name), from the first line the set-up cell printed."""
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    line = _output_text(first).splitlines()[0] if _output_text(first) else ""
    match = re.match(r"GPU mode: (.+?) \(sm_", line)
    if match:
        return "gpu", match.group(1)
    return ("cpu", None) if line.startswith("CPU mode") else ("unrun", None)


def origin_problems(nb: dict) -> list[str]:
    """What the opening's 'where the outputs come from' gets wrong about the committed run."""
    mode, gpu = setup_mode(nb)
    opening = []
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            break
        opening.append("".join(cell["source"]))
    said = next((p for p in "\n".join(opening).split("\n\n") if ORIGIN.search(p)), None)
    if mode == "unrun":
        return []
    if said is None:
        return ["the opening does not say where the outputs come from"]
    said = " ".join(said.split())
    problems = []
    if mode == "cpu" and "CPU mode" not in said:
        problems.append("the outputs were committed from CPU mode, and the opening does not say so")
    if mode == "gpu":
        first_gpu = re.search(r"NVIDIA [\w ]+?(?= \(|[,.;:)]|$)", said)
        if not first_gpu or first_gpu.group().strip() != gpu:
            named = first_gpu.group() if first_gpu else "no GPU"
            problems.append(f"the set-up cell ran on {gpu}; the opening names {named}")
        for i, cell in enumerate(nb["cells"]):
            for here in re.findall(r"measured here: (NVIDIA[^,;\n)]*)", _output_text(cell)):
                if here.strip() != gpu:
                    problems.append(f"cell {i} measured on {here.strip()}, not on {gpu}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_printed_source_is_todays(path):
    stale = stale_sources(json.loads(path.read_text()))
    assert not stale, (f"{path.name} prints source that changed since it ran; re-run the cell "
                       "(CPU mode is enough for a cell that only prints source):\n"
                       + "\n".join(stale))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_opening_names_the_run_behind_the_outputs(path):
    problems = origin_problems(json.loads(path.read_text()))
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


def test_anchors_table_is_the_committed_runs():
    from tools import anchors

    readme = (ROOT / "notebooks" / "README.md").read_text()
    assert anchors.committed_table(readme) == anchors.table(), (
        "notebooks/README.md's anchors differ from data/results: "
        "run `python tools/anchors.py --write`")


def test_reading_table_lists_every_lecture():
    readme = (ROOT / "notebooks" / "README.md").read_text()
    table = readme[:readme.index("\n## ")]
    missing = [p.name for p in NOTEBOOKS if f"`{p.name}`" not in table]
    assert not missing, f"notebooks/README.md's reading table leaves out {missing}"


# The checks above, on the outputs of notebooks 02 and 03 as they were committed before this file
# existed: each must have been caught.
OLD_02_CELL_21 = (
    "@triton.jit\ndef rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, USE_PDL: tl.constexpr):\n"
    "    pass\n")


def test_a_printed_source_with_a_parameter_since_removed_is_stale():
    nb = {"cells": [
        {"cell_type": "code", "source": ["from kernels.rmsnorm import triton_rmsnorm\n"],
         "outputs": []},
        {"cell_type": "code",
         "source": ["print(inspect.getsource(triton_rmsnorm.rmsnorm_fwd_kernel.fn))"],
         "outputs": [{"output_type": "stream", "name": "stdout", "text": [OLD_02_CELL_21]}]}]}
    assert stale_sources(nb) == ["cell 1: triton_rmsnorm.rmsnorm_fwd_kernel.fn prints an older "
                                 "source than today's"]
    today = inspect.getsource(_python_function(
        _imports(nb)["triton_rmsnorm"].rmsnorm_fwd_kernel))
    nb["cells"][1]["outputs"][0]["text"] = [today]
    assert stale_sources(nb) == []


def _opened(prose: str, setup_line: str) -> dict:
    return {"cells": [
        {"cell_type": "markdown", "source": [prose]},
        {"cell_type": "code", "source": [""],
         "outputs": [{"output_type": "stream", "name": "stdout", "text": [setup_line + "\n"]}]}]}


def test_the_opening_must_match_the_setup_cell():
    h100 = "GPU mode: NVIDIA H100 80GB HBM3 (sm_90, 132 SMs), torch 2.11.0"
    cpu = "CPU mode: Triton interpreter (TRITON_INTERPRET=1), torch 2.13.0+cpu"
    said_h200 = "**Where the outputs come from**: one run on an NVIDIA H200 (`data/results/h200/`)."
    said_h100 = "**Where the outputs come from**: one run on an NVIDIA H100 80GB HBM3."
    said_cpu = "**Where the outputs come from**: committed from CPU mode, an H200's recorded run."
    assert origin_problems(_opened(said_h200, h100))
    assert origin_problems(_opened(said_h200, cpu))
    assert origin_problems(_opened("No word on it.", cpu))
    assert not origin_problems(_opened(said_h100, h100))
    assert not origin_problems(_opened(said_cpu, cpu))


GLOSSARY_LINK = re.compile(r"\]\(README\.md#([\w-]+)\)")


def test_glossary_links_land_on_a_term():
    readme = (ROOT / "notebooks" / "README.md").read_text()
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', readme))
    linked = {}
    for path in NOTEBOOKS:
        for cell in json.loads(path.read_text())["cells"]:
            for term in GLOSSARY_LINK.findall("".join(cell["source"])):
                linked.setdefault(term, path.name)
    first_uses = {"cta", "tma", "ulp", "warpgroup", "wgmma", "occupancy", "sector", "sm", "l2"}
    assert first_uses <= set(linked), first_uses - set(linked)
    missing = {term: name for term, name in linked.items() if term not in anchors}
    assert not missing, f"links to glossary terms notebooks/README.md does not define: {missing}"
