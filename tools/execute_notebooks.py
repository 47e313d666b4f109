"""Execute notebooks in place with nbclient, keeping their outputs (the committed GPU outputs).

    python tools/execute_notebooks.py notebooks/01_elementwise_add.ipynb \
        solutions/01_elementwise_add_lab.ipynb

Each notebook runs in its own directory with the current Python as its kernel; a failing cell stops
that notebook (the error stays in its outputs) and the command exits non-zero.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def execute(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    start = time.perf_counter()
    try:
        client.execute()
        ok = True
    except CellExecutionError as exc:
        print(f"{path}: {str(exc).splitlines()[-1] if str(exc) else exc}", file=sys.stderr)
        ok = False
    except Exception as exc:  # noqa: BLE001 - a dead kernel or a timeout: keep the outputs so far, go on
        print(f"{path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        ok = False
    nbformat.write(nb, path)
    print(f"{path}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - start:.0f} s", flush=True)
    return ok


if __name__ == "__main__":
    results = [execute(Path(p)) for p in sys.argv[1:]]
    sys.exit(0 if all(results) else 1)
