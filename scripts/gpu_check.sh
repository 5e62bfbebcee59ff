#!/usr/bin/env bash
# The whole CUDA test suite and the benchmarks, in one call on a GPU machine (the device tool's
# H200: `run` with command `bash scripts/gpu_check.sh` and carry [".whl"]). Logs go to $OUT.
# .whl/ holds the wheels the machine lacks (expecttest): see the device tool's README.
set -uo pipefail
OUT=${OUT:-/tmp/sdm_gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
# pytest-xdist spreads the suite (compiles dominate) over the machine's cores.
timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -n "${WORKERS:-12}" -p no:cacheprovider -rfE \
    tests compile_tests 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout 150 python3 -m sdm_ops.bench --no-reference 2>&1 | tee "$OUT/bench.log"
timeout 60 python3 -m sdm_ops.bench_topk 2>&1 | tee "$OUT/bench_topk.log"
