"""What runs where: notebooks/WHERE_IT_RUNS.md, generated from kernels/feature_table.py.

    python tools/where_it_runs.py          # rewrite notebooks/WHERE_IT_RUNS.md

One row per lecture, one column per class of GPU. A cell says how the course knows (run on that
GPU, run on an H200 taking that GPU's paths, or compiled only by tools/compile_all.py), then what
the lecture's kernels do there: the portable paths taken and what is refused.
tests/test_compile_all_archs.py checks that the committed file is what this prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "notebooks" / "WHERE_IT_RUNS.md"

# (column heading, the architecture whose features it has, the KERNELS_GPU_PROFILE run on an H200)
GPU_CLASSES = [
    ("T4", "sm_75", None),
    ("A100, A10, RTX 30xx", "sm_80", "a100"),
    ("L4, RTX 40xx", "sm_89", "rtx4090"),
    ("H100, H200", "sm_90", None),
    ("B200", "sm_100", None),
    ("RTX 50xx", "sm_120", None),
]
# (number, lecture, its kernels: module prefixes of feature_table.KERNELS); None: no GPU kernel
LECTURES = [
    ("00", "Timing GPU code honestly", ("elementwise_add.",)),
    ("00p", "Profiling", ("profiling.",)),
    ("01", "Element-wise add", ("elementwise_add.",)),
    ("02", "RMSNorm (PDL, fp8 input)", ("rmsnorm.",)),
    ("02b", "Matrix multiply", ("matmul.",)),
    ("03", "Flash attention", ("flash_attention.triton_",)),
    ("03h", "Flash attention in Gluon (Hopper)", ("flash_attention.gluon_",)),
    ("04", "Mixed precision (fp8)", ("mixed_precision.",)),
    ("05", "Memory profiling", ("memory_profiling.",)),
    ("06", "Mixture of experts", ("moe.",)),
    ("06b", "The grouped GEMM (TMA)", ("moe.triton_grouped_gemm",)),
    ("07", "Decoder", ("decoder.",)),
    ("07b", "The decode step as one persistent kernel", ("decoder.triton_persistent_step",)),
    ("08", "Communication (gloo, CPU processes)", None),
]
# What ran on an H200 in each KERNELS_GPU_PROFILE mode (data/results/h200/gpu-profiles/): the GPU
# tests of the lectures with gated paths, and the notebooks executed whole.
EMULATED_TESTS = {
    "a100": ("02", "02b", "03", "03h", "04", "06", "06b", "07b"),
    "rtx4090": ("02", "02b", "03", "03h", "04", "06", "06b", "07b"),
}
EMULATED_NOTEBOOKS = {
    "a100": ("02", "02b", "03", "03h", "04", "06"),
    "rtx4090": ("02", "02b", "03", "03h", "04", "06"),
}
# The Hopper GPUs each lecture ran on, where not both (the H100 runs predate these modules).
RAN_ON_HOPPER = {"02b": "H200", "07b": "H200"}
# What a missing feature means for the lecture, where the kernel has a portable path.
PORTABLE_WORDS = {"pdl": "PDL off", "fp8": "fp8 via float32", "tma": "TMA off"}


def _refuses_bf16(kernel: str) -> bool:
    """Whether the kernel's wrappers check their operands with kernels.validate's product checks,
    which refuse bf16 where there is no bf16 MMA (sm_75)."""
    module = kernel.split(":")[0].replace(".", "/")
    text = (ROOT / "kernels" / f"{module}.py").read_text()
    return any(check in text for check in ("check_operands", "check_matmul_args", "check_inputs("))


def cell(lecture: str, prefixes: tuple[str, ...] | None, arch: str, profile: str | None) -> str:
    from kernels import feature_table

    if prefixes is None:
        return "no GPU kernel"
    kernels = [k for k in feature_table.KERNELS if k.startswith(prefixes)]
    if not kernels:
        return "not in the compile check yet"
    refused = [k for k in kernels if arch in feature_table.cannot_exist(k)]
    if len(refused) == len(kernels):
        needs = sorted({f for k in refused for f in feature_table.missing(k, arch)})
        return f"refused: needs {', '.join(needs)}"
    if arch == "sm_90":
        how = f"run ({RAN_ON_HOPPER.get(lecture, 'H100, H200')})"
    elif profile is not None and lecture in EMULATED_NOTEBOOKS.get(profile, ()):
        how = f"compiled; tests and notebook run on an H200 as {profile}"
    elif profile is not None and lecture in EMULATED_TESTS.get(profile, ()):
        how = f"compiled; tests run on an H200 as {profile}"
    else:
        how = "compiled"
    notes = []
    portable = {
        f
        for k in kernels
        if k not in refused and feature_table.KERNELS[k][1] is not None
        for f in feature_table.missing(k, arch)
    }
    notes += [PORTABLE_WORDS[f] for f in sorted(portable)]
    for kernel in refused:
        notes.append(
            f"no {kernel.split(':')[1]} ({', '.join(feature_table.missing(kernel, arch))})"
        )
    if not feature_table.features_of(arch).bf16 and any(_refuses_bf16(k) for k in kernels):
        notes.append("bf16 products refused (fp16)")
    return how + "".join(f"; {note}" for note in notes)


def table() -> str:
    """The markdown of notebooks/WHERE_IT_RUNS.md."""
    from kernels.runtime import FEATURE_GPUS

    head = "| lecture | " + " | ".join(f"{name} ({arch})" for name, arch, _ in GPU_CLASSES) + " |"
    lines = [
        "# What runs where",
        "",
        "Generated by `python tools/where_it_runs.py` from `kernels/feature_table.py`: edit those,"
        " not this file.",
        "",
        "*run*: the lecture's kernels and tests ran on that GPU. *tests (and notebook) run on an "
        "H200 as a100/rtx4090*: the lecture's GPU tests (and its notebook, executed whole) ran on "
        "an H200 with `KERNELS_GPU_PROFILE` set, taking that GPU's code paths and "
        "shared-memory budget (the kernels were still compiled for sm_90); in both modes every "
        "lab's solution was graded on that H200 with full points "
        "(`data/results/h200/gpu-profiles/`). *compiled*: every kernel compiles for that "
        "architecture (`tools/compile_all.py` with the GPU stacks' Triton, run in CI) but has not "
        "run on it. Expected times for GPUs the course has not measured are predicted, not "
        "measured: the grader's reports say so.",
        "",
        head,
        "|---|" + "---|" * len(GPU_CLASSES),
    ]
    for number, title, prefixes in LECTURES:
        cells = [cell(number, prefixes, arch, profile) for _, arch, profile in GPU_CLASSES]
        lines.append(f"| {number} {title} | " + " | ".join(cells) + " |")
    lines += ["", "The features, and the GPUs that have them:", ""]
    lines += [f"- {feature}: {gpus}" for feature, gpus in FEATURE_GPUS.items()]
    lines += [
        "",
        "Where a lecture's cell needs a feature the GPU lacks, the notebook shows the committed "
        "run of a GPU that has it and says why; the kernels refuse with one sentence naming the "
        "feature (`runtime.FeatureMissing`), never a crash.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    OUTPUT.write_text(table())
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
