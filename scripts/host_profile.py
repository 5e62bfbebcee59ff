"""Where an eager call's host time goes (PERF_NOTES 59), on a GPU machine:
``PYTHONPATH=. python scripts/host_profile.py [--calls 20] [--top 30]``.

For the reference workload (float32 bank with decay, chunk 64) it prints, per case (the
inference forward, ``sparse_delta_memory`` without autograd; the in-place forward; forward+
backward): the median host wall time until the call returns (GPU idle before, as
``bench._time_ms`` times it) and the eager time by events; then a cProfile of ``--calls``
calls sorted by own time and by cumulative time. Last, the host cost of one launch three ways
for the WY solve's forward (the smallest operator: two kernels): through the operator
(``torch.ops.sdm.wy_solve``), through its launcher (``kernels.wy_solve.wy_solve_fwd``) and
through Triton's ``JITFunction.run`` of its first kernel alone, each the median over 200
calls with the GPU kept busy so that launches never wait.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from eager_vs_graph import host_ms
from sdm_ops import bench, ops
from sdm_ops.kernels import wy_solve as kw


def profile(fn, calls: int, top: int) -> None:
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        print(f"--- by {key}, {calls} calls ---")
        print("\n".join(line for line in s.getvalue().splitlines()[4:] if line.strip()))


def launch_us(fn, calls: int = 200) -> float:
    """Median host microseconds of ``fn`` behind a long kernel (so launches never wait)."""
    busy = torch.empty(2 ** 28, device="cuda")
    times = []
    for i in range(calls):
        if i % 50 == 0:
            torch.cuda.synchronize()
            for _ in range(20):
                busy.mul_(1.0)           # about 10 ms of GPU work queued ahead
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    a = bench.make_workload(8, 4096, 8, 64, 65536, 8, 8, decay=True, bank_dtype=torch.float32)
    cases = [("forward (no autograd)", bench.forward_fn(a, 64)),
             ("in place", bench.in_place_fn(a, 64)),
             ("forward+backward", bench.forward_backward_fn(a, 64))]
    for name, fn in cases:
        fn()
        print(f"=== {name}: host {host_ms(fn, args.calls):.3f} ms until it returns, "
              f"eager {bench._time_ms(fn):.3f} ms by events")
        profile(fn, args.calls, args.top)

    N, C = 4096, 64
    A = torch.randn(N, C, C, device="cuda") * 0.1
    beta = torch.rand(N, C, device="cuda")
    QK = torch.randn(N, C, C, device="cuda")
    X, QX = torch.empty_like(A), torch.empty_like(A)
    ops.wy_solve(A, beta, QK)
    diag, grid, (warps, stages) = kw._fwd_diag_kernel, (N, -(-C // kw.TILE)), kw._DIAG_CONFIG
    op = launch_us(lambda: ops.wy_solve(A, beta, QK))
    launcher = launch_us(lambda: kw.wy_solve_fwd(A, beta, QK, X, QX))
    alone = launch_us(lambda: diag[grid](A, beta, X, C=C, num_warps=warps, num_stages=stages))
    print(f"=== one WY solve forward (two kernels), host us a call: operator {op:.1f}, "
          f"launcher {launcher:.1f}, first kernel's JITFunction.run alone {alone:.1f}")


if __name__ == "__main__":
    main()
