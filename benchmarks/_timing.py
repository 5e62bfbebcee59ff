"""The benchmarks' one timer, and what else they count about a call on the GPU.

Every GPU time is a median of ``triton.testing.do_bench`` (the L2 cache flushed before each
call, CUDA events around it). ``graph_ms`` captures the call in a CUDA graph first and times
its replays: the kernels' time without the host's work between them (the figure a captured
training or decode step sees). ``eager_ms`` times the call itself, for what cannot be captured
and for the eager figure beside the graph's (the GPU waits for the host's launches wherever the
host is slower). ``host_ms`` is the host's wall time until an eager call returns.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable

import torch

# do_bench's budgets (milliseconds of calls): ``set_budget`` changes them for a whole run.
_BUDGET = {"rep": 100, "warmup": 25}


def set_budget(rep_ms: float, warmup_ms: float | None = None) -> None:
    """Milliseconds of repeated calls each measurement takes (at least one call), and of
    warm-up calls before them (a quarter of ``rep_ms`` unless given)."""
    _BUDGET["rep"] = rep_ms
    _BUDGET["warmup"] = rep_ms / 4 if warmup_ms is None else warmup_ms


def eager_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of one call of ``fn`` (``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=_BUDGET["warmup"], rep=_BUDGET["rep"], return_mode="median")


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn`` in a row, after two warm-up calls on a side
    stream (Triton compiles, the allocator and cuBLAS set up), as ``torch.cuda.graph``
    requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn: Callable[[], object], calls: int = 1) -> float:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls
    (``capture``; several calls a graph spread one replay's launch over them, for calls of a
    few microseconds). The graph's memory is freed before it returns."""
    graph = capture(fn, calls)
    try:
        return eager_ms(graph.replay) / calls
    finally:
        del graph
        gc.collect()
        torch.cuda.empty_cache()


def host_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """Median wall milliseconds until an eager call of ``fn`` returns, the GPU idle before
    each call (after one warm-up call): what the host spends launching it."""
    fn()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read and write bytes counted)."""

    def copy_ms(x: torch.Tensor) -> float:
        y = torch.empty_like(x)
        return eager_ms(lambda: y.copy_(x))

    ms = copy_ms(torch.empty(2**30, dtype=torch.uint8, device="cuda"))
    torch.cuda.empty_cache()
    return 2 * 2**30 / (ms * 1e-3)


def cuda_ops(fn: Callable[[], object]) -> dict[str, tuple[float, int]]:
    """Kernel (or device copy) name -> (total CUDA milliseconds, calls) over one call of
    ``fn``, profiled after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():  # that it keeps one cycle's events: one call is all
        warnings.filterwarnings("ignore", ".*Profiler clears events", UserWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = prof.events()
    totals: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            ms, calls = totals.get(e.name, (0.0, 0))
            totals[e.name] = (ms + e.device_time_total / 1e3, calls + 1)
    return totals


def peak_gib(fn: Callable[[], object]) -> float:
    """GiB allocated at the peak of one call of ``fn`` above what was allocated before it.
    Garbage is collected first: nothing allocated before may be freed inside the call (a
    collected CUDA graph's pool, say), or the peak above the base would read low."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def gpu_busy(fn: Callable[[], object], calls: int = 3) -> tuple[float, float]:
    """(busy, span) milliseconds of ``calls`` eager calls of ``fn`` in a row, profiled after
    a warm-up call: busy is the union of the kernels' (and device copies') intervals, span
    from the first one's start to the last one's end. Where busy falls short of span, the GPU
    waited for the host."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*Profiler clears events", UserWarning)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        events = prof.events()
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    busy, span = busy_and_span(spans)
    return busy / 1e3, span / 1e3


def busy_and_span(intervals) -> tuple[float, float]:
    """(length of the union of ``intervals``, from the first start to the last end) of
    ``(start, end)`` pairs in any order; (0, 0) for none."""
    spans = sorted(intervals)
    if not spans:
        return 0.0, 0.0
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    busy += end - start
    return busy, end - spans[0][0]  # sorted by start: the last merged run ends last
