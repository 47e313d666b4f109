"""Grade one lab notebook in this process; `python -m grading` runs one of these per lab.

Running each lab in its own process means a crash, a hang or a corrupted CUDA context costs that lab
only. The worker builds a module from the notebook's solution cells (and the source's locked cells) in a
temporary directory -- never in the student's folder -- imports it, and checks each graded function.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path


def grade(notebook: Path, source: Path, lab_id: str, seed: int) -> dict:
    import nbformat

    from grading.harness import check_function
    from grading.labs import get_lab
    from grading.notebooks import solution_module
    from kernels import runtime

    lab = get_lab(lab_id)
    result = {"lab": lab_id, "title": lab.title, "notebook": str(notebook), "seed": seed,
              "fingerprint": runtime.fingerprint(), "notes": [], "functions": []}
    code, notes = solution_module(nbformat.read(notebook, as_version=4), nbformat.read(source, as_version=4))
    result["notes"] = notes
    # Triton reads a kernel's source with inspect, so the module must be a real file.
    workdir = Path(tempfile.mkdtemp(prefix=f"grading-{lab_id}-"))
    module_path = workdir / f"student_{lab_id}.py"
    module_path.write_text(code)
    spec = importlib.util.spec_from_file_location(module_path.stem, module_path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any error in the student's cells
        result["import_error"] = f"{type(exc).__name__}: {exc}"
        module = None
    for fn_spec in lab.functions:
        fn = getattr(module, fn_spec.name, None) if module else None
        fr = check_function(lab, fn_spec.name, fn, seed=seed)
        if module is None:
            fr.status, fr.message = "error", f"the solution cells failed to run: {result['import_error']}"
        result["functions"].append(fr.as_dict())
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--notebook", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--lab", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["KERNELS_MODE"] = "cpu"
    result = grade(args.notebook, args.source, args.lab, args.seed)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
