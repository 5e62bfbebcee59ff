"""Launch the phase-2 kernels of the reference workload twice each, for a profiler to look at.

Each of the in-place forward, the functional forward (snapshot ``--snapshot``) and the backward
runs once to compile and once more; give ncu ``--launch-skip 3 --launch-count 3`` with
``--kernel-name regex:_recurrence_``. Usage on a GPU machine:
``ncu --clock-control none --kernel-name regex:_recurrence_ --launch-skip 3 --launch-count 3
--section WarpStateStats ... python scripts/profile_phase2.py``.
"""

from __future__ import annotations

import argparse

import torch

from sdm_ops import bench, ops


def phase2_inputs(a: dict, chunk_size: int, snapshot: str):
    """Phase 1 and the WY solve of workload ``a`` (``bench.make_workload``) run once: phase 2's
    operands (v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank,
    read_rank, X, QX, bank, snapshot), and random output and bank gradients (float32)."""
    S = a["bank"].shape[-2]
    prep, X, QX, _ = ops._phase1(a["v"], a["beta"], a["write_idx"], a["write_w"],
                                         a["read_idx"], a["read_w"], a["decay"], S, chunk_size,
                                         None)
    _, _, gw, gr, sw, rd, rank, read_rank = prep
    fwd_in = (a["v"], a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank, read_rank,
              X, QX, a["bank"], snapshot)
    g = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(a["v"].shape, device="cuda", generator=g)
    dbank = torch.randn(a["bank"].shape, device="cuda", generator=g)
    return fwd_in, dout, dbank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", default="none")
    parser.add_argument("--bank-dtype", default="float32")
    args = parser.parse_args()
    shape = (8, 4096, 8, 64, 65536, 8, 8)
    a = bench.make_workload(*shape, decay=True, bank_dtype=getattr(torch, args.bank_dtype))
    S = a["bank"].shape[-2]
    fwd_in, dout, dbank = phase2_inputs(a, 64, args.snapshot)
    _, _, _, _, gw, gr, sw, rd, rank, read_rank, X, QX = fwd_in[:12]
    work = a["bank"].clone()
    for _ in range(2):
        ops.recurrence_fwd_(work, *fwd_in[:9], *fwd_in[10:12])
        out, bank_out, snap, scale, res, delta = ops.recurrence_fwd(*fwd_in)
        ops.recurrence_bwd(a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank,
                           read_rank, X, QX, res, delta, S, snap, scale, args.snapshot, dout,
                           dbank, a["v"].dtype)
        torch.cuda.synchronize()
        del out, bank_out, snap, scale, res, delta


if __name__ == "__main__":
    main()
