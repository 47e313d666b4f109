"""The setup check at the top of every notebook (`kernels.runtime.setup_report`).

What it prints here, and the one sentence of advice it gives on each kind of misconfigured machine
(facts made up)."""

import pytest

from kernels import runtime

GOOD_GPU = {
    "mode": "gpu",
    "forced": None,
    "gpu": "NVIDIA H200",
    "compute_capability": "9.0",
    "nvidia_smi": True,
    "driver": "580.159.04",
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "triton": "3.6.0",
    "cupy": "14.2.0",
    "cupy_package": "cupy-cuda13x",
    "cupy_ok": True,
    "cupy_why": "CuPy can run CUDA C kernels on this GPU.",
    "tf32": {
        "torch.backends.cuda.matmul.allow_tf32": False,
        "torch.backends.cudnn.allow_tf32": True,
        "float32_matmul_precision": "highest",
    },
    "python": "3.12.3",
    "executable": "/course/.venv/bin/python",
}
LAPTOP = {
    **GOOD_GPU,
    "mode": "cpu",
    "gpu": None,
    "compute_capability": None,
    "nvidia_smi": False,
    "driver": None,
    "torch": "2.13.0+cpu",
    "torch_cuda": None,
    "cupy_ok": False,
    "cupy_why": "CuPy kernels need an NVIDIA GPU; CPU mode runs only the Triton cells.",
}


def test_report_here_names_mode_versions_tf32_and_cupy():
    text = runtime.setup_report()
    assert text.splitlines()[0] == runtime.describe()
    for word in ("torch", "triton", "cupy", "TF32", "allow_tf32", "python"):
        assert word in text
    assert ("GPU mode" in text) == runtime.ON_GPU
    assert ("can run CUDA C kernels here" in text) == runtime.cupy_status()[0]
    assert "->" in text or "setup OK" in text


def test_good_gpu_machine_needs_nothing():
    assert runtime.setup_advice(GOOD_GPU) == []
    assert "setup OK" in runtime.setup_report(GOOD_GPU)


@pytest.mark.parametrize(
    "facts, expected",
    [
        # a laptop: not an error, but say what runs
        (LAPTOP, "No NVIDIA GPU here: the Triton cells run"),
        # CUDA 13 CuPy on an older driver
        (
            {
                **GOOD_GPU,
                "driver": "550.54",
                "cupy_ok": False,
                "cupy_why": "The NVIDIA driver is older than this CuPy's CUDA: "
                "install cupy-cuda12x instead of cupy-cuda13x.",
            },
            "pip install cupy-cuda12x",
        ),
        (
            {
                **GOOD_GPU,
                "cupy": None,
                "cupy_package": None,
                "cupy_ok": False,
                "cupy_why": "CuPy is not installed",
            },
            "CuPy is not installed",
        ),
        ({**GOOD_GPU, "triton": None}, "Triton is missing"),
        ({**LAPTOP, "nvidia_smi": True}, "CPU-only build"),
        (
            {**LAPTOP, "nvidia_smi": True, "torch_cuda": "13.0", "driver": "535.1"},
            "driver may be too old",
        ),
        (
            {**LAPTOP, "nvidia_smi": True, "torch_cuda": "13.0", "forced": "KERNELS_MODE=cpu"},
            "KERNELS_MODE=cpu forces",
        ),
    ],
)
def test_misconfigured_machine_gets_one_sentence_of_advice(facts, expected):
    advice = runtime.setup_advice(facts)
    assert len(advice) == 1, advice
    assert expected in advice[0]
    assert advice[0].endswith(".")
    assert expected in runtime.setup_report(facts)
