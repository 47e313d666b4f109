"""tools/offline_wheels.py: which requirements it follows, from the course and from each wheel.
(Its downloads were checked by hand against the set a GPU machine's `make setup` used.)"""

import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import offline_wheels  # noqa: E402

TARGET = {"python_version": "3.12", "sys_platform": "linux", "platform_machine": "x86_64"}


def test_course_requirements_follow_the_extras_asked_for():
    base = {r.name for r in offline_wheels.course_requirements([])}
    with_test = {r.name for r in offline_wheels.course_requirements(["test"])}
    assert {"torch", "transformers", "nbformat"} <= base and "nbval" not in base
    assert with_test - base >= {"nbval", "pytest", "ruff"}


def test_a_wheels_requirements_are_those_that_apply_on_the_target(tmp_path):
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    metadata = "\n".join([
        "Metadata-Version: 2.1", "Name: demo", "Version: 1.0",
        "Requires-Dist: always>=1",
        'Requires-Dist: old-pythons-only; python_version < "3.9"',
        'Requires-Dist: windows-only; sys_platform == "win32"',
        'Requires-Dist: docs-only; extra == "docs"',
        'Requires-Dist: linux-only; sys_platform == "linux"',
    ])  # fmt: skip
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("demo-1.0.dist-info/METADATA", metadata)
    names = [r.name for r in offline_wheels.wheel_requirements(wheel, TARGET)]
    assert names == ["always", "linux-only"]
