"""Sweep launch configurations of the product-key top-k forward (``_product_key_topk_fwd``)
around the pinned one of ``_fwd_config(factors, k, itemsize)``: rows per program, warps and
factor chunk widths.

For each k the variants are the pinned configuration with ROWS in {1, 2, 4, 8, 16, 32},
num_warps in {1, 2, 4, 8} and the chunk width CF of every factor in {64, 128, 256, 512} (one
value for all factors, each capped at its next power of two; a chunk narrower than the
factor means merging chunks), keeping those the kernel can take: (a) the launcher's gather
rule, no more warps than ``_fwd_config`` would give ROWS rows with no other limit (Triton
lowers ``tl.gather`` warp-locally, each source's rows whole within a warp); (b) a
register budget, ROWS times the widest chunk (factor CF_f or stage CS_f) at most 8192 and at
most 64 elements a thread; (c) no factor chunk narrower than the factor's ranked list LM_f
(``tl.topk`` of the chunk). The pinned configuration is always among them (marked ``*``).
Rule (b)'s per-thread bound keeps the compile times to seconds: compiled for sm_90 on a 2-core
machine, (256, 256) at k = 8 took 3.9 s at the pinned 32 elements a thread (ROWS 8, 2 warps),
8.6-9.0 s at 64 (ROWS 16, 2 warps; ROWS 32, 4 warps) and 185 s at 256 (ROWS 32, 1 warp); the
first GPU run of this script, without that bound, compiled for 200 s and printed nothing.

The variants are compiled in parallel, fewest elements a thread first: spawned worker
processes each launch one variant once on 64 rows of the same device (63 or 1 where --rows is
specialized so), so that Triton's on-disk cache (TRITON_CACHE_DIR, wherever it points) holds
it, and report the wall time; a variant that fails there is listed with the exception's first
line and skipped. As each compile ends, on ``torch.randn(rows, sum(factors))`` (seed 0), the
variant is launched directly (``_product_key_topk_fwd[grid](..)``, no ``wrap_triton``), its
val and lin compared bitwise with the pinned configuration's, timed
(``triton.testing.do_bench``, median) and printed at once, so that a call cut by its time
limit keeps what it timed. Then one table per k, fastest first, against the pinned
configuration and the floor of ``sdm_ops.bench_topk`` (the bytes of raw read once at the
device copy bandwidth measured in the same run).

Usage on a GPU machine: ``python scripts/topk_sweep.py [--rows 262144] [--factors 256,256]
[--ks 8,32] [--dtype bfloat16|float32] [--jobs 16] [--rep 200]``. Without CUDA, with
TRITON_INTERPRET=1, a smoke run on the CPU: a few variants and the pinned one, one call each
timed by ``time.perf_counter``, no worker processes, e.g. ``TRITON_INTERPRET=1 python
scripts/topk_sweep.py --rows 16 --ks 8``; without either it says so and exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import multiprocessing
import os
import sys
import time
from unittest import mock

import torch
import triton

if importlib.util.find_spec("sdm_ops") is None:      # run from a checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sdm_ops.kernels import product_key_topk
from sdm_ops.kernels.product_key_topk import _fwd_config, _pow2, _product_key_topk_fwd

ROWS_OPTIONS = (1, 2, 4, 8, 16, 32)
WARPS_OPTIONS = (1, 2, 4, 8)
CHUNK_OPTIONS = (64, 128, 256, 512)
REGISTER_BUDGET = 8192       # ROWS times the widest chunk (factor or stage)
THREAD_BUDGET = 64           # elements of the widest chunk a thread
SMOKE_VARIANTS = 3           # variants run under the interpreter besides the pinned one


def max_warps(factors: list[int], k: int, rows: int) -> int:
    """The launcher's own warp cap at ``rows`` rows a program (its gather rule): what
    ``_fwd_config`` gives with ROWS pinned to ``rows`` and no other limit on the warps."""
    with mock.patch.multiple(product_key_topk, _FWD_MAX_ROWS=rows, _FWD_BLOCK=1 << 30,
                             _FWD_WARPS=1 << 10, _STAGE_PER_THREAD=1 << 30):
        return _fwd_config(list(factors), k, 1)["num_warps"]   # itemsize 1: no load rule


def per_thread(meta: dict) -> int:
    """Elements a thread holds of the widest [ROWS, chunk] tensor."""
    nf = meta["NF"]
    widest = max([meta[f"CF{f}"] for f in range(nf)] + [meta[f"CS{f}"] for f in range(1, nf)])
    return meta["ROWS"] * widest // (32 * meta["num_warps"])


def valid(meta: dict, warp_cap: int) -> bool:
    """Whether the kernel can take ``meta``: rules (a) (at most ``warp_cap`` warps), (b) and
    (c) of the docstring."""
    nf = meta["NF"]
    if meta["num_warps"] > warp_cap:
        return False
    if per_thread(meta) * 32 * meta["num_warps"] > REGISTER_BUDGET:
        return False
    if per_thread(meta) > THREAD_BUDGET:
        return False
    return all(meta[f"CF{f}"] >= meta[f"LM{f}"] for f in range(nf))


def variants(factors: list[int], k: int, itemsize: int) -> tuple[dict, list[dict]]:
    """The pinned configuration and the valid variants (ROWS, then warps, then CF ascending),
    the pinned one among them (appended if the grid lacks it)."""
    base = _fwd_config(list(factors), k, itemsize)
    caps = [_pow2(width) for width in factors]
    widths = sorted({min(chunk, max(caps)) for chunk in CHUNK_OPTIONS})
    caps_by_rows = {rows: max_warps(factors, k, rows) for rows in ROWS_OPTIONS}
    out = []
    for rows in ROWS_OPTIONS:
        for warps in WARPS_OPTIONS:
            for chunk in widths:
                meta = dict(base, ROWS=rows, num_warps=warps)
                meta.update({f"CF{f}": min(chunk, cap) for f, cap in enumerate(caps)})
                if valid(meta, caps_by_rows[rows]):
                    out.append(meta)
    if base not in out:
        out.append(base)
    return base, out


def chunks(meta: dict, what: str = "CF") -> str:
    first = 0 if what == "CF" else 1
    return "/".join(str(meta[f"{what}{f}"]) for f in range(first, meta["NF"])) or "-"


def describe(meta: dict) -> str:
    return (f"ROWS {meta['ROWS']}, warps {meta['num_warps']}, CF {chunks(meta)}, "
            f"CS {chunks(meta, 'CS')}")


def first_line(e: BaseException) -> str:
    """The exception's type and first line; where that line is only a Triton source location
    ("at 12:4:"), with the message's last line, the error itself."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if lines[0].startswith("at ") and len(lines) > 1:
        return f"{type(e).__name__}: {lines[0]} .. {lines[-1].strip()}"
    return f"{type(e).__name__}: {lines[0]}"


def compile_rows(rows: int) -> int:
    """Rows for a compile worker's launch: few, but specialized as ``rows`` is (Triton
    specializes an int argument equal to 1 and one divisible by 16), so that the main
    process's launches find the worker's compiled kernel."""
    return 1 if rows == 1 else 64 if rows % 16 == 0 else 63


def outputs(n: int, meta: dict, dtype: torch.dtype, device) -> tuple:
    """val and lin [n, kk], filled with NaN and -1 so that a launch that writes nothing
    cannot pass for an equal one."""
    shape = (n, meta["KK"])
    return (torch.full(shape, float("nan"), dtype=dtype, device=device),
            torch.full(shape, -1, dtype=torch.int64, device=device))


def launch(raw: torch.Tensor, val: torch.Tensor, lin: torch.Tensor, meta: dict) -> None:
    n = raw.shape[0]
    _product_key_topk_fwd[(triton.cdiv(n, meta["ROWS"]),)](raw, val, lin, n, **meta)


def compile_variant(meta: dict, dtype_name: str, device: int, n: int) -> tuple:
    """In a worker process: launch ``meta`` once on ``n`` rows of CUDA device ``device``,
    which compiles it into Triton's on-disk cache. (seconds, None), or (None, the exception's
    first line) if it fails."""
    try:
        torch.cuda.set_device(device)
        dtype = getattr(torch, dtype_name)
        raw = torch.randn(n, meta["W"], device="cuda", dtype=dtype)
        val, lin = outputs(n, meta, dtype, raw.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch(raw, val, lin, meta)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, None
    except Exception as e:
        return None, first_line(e)


def compile_all(metas: list[dict], dtype_name: str, device: int, n: int, jobs: int):
    """``compile_variant`` of every meta, ``jobs`` spawned processes at a time, in the order
    given; yields (index, (seconds, error)) as each ends."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(compile_variant, m, dtype_name, device, n): i
                   for i, m in enumerate(metas)}
        for fut in concurrent.futures.as_completed(futures):
            try:
                yield futures[fut], fut.result()
            except Exception as e:      # the worker itself died (BrokenProcessPool)
                yield futures[fut], (None, first_line(e))


def print_table(k: int, rows: list[dict], floor: float | None) -> None:
    """One line per timed variant, fastest first, against the pinned one (marked *)."""
    base_ms = next((r["ms"] for r in rows if r["base"]), float("nan"))
    print(f"\nk = {k}: {len(rows)} variants, fastest first (* the pinned configuration)")
    print(f"{'':2}{'ROWS':>5}{'warps':>6}{'CF':>10}{'ms':>11}{'x base':>8}{'x floor':>8}"
          f"{'equal':>7}{'compile s':>11}")
    for r in sorted(rows, key=lambda r: r["ms"]):
        meta = r["meta"]
        x_floor = f"{r['ms'] / floor:8.1f}" if floor else f"{'-':>8}"
        secs = f"{r['secs']:11.1f}" if r["secs"] is not None else f"{'-':>11}"
        print(f"{'*' if r['base'] else '':2}{meta['ROWS']:>5}{meta['num_warps']:>6}"
              f"{chunks(meta):>10}{r['ms']:>11.4f}{r['ms'] / base_ms:>8.2f}{x_floor}"
              f"{'ok' if r['same'] else 'DIFF':>7}{secs}")


def print_failed(failed: list[tuple]) -> None:
    for meta, err in failed:
        print(f"  failed: {describe(meta)}: {err}")


def sweep_cuda(args, factors: list[int], ks: list[int], dtype: torch.dtype) -> None:
    from triton.testing import do_bench

    from sdm_ops.bench import copy_bandwidth

    device = torch.cuda.current_device()
    plans = {k: variants(factors, k, dtype.itemsize) for k in ks}
    print(f"{torch.cuda.get_device_name(device)}: {args.rows} rows, factors {tuple(factors)}, "
          f"{args.dtype}; torch {torch.__version__}, triton {triton.__version__}; "
          f"TRITON_CACHE_DIR {os.environ.get('TRITON_CACHE_DIR', '(default)')}")
    for k in ks:
        base, metas = plans[k]
        print(f"k = {k}: pinned {describe(base)}; {len(metas)} variants to sweep")

    torch.manual_seed(0)
    raw = torch.randn(args.rows, sum(factors), device="cuda", dtype=dtype)
    bandwidth = copy_bandwidth() * 1e-3      # bytes per ms
    floor = raw.numel() * raw.element_size() / bandwidth
    print(f"copy bandwidth {bandwidth / 1e6:.0f} GB/s, floor (raw read once) "
          f"{floor * 1e3:.1f} us", flush=True)

    # Each k's pinned configuration first (the reference of its variants), then the rest by
    # elements a thread, so the quick compiles come first.
    todo = [(k, plans[k][0]) for k in ks]
    todo += sorted(((k, m) for k in ks for m in plans[k][1] if m != plans[k][0]),
                   key=lambda km: per_thread(km[1]))
    refs: dict = {}
    rows: dict = {k: [] for k in ks}
    failed: dict = {k: [] for k in ks}
    waiting: list = []          # variants compiled before their pinned configuration
    t0 = time.perf_counter()

    def measure(k: int, meta: dict, secs: float) -> None:
        val, lin = outputs(args.rows, meta, dtype, raw.device)
        try:
            launch(raw, val, lin, meta)
            torch.cuda.synchronize()
        except Exception as e:
            failed[k].append((meta, first_line(e)))
            print(f"k = {k}: {describe(meta)}: failed: {first_line(e)}", flush=True)
            return
        ref_val, ref_lin = refs[k]
        same = torch.equal(val, ref_val) and torch.equal(lin, ref_lin)
        ms = do_bench(lambda: launch(raw, val, lin, meta), warmup=25, rep=args.rep,
                      return_mode="median")
        rows[k].append(dict(meta=meta, ms=ms, same=same, secs=secs, base=meta == plans[k][0]))
        print(f"k = {k}: {describe(meta)}: {ms:.4f} ms, {'ok' if same else 'DIFF'}, compiled "
              f"in {secs:.1f} s (at {time.perf_counter() - t0:.0f} s)", flush=True)

    for i, (secs, err) in compile_all([m for _, m in todo], args.dtype, device,
                                      compile_rows(args.rows), args.jobs):
        k, meta = todo[i]
        if err is not None:
            failed[k].append((meta, err))
            print(f"k = {k}: {describe(meta)}: failed to compile: {err}", flush=True)
            continue
        if meta == plans[k][0]:
            refs[k] = outputs(args.rows, meta, dtype, raw.device)
            launch(raw, *refs[k], meta)
        if k not in refs:
            waiting.append((k, meta, secs))
            continue
        measure(k, meta, secs)
        for item in [w for w in waiting if w[0] in refs]:
            waiting.remove(item)
            measure(*item)
    for k in ks:
        if k not in refs:
            print(f"\nk = {k}: the pinned configuration failed to compile; nothing to compare "
                  "with")
            continue
        print_table(k, rows[k], floor)
        print_failed(failed[k])


def smoke(args, factors: list[int], ks: list[int], dtype: torch.dtype) -> None:
    """Under the Triton interpreter on the CPU: the first SMOKE_VARIANTS valid variants and
    the pinned one, one call each, timed by perf_counter."""
    print(f"CPU, Triton interpreter (smoke run): {args.rows} rows, factors {tuple(factors)}, "
          f"{args.dtype}")
    torch.manual_seed(0)
    raw = torch.randn(args.rows, sum(factors), dtype=dtype)
    for k in ks:
        base, metas = variants(factors, k, dtype.itemsize)
        picked = [m for m in metas if m != base][:SMOKE_VARIANTS] + [base]
        print(f"k = {k}: pinned {describe(base)}; {len(metas)} variants on a GPU, "
              f"{len(picked)} here", flush=True)
        ref_val, ref_lin = outputs(args.rows, base, dtype, raw.device)
        launch(raw, ref_val, ref_lin, base)
        rows, failed = [], []
        for meta in picked:
            val, lin = outputs(args.rows, meta, dtype, raw.device)
            try:
                t0 = time.perf_counter()
                launch(raw, val, lin, meta)
                ms = (time.perf_counter() - t0) * 1e3
            except Exception as e:
                failed.append((meta, first_line(e)))
                continue
            same = torch.equal(val, ref_val) and torch.equal(lin, ref_lin)
            rows.append(dict(meta=meta, ms=ms, same=same, secs=None, base=meta == base))
        print_table(k, rows, None)
        print_failed(failed)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--factors", default="256,256", help="comma-separated, 1 to 4 factors")
    p.add_argument("--ks", default="8,32", help="comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="parallel compile workers")
    p.add_argument("--rep", type=int, default=200, help="do_bench rep (ms)")
    args = p.parse_args()
    factors = [int(x) for x in args.factors.split(",")]
    ks = list(dict.fromkeys(int(x) for x in args.ks.split(",")))
    if not 1 <= len(factors) <= 4 or min(factors) < 1 or min(ks) < 1 or args.rows < 1:
        p.error("1 to 4 positive factors, positive ks and rows")
    dtype = getattr(torch, args.dtype)
    if torch.cuda.is_available():
        sweep_cuda(args, factors, ks, dtype)
    elif os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on", "y"):
        smoke(args, factors, ks, dtype)
    else:
        print("scripts/topk_sweep.py needs a CUDA GPU (or TRITON_INTERPRET=1 for a CPU smoke "
              "run); nothing to do here.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
