#!/usr/bin/env bash
# The test suite on a CUDA GPU machine, from the repository root:
#
#   bash tools/gpu_suite.sh [all|fast|slow|multi_gpu] [more pytest arguments]
#
#   all (default)  every test but those that need two GPUs: -m "not multi_gpu"
#   fast           the same without the slow tests: -m "not slow and not multi_gpu"
#   slow           the slow tests alone (each takes minutes, most of it compiling): -m slow
#   multi_gpu      the tests that need two or more GPUs: -m multi_gpu (among them
#                  tests/test_distributed.py's DDP and FSDP2 runs on two GPUs), one test at a
#                  time (WORKERS default 0: no xdist), as each of them takes both GPUs
#
# fast and slow split `all` into two runs where each must fit a time limit. The markers are
# registered in pyproject.toml; tests/helpers.py's requires_cuda and requires_multi_gpu apply
# them. Wheels in .whl/ (packages the machine lacks: expecttest for the opcheck tests, fla-core
# and its einops for the peer comparisons) are installed into /tmp/site first; make them where
# PyPI is reachable with `pip download --no-deps -d .whl expecttest fla-core einops` (.whl/ is
# ignored by git). Triton's cache goes to TRITON_CACHE_DIR (default /tmp/sdm_triton_cache).
# WORKERS: pytest-xdist workers (default: the CPU count; multi_gpu: 0). PYTEST_TIMEOUT:
# seconds before the run is interrupted (default: none); pytest then still prints the
# failures so far. TESTS: the paths to collect (default "tests compile_tests"), to split a
# part over several runs. IDS: a file of test ids, one a line, to run only those (ids may hold
# spaces, which TESTS cannot pass); `python tools/suite_ids.py rest LOG...` writes the ids of
# the tests no earlier run's log reports, so a run cut by its limit is taken up where it
# stopped. OUT: a folder for the verbose log,
# $OUT/pytest-PART.log (a cut run still names what finished); stdout then gets the summary.
# Compiling the kernels takes most of a cold run, so the compile caches can travel between
# machines: with CACHE_OUT=1 the run packs Triton's and Inductor's caches into
# $OUT/compile-cache.tar.gz when it stays under 48 MiB (small enough to copy to the next
# machine with the repository), and a .tcache/compile-cache.tar.gz in the repository (copy
# the packed file there; .tcache/ is ignored by git) seeds both caches before the tests.
set -uo pipefail
part=${1:-all}
[ $# -gt 0 ] && shift
workers=$(nproc)
case "$part" in
    all) marks="not multi_gpu" ;;
    fast) marks="not slow and not multi_gpu" ;;
    slow) marks="slow and not multi_gpu" ;;
    multi_gpu) marks="multi_gpu" workers=0 ;;
    *) echo "usage: bash tools/gpu_suite.sh [all|fast|slow|multi_gpu] [pytest arguments]" >&2
       exit 2 ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/sdm_triton_cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/sdm_inductor_cache}
mkdir -p "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
if [ -f .tcache/compile-cache.tar.gz ]; then
    tar -xzf .tcache/compile-cache.tar.gz -C / && echo "compile caches seeded from .tcache/"
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
select=()
if [ -n "${IDS:-}" ]; then
    [ -f "$IDS" ] || { echo "gpu_suite.sh: IDS=$IDS is not a file" >&2; exit 2; }
    export SUITE_IDS=$(realpath "$IDS") PYTHONPATH="$PWD/tools:$PYTHONPATH"
    select=(-p suite_ids)
fi
cmd=(timeout -s INT -k 30 "${PYTEST_TIMEOUT:-0}" python3 -m pytest -n "${WORKERS:-$workers}" -p no:cacheprovider
     "${select[@]}" -rfEs --durations=15 -m "$marks" ${TESTS:-tests compile_tests} "$@")
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    "${cmd[@]}" -v >"$OUT/pytest-$part.log" 2>&1
    status=$?
    grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/pytest-$part.log" | tail -30
else
    "${cmd[@]}"
    status=$?
fi
echo "gpu_suite.sh $part: pytest exit status $status (124: cut by PYTEST_TIMEOUT)"
if [ -n "${CACHE_OUT:-}" ] && [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/compile-cache.tar.gz" -C / "${TRITON_CACHE_DIR#/}" "${TORCHINDUCTOR_CACHE_DIR#/}"
    size=$(stat -c %s "$OUT/compile-cache.tar.gz")
    if [ "$size" -gt $((48 * 1024 * 1024)) ]; then
        rm "$OUT/compile-cache.tar.gz"
        echo "compile caches not packed: $((size >> 20)) MiB, over 48 MiB"
    else
        echo "compile caches packed: $OUT/compile-cache.tar.gz, $((size >> 20)) MiB"
    fi
fi
exit $status
