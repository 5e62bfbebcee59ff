"""Sweep the product-key top-k backward (``_product_key_topk_bwd``) over rows a program and
warps around the pinned configuration of ``_bwd_config(factors, kk)``, and time two bounds
beside it: the same launches with every slot -1 (no slot selects a column: the program zeroes
its rows and walks its slots but stores no sum) and ``grad.zero_()`` (writing the gradient
once, PyTorch's fill kernel).

For each dtype and k: ``raw = torch.randn(rows, sum(factors))`` (seed 0), ``lin`` from
``sdm_ops.product_key_topk(raw, factors, k)`` and value gradients ``torch.randn`` (seed 1);
each variant is launched directly (``_product_key_topk_bwd[grid](..)``), its gradient compared
bitwise with the pinned configuration's, and timed (``triton.testing.do_bench``, median), then
printed at once (a call cut by its time limit keeps what it timed); then one table per case,
fastest first. The floor is the gradient written once and lin and the value gradients read
once at the device copy bandwidth measured in the same run (``sdm_ops.bench``).

Usage on a GPU machine: ``python scripts/topk_bwd_sweep.py [--rows 262144] [--factors
256,256] [--ks 8,32] [--dtypes bfloat16,float32] [--rows-options 8,16,..] [--warps-options
1,2,..]``; to sweep a package copy, ``cd .ab/X && PYTHONPATH=$PWD python
../../scripts/topk_bwd_sweep.py`` (it prints where its ``sdm_ops`` came from). Without CUDA,
with TRITON_INTERPRET=1, a smoke run on the CPU (two variants and the pinned one, one call
each), e.g. ``TRITON_INTERPRET=1 python scripts/topk_bwd_sweep.py --rows 40 --ks 8``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
import time

import torch
import triton

if importlib.util.find_spec("sdm_ops") is None:      # run from a checkout, not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sdm_ops  # noqa: E402
from sdm_ops import bench  # noqa: E402
from sdm_ops.kernels.product_key_topk import _bwd_config, _product_key_topk_bwd  # noqa: E402

ROWS_OPTIONS = (1, 2, 4, 8, 16, 32, 64, 128)
WARPS_OPTIONS = (2, 4, 8)
SMOKE_VARIANTS = 2


def variants(factors: list[int], kk: int, smoke: bool, rows_options=ROWS_OPTIONS,
             warps_options=WARPS_OPTIONS) -> tuple[dict, list[dict]]:
    """The pinned configuration and the variants (ROWS, then warps, ascending), the pinned
    one among them."""
    base = _bwd_config(list(factors), kk)
    out = [dict(base, ROWS=rows, num_warps=warps)
           for rows in rows_options for warps in warps_options]
    if smoke:
        out = out[:SMOKE_VARIANTS]
    if base not in out:
        out.append(base)
    return base, out


def launch(lin: torch.Tensor, grad_val: torch.Tensor, grad: torch.Tensor, meta: dict) -> None:
    n = lin.shape[0]
    _product_key_topk_bwd[(triton.cdiv(n, meta["ROWS"]),)](lin, grad_val, grad, n, **meta)


def time_ms(fn, interpret: bool) -> float:
    if interpret:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def describe(meta: dict) -> str:
    return f"ROWS {meta['ROWS']:>3}, warps {meta['num_warps']}"


def sweep_case(n: int, factors: list[int], kk: int, dtype: torch.dtype, options: list[tuple],
               bandwidth: float | None, device: str) -> None:
    """One dtype and k: every variant timed and printed as it ends, then the table."""
    interpret = device == "cpu"
    torch.manual_seed(0)
    raw = torch.randn(n, sum(factors), device=device, dtype=dtype)
    with torch.no_grad():
        _, lin = sdm_ops.product_key_topk(raw, factors, kk)
    grad_val = torch.randn(lin.shape, device=device, generator=torch.Generator(
        device).manual_seed(1)).to(dtype)
    none = torch.full_like(lin, -1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    grad = torch.empty_like(raw)
    base, metas = variants(factors, kk, interpret, *options)
    launch(lin, grad_val, grad, base)
    want = grad.clone()
    sha = hashlib.sha1(want.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
    case = f"{str(dtype).removeprefix('torch.')} {tuple(factors)} k = {kk}"
    nbytes = grad.numel() * grad.element_size() + lin.numel() * 8 + \
        grad_val.numel() * grad_val.element_size()
    floor = "" if bandwidth is None else f", floor {nbytes / bandwidth * 1e3:.3f} ms"
    zero = time_ms(grad.zero_, interpret)
    print(f"{case}: grad.zero_() {zero:.3f} ms{floor}; the pinned configuration's "
          f"gradient: sha1 {sha[:12]}", flush=True)
    rows = []
    for meta in metas:
        grad.fill_(float("nan"))
        launch(lin, grad_val, grad, meta)
        same = torch.equal(grad.view(bits), want.view(bits))
        ms = time_ms(lambda: launch(lin, grad_val, grad, meta), interpret)
        bare = time_ms(lambda: launch(none, grad_val, grad, meta), interpret)
        mark = "*" if meta == base else " "
        print(f"  {mark}{describe(meta)}: {ms:.3f} ms, slots -1 {bare:.3f} ms, "
              f"{'same bits' if same else 'DIFFERS'}", flush=True)
        rows.append((ms, bare, mark, meta, same))
    pinned = next(ms for ms, _, mark, _, _ in rows if mark == "*")
    print(f"{case}, fastest first (pinned *):")
    for ms, bare, mark, meta, same in sorted(rows, key=lambda r: r[0]):
        print(f"  {mark}{describe(meta)} {ms:8.3f} ms  {ms / pinned:5.2f}x pinned  "
              f"slots -1 {bare:.3f}{'' if same else '  DIFFERS'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--factors", default="256,256")
    p.add_argument("--ks", default="8,32")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--rows-options", default=",".join(map(str, ROWS_OPTIONS)))
    p.add_argument("--warps-options", default=",".join(map(str, WARPS_OPTIONS)))
    args = p.parse_args()
    options = [tuple(int(x) for x in o.split(",")) for o in (args.rows_options,
                                                               args.warps_options)]
    # Under the interpreter (a smoke run) the kernels take CPU tensors, GPU or not.
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("topk_bwd_sweep: needs a CUDA GPU, or TRITON_INTERPRET=1 for a CPU smoke run")
        return
    factors = [int(f) for f in args.factors.split(",")]
    print(f"sdm_ops from {os.path.dirname(sdm_ops.__file__)}")
    bandwidth = None if device == "cpu" else bench.copy_bandwidth()
    for dtype_name in args.dtypes.split(","):
        for kk in (int(k) for k in args.ks.split(",")):
            sweep_case(args.rows, factors, kk, getattr(torch, dtype_name), options, bandwidth,
                       device)


if __name__ == "__main__":
    main()
