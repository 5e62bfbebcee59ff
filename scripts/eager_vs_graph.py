"""Eager against CUDA-graph time of the forward and the forward+backward, padded and packed
(PERF_NOTES entry 16), on a GPU: ``PYTHONPATH=. python scripts/eager_vs_graph.py``.

Per case: "eager", one call timed by events around it with the GPU idle before
(``bench._time_ms``); "graph", the same call replayed from a CUDA graph; "host", the median wall
time until the call returns (GPU idle before); "syncs", the synchronizing operations torch's
sync debug mode reports in one call. The packed batch is the bench's (8 sequences, 16380
tokens); the padded one is the reference workload, float32 bank with decay. (Entry 16's figures
came from this script's first, untidied form: the same calls and timings.)"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from sdm_ops import bench


def workloads(B=8, T=4096, H=8, D=64, S=65536, W=8, R=8, C=64) -> list:
    """(name, call) of the four cases: the bench's packed batch and the reference workload."""
    packed, cu, _ = bench.packed_workload(B, T, H, D, S, W, R)
    padded = bench.make_workload(B, T, H, D, S, W, R, decay=True, bank_dtype=torch.float32)
    return [("padded fwd", bench.forward_fn(padded, C)),
            ("packed fwd", bench.forward_fn(packed, C, cu_seqlens=cu)),
            ("padded fwd+bwd", bench.forward_backward_fn(padded, C)),
            ("packed fwd+bwd", bench.forward_backward_fn(packed, C, cu_seqlens=cu))]


def host_ms(fn, calls: int) -> float:
    """Median host wall time (ms) until ``fn`` returns, the GPU idle before each call."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def syncs_in(fn) -> int:
    """Synchronizing operations sync debug mode reports in one call of ``fn``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("called a synchronizing" in str(w.message) for w in caught)


def main() -> None:
    for name, fn in workloads():
        eager = bench._time_ms(fn, reps=10)
        graph = bench._time_ms(bench._captured(fn).replay, reps=10)
        print(f"{name:<16} eager {eager:.3f} ms  graph {graph:.3f} ms  "
              f"host {host_ms(fn, 5):.3f} ms  syncs {syncs_in(fn)}")


if __name__ == "__main__":
    main()
