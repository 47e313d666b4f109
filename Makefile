# The course's commands. Each target sets up .venv first (once, and again when the pins change).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup grade test lab labs

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Grade the labs in labs/ (your work): reports in grading-reports/.
grade: $(STAMP)
	$(BIN)/python -m grading labs --out grading-reports

# Kernel, grader and lab tests, and every notebook executed by nbval (CPU: Triton interpreter).
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile tests notebooks solutions --nbval-lax --nbval-current-env

# JupyterLab on the course, with this environment's Python as the kernel.
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=.

# Regenerate labs/ from solutions/ (instructors: after editing a solution notebook).
labs: $(STAMP)
	$(BIN)/python -m grading.make_labs
