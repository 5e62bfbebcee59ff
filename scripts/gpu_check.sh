#!/usr/bin/env bash
# The whole CUDA test suite, the benchmarks and (on a machine with a second GPU) the memory
# checker, in one call on a GPU machine (the device tool's H200s: `run` with command
# `bash scripts/gpu_check.sh` and carry [".whl"]). Logs go to $OUT.
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
gpus=$(nvidia-smi -L | wc -l)
sanitizer=""
if [ "$gpus" -ge 2 ] && [ -z "${NO_SANITIZE:-}" ]; then
    # compute-sanitizer on the second GPU while the tests run on the first.
    CUDA_VISIBLE_DEVICES=1 OUT="$OUT" SANITIZE_TIMEOUT="${SANITIZE_TIMEOUT:-420}" \
        bash scripts/sanitize.sh >"$OUT/sanitize.out" 2>&1 &
    sanitizer=$!
fi
# pytest-xdist spreads the suite (compiles dominate) over the machine's cores: about 380 s on
# 28 workers of a 2-GPU machine, longer while the sanitizer shares it (bench below runs after).
workers=${WORKERS:-$(( $(nproc) > 30 ? 28 : $(nproc) - 2 ))}
timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -q -n "$workers" -p no:cacheprovider -rfEs \
    tests compile_tests 2>&1 | tee "$OUT/pytest.log" | grep -v "^DEBUG" | tail -40
timeout 120 python3 -m sdm_ops.bench 2>&1 | tee "$OUT/bench.log"
timeout 60 python3 -m sdm_ops.bench_topk 2>&1 | tee "$OUT/bench_topk.log"
if [ -n "$sanitizer" ]; then
    wait "$sanitizer"
    echo "sanitize.sh exit status: $?"
    tail -5 "$OUT/sanitize.out"
fi
