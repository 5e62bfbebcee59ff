"""Phase 2 of several versions of sdm_ops, side by side in one GPU session (how PERF_NOTES 12
was measured).

Each variant is a directory holding a copy of the ``sdm_ops`` package (for a git revision:
``mkdir -p .ab/NAME && git archive REV sdm_ops | tar -x -C .ab/NAME``; carry ``.ab`` to the GPU
machine). For each, in a fresh process with that copy first on ``PYTHONPATH``, this times the
phase-2 operators on the reference workload: the functional forward with its snapshot and bank
copy, the in-place forward, and the backward with its dbank copy, dual matmul and sums (median
of 10 calls each), checks that two backward calls agree bitwise, and samples 4096 positions of
every output and gradient; then it prints each variant's largest difference from the first's
at those positions, relative to the first's largest sampled magnitude.
Usage: ``python scripts/ab_phase2.py .ab/base .ab/new [--bank-dtype bfloat16] [--rounds 2]
[--snapshot fp8] [--chunk-size 128]`` (the in-place forward keeps no snapshot in any mode).
"""

from __future__ import annotations

from _ab import each_run, parser, print_differences

_WORKER = r"""
import os, sys, torch
from sdm_ops import bench, ops
path, bank_dtype, mode, C = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
assert bench.__file__.startswith(os.getcwd() + os.sep), bench.__file__   # this copy's package
a = bench.make_workload(8, 4096, 8, 64, 65536, 8, 8, decay=True,
                        bank_dtype=getattr(torch, bank_dtype))
S = a["bank"].shape[-2]
prep, X, QX, _ = ops._phase1(a["v"], a["beta"], a["write_idx"], a["write_w"],
                                     a["read_idx"], a["read_w"], a["decay"], S, C, None)
_, _, gw, gr, sw, rd, rank, read_rank = prep
fwd_in = (a["v"], a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank, read_rank, X,
          QX, a["bank"], mode)
out, bank_out, snap, scale, res, delta = ops.recurrence_fwd(*fwd_in)
fwd_ms = bench._time_ms(lambda: ops.recurrence_fwd(*fwd_in), reps=10)
work = a["bank"].clone()
inplace_in = (work,) + fwd_in[:9] + fwd_in[10:12]
ip_out = ops.recurrence_fwd_(*inplace_in)
ip_bank = work.clone()
ip_ms = bench._time_ms(lambda: ops.recurrence_fwd_(*inplace_in), reps=10)
del work
g = torch.Generator(device="cuda").manual_seed(3)
dout = torch.randn(out.shape, device="cuda", generator=g)
dbank = torch.randn(bank_out.shape, device="cuda", generator=g)
bwd_in = (a["beta"], a["write_idx"], a["read_idx"], gw, gr, sw, rd, rank, read_rank, X, QX, res,
          delta, S, snap, scale, mode, dout, dbank, a["v"].dtype)
grads = ops.recurrence_bwd(*bwd_in)
same = all(torch.equal(x, y) for x, y in zip(grads, ops.recurrence_bwd(*bwd_in)))
bwd_ms = bench._time_ms(lambda: ops.recurrence_bwd(*bwd_in), reps=10)
pick = torch.Generator(device="cuda").manual_seed(11)
samples = {}
for name, t in [("out", out), ("bank", bank_out), ("in-place out", ip_out),
                ("in-place bank", ip_bank)] + [(f"grad {i}", x) for i, x in enumerate(grads)]:
    flat = t.reshape(-1)
    at = torch.randint(0, flat.numel(), (4096,), device="cuda", generator=pick)
    samples[name] = flat[at].double().cpu()
torch.save({"ms": (fwd_ms, ip_ms, bwd_ms), "bitwise": same, "samples": samples}, path)
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--bank-dtype", default="float32")
    p.add_argument("--snapshot", default="none", choices=["none", "bf16", "fp8", "int4"],
                   help="the forward's snapshot mode, which the backward reads")
    p.add_argument("--chunk-size", type=int, default=64, choices=[16, 32, 64, 128])
    args = p.parse_args()
    results = {}
    print(f"phase 2 alone, B,T,H,D,S,W,R = 8,4096,8,64,65536,8,8, C = {args.chunk_size}, "
          f"{args.bank_dtype} bank, snapshot {args.snapshot} (ms, median of 10)")
    print(f"{'variant':<24}{'forward':>9}{'in place':>10}{'backward':>10}  backward bitwise")
    for v, got in each_run(args.variants, args.rounds, _WORKER,
                           [args.bank_dtype, args.snapshot, str(args.chunk_size)]):
        results.setdefault(v, got)
        fwd, ip, bwd = got["ms"]
        print(f"{v:<24}{fwd:>9.3f}{ip:>10.3f}{bwd:>10.3f}  {got['bitwise']}", flush=True)
    print_differences(results, args.variants)


if __name__ == "__main__":
    main()
