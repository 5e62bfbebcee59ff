#!/usr/bin/env bash
# Every Triton kernel under compute-sanitizer's memcheck, out-of-range indices included
# (tools/sanitize.py), on a GPU machine, from the repository root: `bash tools/sanitize.sh`.
# compute-sanitizer must reach the GPU itself (some sandboxed container runtimes refuse it).
# The log goes to $OUT/sanitize.log (OUT defaults to /tmp/sdm_sanitize); the exit status is 0
# only when memcheck found no error and every case passed. SANITIZE_TIMEOUT and
# SANITIZE_GRAPHS_TIMEOUT bound the two passes (seconds).
set -uo pipefail
OUT=${OUT:-/tmp/sdm_sanitize}
mkdir -p "$OUT"
LOG="$OUT/sanitize.log"
: >"$LOG"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
# Inductor compiles in this process: no compile workers for the sanitizer to follow.
export TORCHINDUCTOR_COMPILE_THREADS=1
unset PYTORCH_NO_CUDA_MEMORY_CACHING     # each pass below chooses its allocator
SANITIZER=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer \
    || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)}
if [ -z "$SANITIZER" ]; then
    echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee -a "$LOG"
    exit 2
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
"$SANITIZER" --version | tail -1

# --target-processes all: follow any child process that uses CUDA.
# --report-api-errors no: PyTorch probes the driver with calls that fail by design; they are
# not memory errors (a failed launch raises in Python and fails its case).
# A pass passes when memcheck exits 0 and its own output (kept apart from the log, which a
# caller may also be redirecting into) ends its cases with "all outputs equal".
memcheck() {   # memcheck SECONDS ARGS...
    local limit=$1 pass rc
    shift
    pass=$(mktemp)
    timeout "$limit" "$SANITIZER" --tool memcheck --error-exitcode 1 \
        --target-processes all --report-api-errors no \
        python3 tools/sanitize.py "$@" 2>&1 | tee -a "$LOG" | tee "$pass"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] && ! grep -q '^sanitize: .* cases, all outputs equal' "$pass"; then
        rc=1
    fi
    rm -f "$pass"
    echo "sanitize.sh: pass $* exit status $rc" | tee -a "$LOG"
    return "$rc"
}

status=0
# Without PyTorch's caching allocator each tensor is its own cudaMalloc, so memcheck sees an
# access just past a tensor (inside the allocator's shared blocks it would not).
# SANITIZE_PARTS picks the first pass's parts: where a run must fit a time limit, the eager
# part can run alone (SANITIZE_PARTS=eager) and the others in another (compiled,ops).
PYTORCH_NO_CUDA_MEMORY_CACHING=1 memcheck "${SANITIZE_TIMEOUT:-450}" \
    --parts "${SANITIZE_PARTS:-eager,compiled,ops}" || status=1
# CUDA graph capture allocates from the caching allocator: the graphs part runs with it.
memcheck "${SANITIZE_GRAPHS_TIMEOUT:-100}" --parts graphs || status=1
if grep -q "ERROR SUMMARY: [1-9]" "$LOG"; then
    echo "memcheck reported errors: see $LOG" | tee -a "$LOG"
    status=1
fi
echo "sanitize.sh: exit status $status" | tee -a "$LOG"
exit $status
