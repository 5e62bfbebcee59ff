"""Phase 2 alone (the forward and backward recurrence kernels) across launch configurations.

For each (tile, warps) it times the operators on the reference workload (float32 bank with
decay): the functional forward (with its snapshot and the copy of the bank), the in-place
forward (no snapshot, no copy) and the backward (with the copy of dbank), and prints the largest
difference of the results from the first configuration's, relative to each result's largest
magnitude (the reduction order may change with the layout, so a few ulps are expected).
Usage on a GPU machine: ``python scripts/sweep_phase2.py [--configs 2048x4,8192x8 ...]``.
"""

from __future__ import annotations

import argparse

import torch

from sdm_ops import bench, ops
from sdm_ops.kernels import recurrence_bwd as kb
from sdm_ops.kernels import recurrence_fwd as kf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="2048x4,4096x4,4096x8,4096x16,8192x8,8192x16")
    parser.add_argument("--snapshot", default="none")
    parser.add_argument("--bank-dtype", default="float32")
    args = parser.parse_args()
    shape = (8, 4096, 8, 64, 65536, 8, 8)
    a = bench.make_workload(*shape, decay=True, bank_dtype=getattr(torch, args.bank_dtype))
    C = 64
    S = a["bank"].shape[-2]
    prep, X, QX, _ = ops._phase1(a["v"], a["beta"], a["write_idx"], a["write_w"],
                                         a["read_idx"], a["read_w"], a["decay"], S, C, None)
    _, _, gw, gr, sw, rd, rank, read_rank = prep
    fwd_in = (a["v"], a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank, read_rank,
              X, QX, a["bank"], args.snapshot)
    base = None
    print(f"phase 2 alone, B,T,H,D,S,W,R = {shape}, C = {C}, {args.bank_dtype} bank, "
          f"snapshot {args.snapshot}")
    copy_ms = bench._time_ms(lambda: a["bank"].clone(), reps=10)
    print(f"one copy of the bank (included once in fwd, twice in bwd): {copy_ms:.3f} ms")
    print(f"{'tile x warps':<14}{'fwd ms':>9}{'in-place':>9}{'bwd ms':>9}"
          "  max rel. diff from first")
    for cfg in args.configs.split(","):
        tile, warps = (int(x) for x in cfg.split("x"))
        kf._TILE, kf._NUM_WARPS, kb._NUM_WARPS = tile, warps, warps
        out, bank_out, snap, scale, res, delta = ops.recurrence_fwd(*fwd_in)
        fwd_ms = bench._time_ms(lambda: ops.recurrence_fwd(*fwd_in), reps=10)
        work = a["bank"].clone()
        inplace_in = (work,) + fwd_in[:9] + fwd_in[10:12]
        inplace_ms = bench._time_ms(lambda: ops.recurrence_fwd_(*inplace_in), reps=10)
        del work
        g = torch.Generator(device="cuda").manual_seed(3)
        dout = torch.randn(out.shape, device="cuda", generator=g)
        dbank = torch.randn(bank_out.shape, device="cuda", generator=g)
        bwd_in = (a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank, read_rank, X,
                  QX, res, delta, S, snap, scale, args.snapshot, dout, dbank,
                  a["v"].dtype)
        grads = ops.recurrence_bwd(*bwd_in)
        bwd_ms = bench._time_ms(lambda: ops.recurrence_bwd(*bwd_in), reps=10)
        result = (out, bank_out) + tuple(grads)
        if base is None:
            base, diff = result, "-"
        else:
            rel = max(((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
                      for x, y in zip(result, base))
            diff = f"{rel:.1e}"
        print(f"{cfg:<14}{fwd_ms:>9.3f}{inplace_ms:>9.3f}{bwd_ms:>9.3f}  {diff}")
        del out, bank_out, snap, scale, res, delta, grads, result
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
