"""What the checks report: one case, one performance configuration, one graded function."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from grading.spec import GradedFunction


class ContextLost(RuntimeError):
    """The CUDA context is unusable (illegal memory access, device-side assert, ...): every later
    CUDA call in this process would fail too, so grading in this process must stop."""


@dataclass
class CaseResult:
    case: str
    ok: bool
    reason: str = ""
    comparison: dict | None = None
    detail: dict | None = None  # for failures: the inputs and the worst elements (`--explain`)


@dataclass
class PerfResult:
    config: str
    student_us: float | None = None
    reference_us: float | None = None
    torch_us: float | None = None
    spread_us: list[float] | None = None
    ratio_to_reference: float | None = None
    ratio_to_torch: float | None = None
    gbps: float | None = None
    nbytes: int | None = None
    percent_of_floor: float | None = None
    tier: str | None = None
    correct: bool | None = None
    note: str = ""
    expected: dict | None = None
    floor_us: float | None = None
    rounds: int | None = None  # timed repetitions, each with new inputs and its output checked
    wrong_rounds: int | None = None
    side_streams: int = 0  # side streams the function launched on (joined before timing ends)
    # Back-to-back calls timed by the grading process's clock (grading/performance.py `judge`)
    outside_us: float | None = None
    outside_reference_us: float | None = None
    outside_ratio: float | None = None
    outside_floor_us: float | None = None  # the floor, where the inputs cannot stay in L2


@dataclass
class FunctionResult:
    name: str
    backend: str
    description: str
    status: str  # "pass" | "fail" | "not implemented" | "needs a GPU" | "missing" | "error"
    points: int
    max_points: int
    message: str = ""
    cases: list[CaseResult] = field(default_factory=list)
    perf: list[PerfResult] = field(default_factory=list)
    seed: int | None = None
    extra_credit: bool = False

    @property
    def tier(self) -> str | None:
        tiers = [p.tier for p in self.perf if p.tier]
        return max(tiers) if tiers else None  # the worst letter: "F" > "D" > ... > "A"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tier"] = self.tier
        return d


def error_result(spec: GradedFunction, seed: int, status: str, message: str) -> dict:
    """The report entry of a function that could not be checked ("error", "needs a GPU", ...)."""
    return FunctionResult(spec.name, spec.backend, spec.description, status, 0, spec.points,
                          message, seed=seed, extra_credit=spec.extra_credit).as_dict()
