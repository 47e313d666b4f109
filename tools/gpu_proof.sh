#!/usr/bin/env bash
# The proof on the GPU, in phases that each fit a 10-minute device call:
#   tests      the whole test suite in GPU mode (CuPy kernels, timing helpers, grader with performance)
#   bench      python -m kernels.<module>.benchmark -> data/results/<gpu>/<lab>.json
#   notebooks  execute notebooks and solutions in place (the outputs that are committed)
#   grade      grade solutions/ and labs/, record data/expected/ from the solutions' timings
# Offline GPU hosts get nbclient/ipykernel/nbval as wheels in .whl/ (../shared/scripts/offline-wheels.sh).
# Everything produced is packed into $OUT/results.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-proof}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site JUPYTER_PATH=/tmp/site/share/jupyter
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
slug=$(python3 -c "import kernels; print(kernels.runtime.gpu_info().slug)") || exit 1
mkdir -p "data/results/$slug"
python3 -c "import json, kernels; print(json.dumps(kernels.runtime.fingerprint(), indent=1))" > "data/results/$slug/environment.json"
status=0
for phase in "$@"; do
  echo "=== $phase"
  case $phase in
    tests) python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tee "$OUT/tests-$slug.log" || status=1 ;;
    bench) for module in elementwise_add rmsnorm flash_attention mixed_precision memory_profiling moe; do
             python3 -m "kernels.$module.benchmark" 2>&1 | tee "$OUT/bench-$module-$slug.log" || status=1
           done ;;
    notebooks) python3 tools/execute_notebooks.py notebooks/*.ipynb solutions/*.ipynb || status=1 ;;
    grade)
      python3 -m grading solutions --out "data/results/$slug/grading-solutions" --write-expected || status=1
      python3 -m grading labs --out "data/results/$slug/grading-labs" || status=1 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
cp "$OUT"/*.log "data/results/$slug/" 2>/dev/null
tar czf "$OUT/results.tgz" data notebooks solutions labs
exit $status
