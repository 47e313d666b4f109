# The course's commands. Each target sets up .venv first (once, and again when the pins change).
# PYTHON builds the venv; STACK picks the software stack (auto, gpu, gpu-cu12, cpu or system:
# tools/setup_env.py; auto reads the driver's CUDA version from nvidia-smi).
PYTHON ?= python3
STACK ?= auto
# The optional parts of pyproject.toml to install (test: pytest, nbval, ruff; lab: JupyterLab; browser).
EXTRAS ?= test,lab,browser
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The browser test (tests/browser) drives JupyterLab in this chromium; BROWSER_TEST=0 leaves it out.
CHROMIUM ?= /usr/bin/chromium
export CHROMIUM
BROWSER_TEST ?= 1
export BROWSER_TEST
# The class-grading test runs a one-node Slurm cluster (make slurm); SLURM_TEST=0 leaves it out.
SLURM_TEST ?= 1
ARTIFACTS := build/test-artifacts/browser

.PHONY: setup grade calibrate lint test lab labs browser slurm refresh-gpu sandbox

$(STAMP): pyproject.toml constraints.txt constraints-gpu.txt constraints-gpu-cu12.txt \
		constraints-cpu.txt tools/setup_env.py
	$(PYTHON) tools/setup_env.py --stack $(STACK) --venv $(VENV) --extras $(EXTRAS)
	touch $(STAMP)

# Builds .venv again, with the stack that fits this machine, and says which it chose.
setup:
	@rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

# Grade the labs in labs/ (your work): reports in grading-reports/, with benchmark.md (and, on a GPU,
# benchmark.png): your kernels against the expected table for your GPU, a page to hand in.
grade: $(STAMP)
	$(BIN)/python -m grading labs --out grading-reports
	$(BIN)/python -m grading.student_report grading-reports

# This GPU's expected rows, measured here (python -m grading calibrate): the reports then show them,
# marked "measured on this machine", instead of the course's predicted rows. Needs a GPU.
calibrate: $(STAMP)
	$(BIN)/python -m grading calibrate

# ruff (rules and line length in pyproject.toml) over the course's Python; the teaching code in
# kernels/ and tools/ is also held to ruff's formatting.
lint: $(STAMP)
	$(BIN)/ruff check kernels grading tests tools
	$(BIN)/ruff format --check kernels tools

# Kernel, grader and lab tests, every notebook executed by nbval (CPU: Triton interpreter), and the
# browser test: JupyterLab runs the lab and its solution in headless chromium (screenshots in $(ARTIFACTS)).
# TESTS narrows the run to some of these paths (e.g. TESTS=tests, or TESTS="notebooks solutions").
TESTS ?= tests notebooks solutions
# pytest-xdist workers: 2 fits CI's two cores; the grader's timing tests want few beside them on a GPU.
JOBS ?= 2
# Threads for each worker's torch (OpenMP) and BLAS: the machine's cores shared among the JOBS workers.
# OpenMP's idle threads spin, so a worker with more threads than its share takes CPU from the others:
# on CI's 2 cores, 2 threads a worker ran the notebooks in 139 s and 1 thread in 112 s.
TEST_THREADS ?= $(shell $(PYTHON) -c "import os; print(max(1, len(os.sched_getaffinity(0)) // $(JOBS)))")
test: $(STAMP) lint sandbox $(if $(filter 1,$(SLURM_TEST)),slurm) $(if $(filter 1,$(BROWSER_TEST)),browser)
	@rm -rf $(ARTIFACTS)
	@left_out=""; \
	[ "$(BROWSER_TEST)" = 1 ] || left_out="not browser"; \
	[ "$(SLURM_TEST)" = 1 ] || left_out="$${left_out:+$$left_out and }not slurm"; \
	status=0; OMP_NUM_THREADS=$(TEST_THREADS) OPENBLAS_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS) \
		$(BIN)/python -m pytest -n $(JOBS) --dist loadfile $(TESTS) --nbval-lax --nbval-current-env --durations=8 \
		$${left_out:+-m "$$left_out"} || status=$$?; \
	for f in $(ARTIFACTS)/*.png; do [ -e "$$f" ] && echo "browser test screenshot: $$f"; done; \
	[ -z "$$left_out" ] || echo "BROWSER_TEST=$(BROWSER_TEST) SLURM_TEST=$(SLURM_TEST): deselected ($$left_out)"; \
	exit $$status

# Debian's bubblewrap, the sandbox the grader runs a student's code in (grading/sandbox.py), installed
# once like chromium below. Without it the grader still grades (and says so); its sandbox tests skip.
sandbox:
	@if command -v bwrap >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "bwrap (bubblewrap) not found: install it to grade in a sandbox (grading/README.md)." >&2; \
		exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; else sudo="sudo -n"; fi; \
	echo "installing Debian's bubblewrap for the grader's sandbox (apt-get)"; \
	for try in 1 2 3; do \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
			--no-install-recommends bubblewrap >/dev/null && exit 0; \
		echo "apt-get failed (try $$try of 3)" >&2; sleep 5; \
	done; \
	echo "Could not install bubblewrap (root or passwordless sudo needed): the grader runs" \
		"without a sandbox until it is installed (grading/README.md)." >&2

# Debian's chromium for the browser test, installed once (apt-get, as root or through sudo -n). Playwright
# never downloads a browser: the test launches this one.
browser:
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	if [ "$(CHROMIUM)" != /usr/bin/chromium ] || ! command -v apt-get >/dev/null 2>&1; then \
		echo "The browser test needs chromium at $(CHROMIUM): install it, or set CHROMIUM=/path/to/chromium," \
			"or run 'make test BROWSER_TEST=0' to leave the browser test out." >&2; exit 1; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; else sudo="sudo -n"; fi; \
	echo "installing Debian's chromium for the browser test (apt-get)"; \
	for try in 1 2 3; do \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
			--no-install-recommends chromium >/dev/null && exit 0; \
		echo "apt-get failed (try $$try of 3)" >&2; sleep 5; \
	done; \
	echo "Could not install chromium (root or passwordless sudo needed): install it yourself," \
		"or run 'make test BROWSER_TEST=0'." >&2; exit 1

# Debian's Slurm and munge for the class-grading test (tests/test_grader_classroom.py starts a one-node
# cluster on localhost in a temporary folder), installed once like chromium above.
SLURM_PROGRAMS := munged slurmctld slurmd sbatch squeue sinfo scancel
slurm:
	@if [ -z "$$(for p in $(SLURM_PROGRAMS); do PATH=$$PATH:/usr/sbin command -v $$p >/dev/null || echo $$p; done)" ]; then \
		exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1; then \
		echo "The class-grading test needs Slurm and munge ($(SLURM_PROGRAMS)): install them." >&2; exit 1; fi; \
	if [ "$$(id -u)" = 0 ]; then sudo=; else sudo="sudo -n"; fi; \
	echo "installing Debian's slurmctld, slurmd, slurm-client and munge for the class-grading test (apt-get)"; \
	for try in 1 2 3; do \
		$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
			--no-install-recommends slurmctld slurmd slurm-client munge >/dev/null && exit 0; \
		echo "apt-get failed (try $$try of 3)" >&2; sleep 5; \
	done; \
	echo "Could not install Slurm (root or passwordless sudo needed): install slurmctld, slurmd," \
		"slurm-client and munge yourself." >&2; exit 1

# JupyterLab on the course, with this environment's Python as the kernel: the "python3" kernel spec that
# ipykernel installs into .venv names `python`, which Jupyter runs as the server's own interpreter, and
# JUPYTER_PREFER_ENV_PATH=1 puts .venv's kernel specs before any in your home directory.
lab: $(STAMP)
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/jupyter lab --notebook-dir=. $(if $(filter 0,$(shell id -u)),--allow-root)

# On a GPU model the tables lack (instructors): re-measure the benchmarks, record this GPU's rows of
# the expected tables, re-execute the notebooks, and list what changed. PHASES picks some of them.
PHASES ?= bench grade notebooks
refresh-gpu: $(STAMP)
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/python tools/refresh_gpu.py $(PHASES)

# Regenerate labs/ from solutions/ (instructors: after editing a solution notebook).
labs: $(STAMP)
	$(BIN)/python -m grading.make_labs
