"""`data/results/` reads as data: every cited path exists, every file is accounted for.

* Every path under `data/results/` that a notebook (sources and outputs), a README, a
  `PERFORMANCE.md`, an expected-results table or the code cites exists (a folder, a file, or a
  glob or `{a,b}` form that matches at least one file). Templates such as `<gpu>` are not paths.
* Every file under `data/results/` is cited by one of them, is what the code loads (a path built on
  `RESULTS_DIR` or a glob over it, found by reading the code), or is listed in the index,
  `data/results/README.md`.
* No folder is named by how it was made: no "sitting", "session" or "round".

Run as a script to list what is wrong: `python tests/test_results_layout.py`.
"""

import fnmatch
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "data/results"
CITED = re.compile(r"data/results/[\w./{},*<>-]*")
BAD_FOLDER_WORDS = ("sitting", "session", "round")
# A path built on RESULTS_DIR: `RESULTS_DIR / "h200" / f"{name}.json"`, or a glob over it.
BUILT = re.compile(r"RESULTS_DIR((?:\s*/\s*(?:f?\"[^\"]*\"|[\w.]+(?:\([^()]*\))?|\([^()]*\)))+)")
GLOBBED = re.compile(r"RESULTS_DIR\.r?glob\(\s*f?\"([^\"]+)\"")


def documents(root: Path) -> list[Path]:
    """The files whose citations must exist: notebooks, READMEs, performance logs, tables."""
    found = [root / "README.md", root / "notebooks" / "README.md", root / "grading" / "README.md"]
    for pattern in ("notebooks/*.ipynb", "labs/*.ipynb", "solutions/*.ipynb",
                    "kernels/*/PERFORMANCE.md", "data/**/README.md", "data/expected/*.yaml"):
        found += sorted(root.glob(pattern))
    return [p for p in found if p.is_file()]


def code(root: Path) -> list[Path]:
    return [p for d in ("kernels", "grading", "tools") for p in sorted((root / d).rglob("*.py"))]


def text_of(path: Path) -> str:
    """A notebook's cell sources and text outputs; any other file as it is."""
    if path.suffix != ".ipynb":
        return path.read_text(errors="replace")
    parts = []
    for cell in json.loads(path.read_text())["cells"]:
        parts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            parts.append("".join(out.get("text", "")))
            for value in out.get("data", {}).values():
                parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def expand(path: str) -> list[str]:
    """'a.{log,csv}' -> ['a.log', 'a.csv']."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",")
            for x in expand(path[:m.start()] + alt + path[m.end():])]


def citations(text: str) -> list[str]:
    """The data/results paths a text names, without templates (`<gpu>`, `{slug}`)."""
    out = []
    for raw in CITED.findall(text):
        path = raw.rstrip(".,")
        if "<" in path or ">" in path or re.search(r"\{[^{},]*(\}|$)", path):
            continue
        out += expand(path)
    return out


def matches(pattern: str, files: list[str]) -> list[str]:
    """Files (paths relative to the root) that a cited path names: itself, or what its glob
    matches. A folder names no file: each file in it must be cited or listed on its own."""
    if "*" in pattern:
        return [f for f in files if fnmatch.fnmatchcase(f, pattern + ("*" if pattern.endswith("/")
                                                                      else ""))]
    return [f for f in files if f == pattern]


def results_files(root: Path) -> list[str]:
    base = root / RESULTS
    return sorted(str(p.relative_to(root)) for p in base.rglob("*") if p.is_file())


def missing_citations(root: Path) -> list[str]:
    """'FILE: PATH' for each cited path under data/results that names nothing."""
    files = results_files(root)
    problems = []
    for doc in documents(root) + code(root):
        for path in citations(text_of(doc)):
            exists = (root / path).exists() if "*" not in path else bool(matches(path, files))
            if not exists:
                problems.append(f"{doc.relative_to(root)}: {path}")
    return problems


def loaded_patterns(root: Path) -> list[str]:
    """Paths the code builds on RESULTS_DIR, as globs relative to the root ('*' for what varies)."""
    patterns = []
    for path in code(root):
        text = path.read_text(errors="replace")
        for chain in BUILT.findall(text):
            parts = []
            for part in re.split(r"\s*/\s*", chain.strip())[1:]:
                literal = re.fullmatch(r"f?\"([^\"]*)\"", part)
                parts.append(re.sub(r"\{[^}]*\}", "*", literal.group(1)) if literal else "*")
            patterns.append("/".join([RESULTS, *parts]))
        for glob in GLOBBED.findall(text):
            patterns.append(f"{RESULTS}/{re.sub(r'{[^}]*}', '*', glob)}")
    return patterns


def loaded(path: str, patterns: list[str]) -> bool:
    """Whether a pattern names the file: segment by segment, so '*' never crosses a '/'."""
    parts = path.split("/")
    for pattern in patterns:
        want = pattern.split("/")
        if len(want) == len(parts) and all(map(fnmatch.fnmatchcase, parts, want)):
            return True
    return False


def indexed(root: Path) -> set[str]:
    """Files the index names: backticked paths relative to data/results, or to the folder of the
    `#` heading above them when the heading is a backticked folder."""
    index = root / RESULTS / "README.md"
    if not index.is_file():
        return set()
    listed, folder = set(), ""
    for line in index.read_text().splitlines():
        heading = re.match(r"#+\s+`([^`]+/)`", line)
        if heading:
            folder = heading.group(1)
            continue
        if line.startswith("#"):
            folder = ""
        for token in re.findall(r"`([^`\s]+)`", line):
            for name in expand(token):
                for base in {folder, ""}:
                    listed.add(f"{RESULTS}/{base}{name}".replace("//", "/"))
    return listed


def unaccounted(root: Path) -> list[str]:
    """Files under data/results that nothing cites, loads or lists."""
    files = results_files(root)
    cited = [c for doc in documents(root) + code(root) for c in citations(text_of(doc))]
    named = {f for c in cited for f in matches(c, files)}
    patterns = loaded_patterns(root)
    listed = indexed(root)
    return [f for f in files if f not in named and f not in listed and not loaded(f, patterns)
            and f != f"{RESULTS}/README.md"]


def badly_named_folders(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / RESULTS).rglob("*")
                  if p.is_dir() and any(w in p.name.lower() for w in BAD_FOLDER_WORDS))


def test_every_cited_results_path_exists():
    assert missing_citations(ROOT) == []


def test_every_results_file_is_cited_loaded_or_indexed():
    assert unaccounted(ROOT) == []


def test_no_results_folder_is_named_by_how_it_was_made():
    assert badly_named_folders(ROOT) == []


def test_the_checks_fail_on_a_broken_tree(tmp_path):
    """A tree with a bad citation, a stray file and a diary folder: each check reports it."""
    results = tmp_path / RESULTS / "h200"
    (results / "logs-third-sitting").mkdir(parents=True)
    (results / "03_attention.json").write_text("{}")
    (results / "logs-third-sitting" / "probe.log").write_text("")
    (tmp_path / "README.md").write_text(
        "See `data/results/h200/03_attention.json` and `data/results/h200/03_attention_old.json`.")
    (tmp_path / "kernels").mkdir()
    assert missing_citations(tmp_path) == ["README.md: data/results/h200/03_attention_old.json"]
    assert unaccounted(tmp_path) == [f"{RESULTS}/h200/logs-third-sitting/probe.log"]
    assert badly_named_folders(tmp_path) == [f"{RESULTS}/h200/logs-third-sitting"]
    (tmp_path / RESULTS / "README.md").write_text("## `h200/logs-third-sitting/`\n\n`probe.log`\n")
    assert unaccounted(tmp_path) == []


def test_paths_built_in_code_count_as_loaded():
    patterns = loaded_patterns(ROOT)
    assert loaded(f"{RESULTS}/h200/00_profiling/ncu_add.csv", patterns)
    assert not loaded(f"{RESULTS}/h200/03_flash_attention/gluon-forward/benchmark.log", patterns)


if __name__ == "__main__":
    report = {"cited but missing": missing_citations(ROOT), "not cited, loaded or indexed":
              unaccounted(ROOT), "folders named by how they were made": badly_named_folders(ROOT)}
    for title, items in report.items():
        print(f"{title}: {len(items)}")
        for item in items:
            print("  " + item)
    sys.exit(1 if any(report.values()) else 0)
