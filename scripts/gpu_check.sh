#!/usr/bin/env bash
# The CUDA test suite, the benchmarks and (on a machine with a second GPU) the memory checker,
# on a GPU machine (the device tool's H200s: `run` with command `bash scripts/gpu_check.sh`
# and carry [".whl"]). Logs go to $OUT.
# .whl/ holds the wheels the machine lacks (expecttest): see the device tool's README.
#
# PART picks what runs, so that each fits one device call (10 minutes):
#   all (default)  the whole suite, then the benchmarks (a 2-GPU machine: about 380 s of tests,
#                  435 s at 0f42eca; with the sanitizer on the second GPU over 400 s, and then
#                  the benchmarks do not fit the same call: NO_SANITIZE=1, and the sanitizer a
#                  call of its own)
#   suite          the whole suite alone (a 2-GPU machine, 32 cores: 435 s at 0f42eca, 385 s at
#                  8941e40, 426 s at 653682b with the sanitizer on the other GPU; give it
#                  PYTEST_TIMEOUT=540)
#   compile        compile_tests and tests/test_opcheck.py (one H200, 16 cores: about 250 s;
#                  216 s at 20afbba, 266 s at 6e361bd, 227 s at d6e95b5, 247 s at 6933d93,
#                  273 s at 6c2eb13 with a compiling pytest beside it)
#   tests          the rest of tests/ (one H200: 386 s at a0057f1, 479 s at 20afbba, 442 at 6e361bd,
#                  385 s at d6e95b5, 489 s at 6933d93; at e61b4fd cut by PYTEST_TIMEOUT=560 with
#                  one test left, a widest product-key top-k case that alone takes 108 s, most
#                  of it compiling; the halves below split it)
#   tests-a        tests/'s kernel files: top-k, WY solve, bank copy, chunk prepare, reference,
#                  decode, properties, the sm_90 compile check (one H200: 447 s at 6635231;
#                  give it PYTEST_TIMEOUT=530; at 6c2eb13 cut at 530 s with the top-k case
#                  (4096, 2, 4096, 1), k = 100 left, which alone took 255 s, most of it
#                  compiling); without the widest top-k cases since 2026-12-02 (tests-b runs them)
#   tests-b        the widest top-k cases (beside, from the start), the rest of tests/ but
#                  test_opcheck.py (varlen, nn, validation, recurrence, backward, bench at
#                  e61b4fd): tests-a and
#                  tests-b are PART=tests (tests-b without the top-k cases: 172 s at 6635231,
#                  155 s at 6c2eb13; with them not yet timed)
#   topk           every test that launches the product-key top-k kernel (its own file, nn,
#                  properties, validation, opcheck, and compile_tests' ops, layer and CUDA-graph
#                  files), the widest cases beside as in tests-b (one H200: at e0db02f, by hand,
#                  422 passed in about 400 s with the widest 6 in 169 s beside; at b4e0b18 426
#                  passed in 335 s, the widest 6 in 228 s; at e64b3b8 428 in 365 s, the
#                  widest 6 in 162 s; at 0109c4e 443 in 302 s, the widest 6 in 143 s; at
#                  0f6609c 443 passed, 3 skipped in 349 s, the widest 6 in 178 s (365 s wall);
#                  at 75eee53 445 passed, 3 skipped in 313 s, the widest 6 in 121 s; at
#                  de363b1 445 and 3 in 278 s, the widest 6 in 121 s; at 7dfa939 445 and 3
#                  in 277 s, the widest 6 in 133 s; at 919e706 445 and 3 in 297 s, the widest
#                  6 in 148 s; at 01c19fd 445 and 3 in 293 s, the widest 6 in 153 s);
#                  the rest of the suite then fits one call:
#                  pytest -n 15 tests compile_tests --ignore= those files, 328 s; 420 s at
#                  de72bb7, 341 s at de363b1, 308 s at 7dfa939, 353 s at 919e706; 410 s at
#                  01c19fd with tests/test_examples.py)
#   bench          python -m sdm_ops.bench --addressing --scaling and python -m sdm_ops.bench_topk
#                  (one H200, fla-core carried: about 300 s before --addressing; at 653682b the
#                  run with --addressing reached only its second addressing row in 370 s, so
#                  the tables want calls of their own; on a 2-GPU machine the bench without
#                  either table had not finished after 330 s at 0f42eca, nor after 290 s at
#                  f609cb8, both times cut after the decode step, timing the fla-core peers; at
#                  d6e95b5 with BENCH_TIMEOUT=330 cut after the peers, before the packed batch,
#                  and `--no-reference --scaling` cut at 230 s in the peers: the
#                  addressing and scaling tables want a call of their own: `python3 -m
#                  sdm_ops.bench --tables-only --scaling`, about 90 s at f9ebed1)
#   ab             python scripts/ab_phase2.py over the package copies named in AB (default
#                  ".ab/main .ab/new"), float32 then bfloat16 bank, ROUNDS rounds (default 2),
#                  the snapshot mode SNAPSHOT (default none), the chunk size CHUNK (default 64);
#                  make each copy here with `mkdir -p .ab/NAME && git archive REV sdm_ops |
#                  tar -x -C .ab/NAME` and carry .ab (one H200; a few minutes)
# pytest runs with -v into $OUT/pytest.log (so a cut run still names what finished) and
# --durations=15.
set -uo pipefail
OUT=${OUT:-/tmp/sdm_gpu_check}
PART=${PART:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
# Triton's compile cache travels between device calls (each starts on a bare machine): with
# .tcache/triton.tar.gz here (carry .tcache), what an earlier call compiled is not compiled
# again; TCACHE_OUT=1 packs this call's cache into $OUT/triton.tar.gz, kept only under the
# 16 MiB a returned file may hold (PART=bench's kernels and fla-core's fit; the whole suite's
# may not): copy it to .tcache/ for the next call.
export TRITON_CACHE_DIR=/tmp/sdm_triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .tcache/triton.tar.gz ]; then
    tar -xzf .tcache/triton.tar.gz -C "$TRITON_CACHE_DIR" \
        && echo "Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) kernels from .tcache"
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
gpus=$(nvidia-smi -L | wc -l)
sanitizer=""
if [ "$PART" = all ] && [ "$gpus" -ge 2 ] && [ -z "${NO_SANITIZE:-}" ]; then
    # compute-sanitizer on the second GPU while the tests run on the first.
    CUDA_VISIBLE_DEVICES=1 OUT="$OUT" SANITIZE_TIMEOUT="${SANITIZE_TIMEOUT:-420}" \
        bash scripts/sanitize.sh >"$OUT/sanitize.out" 2>&1 &
    sanitizer=$!
fi
tests_a=(tests/test_product_key_topk.py tests/test_wy_solve.py tests/test_bank_copy.py
         tests/test_chunk_prepare.py tests/test_reference.py tests/test_decode.py
         tests/test_properties.py tests/test_kernels_compile_sm90.py)
# The widest top-k cases compile for minutes each (one-warp programs): tests-b, which has the
# time, runs them in a pytest of their own beside its own from the start (pytest-widest.log),
# so that they never start last.
widest=tests/test_product_key_topk.py::test_cuda_widest_factors_and_largest_k
case "$PART" in
    all|suite) targets=(tests compile_tests) ;;
    compile) targets=(compile_tests tests/test_opcheck.py) ;;
    tests) targets=(tests --deselect tests/test_opcheck.py) ;;
    tests-a) targets=("${tests_a[@]}" --deselect "$widest") ;;
    tests-b) targets=(tests --ignore=tests/test_opcheck.py "${tests_a[@]/#/--ignore=}") ;;
    topk) targets=(tests/test_product_key_topk.py --deselect "$widest" tests/test_nn.py
                   tests/test_properties.py tests/test_validation.py tests/test_opcheck.py
                   compile_tests/test_compile_ops.py compile_tests/test_compile_layer.py
                   compile_tests/test_cuda_graphs_layer.py) ;;
    bench|ab) targets=() ;;
    *) echo "unknown PART=$PART (all, suite, compile, tests, tests-a, tests-b, topk, bench, ab)"
       exit 2 ;;
esac
if [ "${#targets[@]}" -gt 0 ]; then
    # pytest-xdist spreads the suite (compiles dominate) over the machine's cores.
    workers=${WORKERS:-$(( $(nproc) > 30 ? 28 : $(nproc) - 1 ))}
    beside=""
    if [ "$PART" = tests-b ] || [ "$PART" = topk ]; then
        # The widest top-k cases, one worker each, beside the rest from the start.
        timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -v -n 6 -p no:cacheprovider -rfEs \
            --durations=6 "$widest" >"$OUT/pytest-widest.log" 2>&1 &
        beside=$!
        workers=$(( workers > 12 ? workers - 6 : workers / 2 + 1 ))
    fi
    timeout "${PYTEST_TIMEOUT:-420}" python3 -m pytest -v -n "$workers" -p no:cacheprovider \
        -rfEs --durations=15 "${targets[@]}" >"$OUT/pytest.log" 2>&1
    echo "pytest exit status: $? (124: cut by PYTEST_TIMEOUT)"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -20
    if [ -n "$beside" ]; then
        wait "$beside"
        echo "pytest (widest top-k cases) exit status: $? (124: cut by PYTEST_TIMEOUT)"
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-widest.log" | tail -8
    fi
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    timeout "${BENCH_TIMEOUT:-300}" python3 -m sdm_ops.bench --addressing --scaling 2>&1 \
        | tee "$OUT/bench.log"
    timeout 60 python3 -m sdm_ops.bench_topk 2>&1 | tee "$OUT/bench_topk.log"
fi
if [ "$PART" = ab ]; then
    # shellcheck disable=SC2086  # AB is a list of paths
    for dtype in float32 bfloat16; do
        timeout "${AB_TIMEOUT:-270}" python3 scripts/ab_phase2.py ${AB:-.ab/main .ab/new} \
            --bank-dtype "$dtype" --rounds "${ROUNDS:-2}" --snapshot "${SNAPSHOT:-none}" \
            --chunk-size "${CHUNK:-64}" 2>&1 \
            | tee -a "$OUT/ab.log"
    done
fi
if [ -n "$sanitizer" ]; then
    wait "$sanitizer"
    echo "sanitize.sh exit status: $?"
    tail -5 "$OUT/sanitize.out"
fi
if [ -n "${TCACHE_OUT:-}" ]; then
    tar -czf "$OUT/triton.tar.gz" -C "$TRITON_CACHE_DIR" .
    size=$(stat -c %s "$OUT/triton.tar.gz")
    if [ "$size" -gt 16000000 ]; then
        echo "Triton cache: $size bytes packed, too large to come back; not kept"
        rm -f "$OUT/triton.tar.gz"
    else
        echo "Triton cache: $(ls "$TRITON_CACHE_DIR" | wc -l) kernels," \
            "$size bytes in $OUT/triton.tar.gz"
    fi
fi
