"""The lab specifications, by lab id (the notebook name without `_lab.ipynb`)."""
from __future__ import annotations

import importlib

LAB_MODULES = {
    "00_profiling": "grading.labs.lab00_profiling",
    "01_elementwise_add": "grading.labs.lab01_elementwise_add",
    "02_rmsnorm": "grading.labs.lab02_rmsnorm",
    "02b_matmul": "grading.labs.lab02b_matmul",
    "03_flash_attention": "grading.labs.lab03_flash_attention",
    "04_mixed_precision": "grading.labs.lab04_mixed_precision",
    "05_memory_profiling": "grading.labs.lab05_memory_profiling",
    "06_moe": "grading.labs.lab06_moe",
    "07_decoder": "grading.labs.lab07_decoder",
    "08_communication": "grading.labs.lab08_communication",
}


def get_lab(lab_id: str):
    if lab_id not in LAB_MODULES:
        raise KeyError(f"unknown lab {lab_id!r}; known labs: {', '.join(LAB_MODULES)}")
    return importlib.import_module(LAB_MODULES[lab_id]).LAB
