"""Where the course's code runs: on a CUDA GPU, or on the CPU through the Triton interpreter.

The mode is decided once, when `kernels` is first imported, and everything else asks this module:

* **GPU mode** -- a CUDA device is visible. Triton compiles real kernels, CuPy runs CUDA C, timings
  use device events.
* **CPU mode** -- no CUDA device (or ``KERNELS_MODE=cpu``). ``TRITON_INTERPRET=1`` is set *before*
  Triton is imported, so every ``@triton.jit`` function runs in Triton's NumPy interpreter. CuPy
  kernels cannot run (they need a driver); their cells say so. Performance is "not measured".

The interpreter only understands that setting if it is in the environment before the first
``@triton.jit`` decorator executes; that is why ``kernels/__init__.py`` imports this module first
and why no notebook should import ``triton`` before ``kernels``.
"""

from __future__ import annotations

import datetime
import functools
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def _decide_mode() -> str:
    forced = os.environ.get("KERNELS_MODE", "").strip().lower()
    if forced not in ("", "gpu", "cpu"):
        raise ValueError(f"KERNELS_MODE must be 'gpu' or 'cpu', not {forced!r}")
    if forced == "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    import torch  # torch does not import triton, so the interpreter switch below is still in time

    if torch.cuda.is_available():
        return "gpu"
    if forced == "gpu":
        raise RuntimeError("KERNELS_MODE=gpu, but torch sees no CUDA device")
    return "cpu"


MODE: str = _decide_mode()
ON_GPU: bool = MODE == "gpu"
# What forced CPU mode, if anything (read before the line below sets TRITON_INTERPRET itself).
CPU_FORCED_BY: str | None = (
    None
    if ON_GPU
    else (
        "KERNELS_MODE=cpu"
        if os.environ.get("KERNELS_MODE", "").strip().lower() == "cpu"
        else "TRITON_INTERPRET=1"
        if os.environ.get("TRITON_INTERPRET") == "1"
        else None
    )
)
DEVICE: str = "cuda" if ON_GPU else "cpu"

# A process that only compiles for a GPU it does not have (`gluon_flash.compile_offline`) sets
# KERNELS_COMPILE_ONLY=1: CPU mode, but Triton compiles instead of interpreting.
COMPILE_ONLY: bool = not ON_GPU and os.environ.get("KERNELS_COMPILE_ONLY") == "1"

if not ON_GPU and not COMPILE_ONLY:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before kernels, so the CPU interpreter cannot be switched on. "
            "Restart the kernel and run `import kernels` before `import triton`."
        )
    os.environ["TRITON_INTERPRET"] = "1"
    from kernels import interpreter_poison, interpreter_speedup

    interpreter_speedup.install()
    interpreter_poison.install()  # masked lanes read without other= are NaN, not zeros

# Triton's CPU interpreter computes tl.dot on bfloat16 tiles wrongly. So in CPU mode the Triton
# kernels that call tl.dot take UPCAST=True and convert their tiles to float32 first (after the
# same rounding to the input dtype the GPU path does); on the GPU the tiles stay in their dtype and
# tl.dot runs on the tensor cores.
UPCAST: bool = not ON_GPU


def pick(gpu: T, cpu: T) -> T:
    """The problem size (or any setting) for the current mode.

    The interpreter's cost grows with the number of programs and loop trips, so CPU sizes are small
    and its blocks large; GPU sizes must fill the chip and exceed L2.
    """
    return gpu if ON_GPU else cpu


@functools.cache
def cupy_status() -> tuple[bool, str]:
    """(can CuPy kernels run here?, one sentence saying why not)."""
    if not ON_GPU:
        return False, "CuPy kernels need an NVIDIA GPU; CPU mode runs only the Triton cells."
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return (
            False,
            f"CuPy is not installed ({exc}); `pip install cupy-cuda13x` (driver >= 580) or "
            "cupy-cuda12x.",
        )
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CuPy raises its own CUDARuntimeError subclasses
        text = str(exc)
        if "InsufficientDriver" in text:
            return False, (
                "The NVIDIA driver is older than this CuPy's CUDA: install cupy-cuda12x instead of "
                "cupy-cuda13x."
            )
        return False, f"CuPy cannot reach the GPU: {text}"
    return True, "CuPy can run CUDA C kernels on this GPU."


def require_cupy() -> None:
    """Raise a clear error where CuPy kernels cannot run (used by every CuPy wrapper)."""
    ok, why = cupy_status()
    if not ok:
        raise RuntimeError(why)


def gpu_slug(name: str) -> str:
    """A GPU model's key in the expected tables: 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3'."""
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@dataclass(frozen=True)
class GpuInfo:
    name: str
    slug: str
    compute_capability: str
    sm_count: int
    memory_gib: float
    l2_bytes: int


@functools.cache
def gpu_info() -> GpuInfo | None:
    if not ON_GPU:
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return GpuInfo(
        name=props.name,
        slug=gpu_slug(props.name),
        compute_capability=f"{props.major}.{props.minor}",
        sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
        l2_bytes=props.L2_cache_size,
    )


# --------------------------------------------------------------------------------------------------
# What the GPU can do. Every kernel that uses a feature some GPUs lack asks `features()` (or
# `require`), never the GPU's name: one table, one sentence when a feature is missing.

# feature -> the GPUs that have it, for the sentence a refusal prints.
FEATURE_GPUS: dict[str, str] = {
    "bf16": "Ampere and newer (sm_80+: A100, A10, L4, RTX 30xx/40xx/50xx, H100, H200, B200)",
    "fp8": "Ada, Hopper and Blackwell (sm_89+: L4, RTX 40xx, H100, H200, B200, RTX 50xx)",
    "tma": "Hopper and Blackwell (sm_90+: H100, H200, B200, RTX 50xx)",
    "wgmma": "Hopper only (sm_90: H100, H200)",
    "warp_specialization": "Hopper only, as the course's Gluon kernels use it (sm_90: H100, H200)",
    "pdl": "Hopper and Blackwell (sm_90+: H100, H200, B200, RTX 50xx)",
}


@dataclass(frozen=True)
class Features:
    """What the kernels may use on this device (or on the device a compile targets or a profile
    emulates). `shared_memory_per_block` is the opt-in maximum a kernel may ask for."""

    name: str
    capability: tuple[int, int]
    shared_memory_per_block: int
    sm_count: int
    # Set when the course takes another GPU's choices on this one (KERNELS_GPU_PROFILE): the code
    # paths and shared-memory budget are that GPU's, but kernels still compile for this device,
    # named with its architecture ("NVIDIA H200 (sm_90)").
    emulated_on: str | None = None

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def fp8(self) -> bool:
        """fp8 e4m3 / e5m2 conversions and tensor-core products (Triton's fp8e4nv)."""
        return self.capability >= (8, 9)

    @property
    def tma(self) -> bool:
        return self.capability >= (9, 0)

    @property
    def wgmma(self) -> bool:
        return self.capability[0] == 9

    @property
    def warp_specialization(self) -> bool:
        """The course's Gluon kernels: warp-specialized with `setmaxnreg` and wgmma (sm_90)."""
        return self.capability[0] == 9

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (`griddepcontrol`)."""
        return self.capability >= (9, 0)

    @property
    def tensor_cores(self) -> str:
        major = self.capability[0]
        if major >= 12:
            return "mma.sync (Blackwell consumer)"
        if major == 10:
            return "tcgen05 (Blackwell)"
        if major == 9:
            return "wgmma (Hopper)"
        if major == 8:
            return "mma.sync (Ampere/Ada)"
        return "mma.sync fp16 only (Turing)"

    def has(self, feature: str) -> bool:
        if feature not in FEATURE_GPUS:
            raise ValueError(f"unknown feature {feature!r}; known: {sorted(FEATURE_GPUS)}")
        return bool(getattr(self, feature))


# The GPUs students bring: capability, opt-in shared memory per block, SMs (NVIDIA's specs).
GPU_PROFILES: dict[str, Features] = {
    "t4": Features("Tesla T4", (7, 5), 64 * 1024, 40),
    "a100": Features("A100 80GB", (8, 0), 163 * 1024, 108),
    "a10": Features("A10", (8, 6), 99 * 1024, 72),
    "rtx3090": Features("GeForce RTX 3090", (8, 6), 99 * 1024, 82),
    "l4": Features("L4", (8, 9), 99 * 1024, 58),
    "rtx4090": Features("GeForce RTX 4090", (8, 9), 99 * 1024, 128),
    "h100": Features("H100 80GB HBM3", (9, 0), 227 * 1024, 132),
    "h200": Features("H200", (9, 0), 227 * 1024, 132),
    "b200": Features("B200", (10, 0), 227 * 1024, 148),
    "rtx5090": Features("GeForce RTX 5090", (12, 0), 99 * 1024, 170),
}
# The architectures CI compiles every kernel for (tests/test_compile_all_archs.py).
COMPILE_ARCHS: tuple[str, ...] = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


class FeatureMissing(RuntimeError):
    """A kernel needs a feature this GPU lacks and has no portable path."""


def _profile_for_arch(arch: str) -> Features:
    major, minor = int(arch[3:-1]), int(arch[-1])
    for profile in GPU_PROFILES.values():
        if profile.capability == (major, minor):
            return profile
    return Features(arch, (major, minor), 99 * 1024, 80)


@functools.cache
def features() -> Features | None:
    """The device's features; None in CPU mode (the interpreter runs every portable path).

    `KERNELS_GPU_PROFILE=a100` (any key of GPU_PROFILES) on a GPU takes that GPU's capability,
    shared-memory budget and missing features, so its code paths run on the GPU in hand.
    `KERNELS_COMPILE_ONLY=1` with `KERNELS_TARGET_ARCH=sm_80` answers for the compile target."""
    if COMPILE_ONLY:
        return _profile_for_arch(os.environ.get("KERNELS_TARGET_ARCH", "sm_90"))
    if not ON_GPU:
        return None
    import torch

    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    real = Features(
        props.name,
        torch.cuda.get_device_capability(device),
        int(getattr(props, "shared_memory_per_block_optin", 48 * 1024)),
        props.multi_processor_count,
    )
    profile = os.environ.get("KERNELS_GPU_PROFILE", "").strip().lower()
    if not profile:
        return real
    if profile not in GPU_PROFILES:
        raise ValueError(
            f"KERNELS_GPU_PROFILE must be one of {sorted(GPU_PROFILES)}, not {profile!r}"
        )
    chosen = GPU_PROFILES[profile]
    if chosen.capability > real.capability:
        raise ValueError(
            f"KERNELS_GPU_PROFILE={profile}: a {real.name} cannot take the paths of a newer GPU"
        )
    return Features(
        chosen.name,
        chosen.capability,
        min(chosen.shared_memory_per_block, real.shared_memory_per_block),
        real.sm_count,
        emulated_on=f"{real.name} ({real.arch})",
    )


# What Triton's interpreter emulates: CPU mode runs these paths (wgmma, warp specialization and
# PDL are instructions it cannot execute).
INTERPRETED_FEATURES = ("bf16", "fp8", "tma")


def has(feature: str) -> bool:
    """Whether this device has `feature` (a key of FEATURE_GPUS). CPU mode: the interpreter has
    INTERPRETED_FEATURES."""
    found = features()
    if found is None:
        if feature not in FEATURE_GPUS:
            raise ValueError(f"unknown feature {feature!r}; known: {sorted(FEATURE_GPUS)}")
        return feature in INTERPRETED_FEATURES
    return found.has(feature)


def require(feature: str, what: str) -> None:
    """Raise FeatureMissing, one sentence naming the feature and the GPUs that have it, unless
    this device has `feature`. `what` names the kernel or cell that needs it."""
    if has(feature):
        return
    found = features()
    here = "the CPU interpreter" if found is None else f"this {found.name} ({found.arch})"
    raise FeatureMissing(
        f"{what} needs {feature}, which {here} lacks; it runs on {FEATURE_GPUS[feature]}."
    )


def emulation() -> str | None:
    """The sentence saying which GPU's choices this one takes (KERNELS_GPU_PROFILE), or None."""
    found = features()
    if found is None or found.emulated_on is None:
        return None
    real_name, real_arch = found.emulated_on.rsplit(" (", 1)
    return (
        f"emulating the {found.name} on the {real_name}: paths and shared-memory budget of "
        f"{found.arch}, kernels compiled for {real_arch.rstrip(')')}"
    )


def shared_memory_budget() -> int:
    """Bytes of shared memory a kernel may use per block here (sm_90's 227 KiB in CPU mode, so
    the interpreter runs the configurations the course picked for Hopper)."""
    found = features()
    return 227 * 1024 if found is None else found.shared_memory_per_block


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = (
                subprocess.run(
                    [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                    check=True,
                )
                .stdout.strip()
                .splitlines()
            )
            if out:
                return out[0].strip()
        except (subprocess.SubprocessError, OSError):
            pass
    return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a broken install should show as missing, not crash the fingerprint
        return None


@functools.cache
def _static_fingerprint() -> dict:
    import torch

    info = gpu_info()
    fp = {
        "mode": MODE,
        "gpu": info.name if info else None,
        "gpu_slug": info.slug if info else "cpu",
        "compute_capability": info.compute_capability if info else None,
        "sm_count": info.sm_count if info else None,
        "gpu_memory_gib": info.memory_gib if info else None,
        "l2_mib": round(info.l2_bytes / 2**20, 1) if info else None,
        "driver": _driver_version() if info else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cupy": _version("cupy"),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "hostname": platform.node(),
    }
    if emulation() is not None:  # only under KERNELS_GPU_PROFILE: default fingerprints unchanged
        fp["gpu_profile"] = os.environ["KERNELS_GPU_PROFILE"].strip().lower()
        fp["emulation"] = emulation()
    return fp


def fingerprint() -> dict:
    """The environment a number was measured in: store it beside every committed result."""
    fp = dict(_static_fingerprint())
    fp["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return fp


def describe() -> str:
    """One line saying where we are running, for the top of every notebook."""
    fp = _static_fingerprint()
    if ON_GPU:
        return (
            f"GPU mode: {fp['gpu']} (sm_{fp['compute_capability'].replace('.', '')}, "
            f"{fp['sm_count']} SMs), "
            f"torch {fp['torch']}, triton {fp['triton']}, cupy {fp['cupy']}, CUDA {fp['cuda']}"
            + (f"; {fp['emulation']}" if "emulation" in fp else "")
        )
    return (
        f"CPU mode: Triton interpreter (TRITON_INTERPRET=1), torch {fp['torch']}, triton "
        f"{fp['triton']}; "
        "CuPy cells and timings need a GPU"
    )


# --------------------------------------------------------------------------------------------------
# The setup check at the top of every notebook: where am I, with what, and what to fix.


def _tf32_flags() -> dict:
    import warnings

    import torch

    with warnings.catch_warnings():  # newer torch may flag the allow_tf32 attributes as legacy
        warnings.simplefilter("ignore")
        return {
            "torch.backends.cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "torch.backends.cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }


def _cupy_package() -> str | None:
    """The installed CuPy wheel's name (cupy-cuda13x, cupy-cuda12x, ...), or None."""
    from importlib import metadata

    try:
        names = metadata.packages_distributions().get("cupy") or []
    except Exception:  # noqa: BLE001 - broken metadata must not break the setup check
        return None
    return sorted(names)[0] if names else None


def setup_facts() -> dict:
    """What the setup check looks at: a plain dict, so `setup_advice` can take made-up facts."""
    import torch

    fp = _static_fingerprint()
    has_smi = shutil.which("nvidia-smi") is not None
    return {
        "mode": MODE,
        "forced": CPU_FORCED_BY,
        "gpu": fp["gpu"],
        "compute_capability": fp["compute_capability"],
        "nvidia_smi": has_smi,
        "driver": fp["driver"] if ON_GPU else (_driver_version() if has_smi else None),
        "torch": fp["torch"],
        "torch_cuda": torch.version.cuda,
        "triton": fp["triton"],
        "cupy": fp["cupy"],
        "cupy_package": _cupy_package() if fp["cupy"] else None,
        "cupy_ok": cupy_status()[0],
        "cupy_why": cupy_status()[1],
        "tf32": _tf32_flags(),
        "python": platform.python_version(),
        "executable": sys.executable,
    }


def setup_advice(facts: dict) -> list[str]:
    """One sentence per problem found, saying what to do; [] when all the course uses can run."""
    advice = []
    if facts["triton"] is None:
        advice.append(
            "Triton is missing: run `make setup` (or `pip install triton`); without it no Triton "
            "cell runs."
        )
    if facts["mode"] == "gpu":
        if not facts["cupy_ok"]:
            if facts["cupy"] is None:
                advice.append(
                    "CuPy is not installed: `pip install cupy-cuda13x` (NVIDIA driver 580 or "
                    "newer) or "
                    "`pip install cupy-cuda12x` (older drivers); until then only the Triton cells "
                    "run."
                )
            elif "older than this CuPy" in facts["cupy_why"]:
                advice.append(
                    f"The NVIDIA driver ({facts['driver'] or 'version unknown'}) is too old for "
                    f"{facts['cupy_package'] or 'this CuPy'} (CUDA 13 needs driver 580 or newer): "
                    "`pip uninstall cupy-cuda13x` then `pip install cupy-cuda12x`."
                )
            else:
                advice.append(
                    f"{facts['cupy_why']} Until that is fixed, only the Triton cells run."
                )
        return advice
    # CPU mode: on purpose, by a broken install, or because there is no GPU.
    if facts["forced"] and facts["nvidia_smi"]:
        advice.append(
            f"{facts['forced']} forces CPU mode: unset it and restart the kernel to use a GPU."
        )
    elif facts["nvidia_smi"] and facts["torch_cuda"] is None:
        advice.append(
            f"This machine has an NVIDIA GPU but torch {facts['torch']} is a CPU-only build: "
            "install "
            "a CUDA build of torch (then `make setup`) to use the GPU."
        )
    elif facts["nvidia_smi"]:
        advice.append(
            f"torch (built for CUDA {facts['torch_cuda']}) sees no GPU although nvidia-smi is "
            f"present (driver {facts['driver'] or 'unknown'}): the driver may be too old for this "
            "torch, or CUDA_VISIBLE_DEVICES hides the GPU."
        )
    else:
        advice.append(
            "No NVIDIA GPU here: the Triton cells run on the CPU in Triton's interpreter (small "
            "sizes); the CuPy and timing cells say that they need a GPU."
        )
    return advice


def setup_report(facts: dict | None = None) -> str:
    """The setup check atop every notebook: mode, versions, TF32 flags, CuPy, and advice."""
    f = setup_facts() if facts is None else facts
    lines = [describe() if facts is None else f"{f['mode'].upper()} mode"]
    if f["gpu"]:
        lines.append(
            f"  GPU      {f['gpu']}, compute capability {f['compute_capability']}, "
            f"driver {f['driver'] or 'unknown'}"
        )
    lines.append(f"  python   {f['python']} ({f['executable']})")
    lines.append(
        f"  torch    {f['torch']} "
        + (f"(CUDA {f['torch_cuda']})" if f["torch_cuda"] else "(CPU-only build)")
    )
    lines.append(f"  triton   {f['triton'] or 'NOT INSTALLED'}")
    cupy = (
        f"{f['cupy']} ({f['cupy_package']})"
        if f["cupy"] and f["cupy_package"]
        else (f["cupy"] or "not installed")
    )
    lines.append(
        f"  cupy     {cupy}: "
        + ("can run CUDA C kernels here" if f["cupy_ok"] else "cannot run here")
    )
    tf32 = f["tf32"]
    lines.append(
        f"  TF32     cuda.matmul.allow_tf32={tf32['torch.backends.cuda.matmul.allow_tf32']}, "
        f"cudnn.allow_tf32={tf32['torch.backends.cudnn.allow_tf32']}, "
        f"float32 matmul precision '{tf32['float32_matmul_precision']}'"
    )
    advice = setup_advice(f)
    if not advice:
        lines.append("  setup OK: every cell of the course runs here.")
    lines += [f"  -> {a}" for a in advice]
    return "\n".join(lines)
