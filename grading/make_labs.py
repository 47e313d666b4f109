"""Write labs/ from solutions/: `python -m grading.make_labs` (or `--check` to verify they
agree)."""

from __future__ import annotations

import argparse
import sys

import nbformat

from grading.notebooks import SOLUTIONS_DIR, lab_path_for, make_lab


def render(solution_path) -> str:
    return nbformat.writes(make_lab(nbformat.read(solution_path, as_version=4))) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if labs/ is not what solutions/ generates"
    )
    args = parser.parse_args(argv)
    stale = []
    for solution in sorted(SOLUTIONS_DIR.glob("*_lab.ipynb")):
        lab, text = lab_path_for(solution), render(solution)
        if args.check:
            if not lab.exists() or lab.read_text() != text:
                stale.append(lab)
        else:
            lab.parent.mkdir(parents=True, exist_ok=True)
            lab.write_text(text)
            print(f"wrote {lab.relative_to(lab.parents[1])}")
    if stale:
        print(
            "labs/ is out of date with solutions/ (run `python -m grading.make_labs`): "
            + ", ".join(p.name for p in stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
