"""Phase 1 alone (the sort, pairs and dense kernels of ``sdm_internal::chunk_prepare`` and its
backward, and the WY solve) across launch configurations, kernel by kernel.

Each configuration runs in a process of its own (so that a swapped sort is compiled afresh):
``SW:PW[:tlsort]`` (or ``default``) is the sort kernel's warps, the one-window pairs kernels'
warps and, with ``tlsort``, Triton's ``tl.sort`` in place of the package's bitonic network.
Each prints the kernels' mean times (torch.profiler, over ``--reps`` calls of phase 1's forward
and backward on the reference workload, float32 bank with decay) and whether the outputs are
bitwise those of the first configuration.
Usage on a GPU machine: ``python scripts/sweep_phase1.py [--configs 8:4,4:4,16:4,8:4:tlsort]``;
``PYTHONPATH=.ab/NAME python scripts/sweep_phase1.py --configs default --compare FILE`` for
package copies (made as for ``ab_phase2.py``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl


def _worker(cfg: str, result: str, reps: int, hot: int | None) -> None:
    from sdm_ops import bench, ops
    from sdm_ops.kernels import chunk_prepare as cp

    parts = cfg.split(":")
    if parts[0] != "default":
        cp._SORT_WARPS = int(parts[0])
        cp._PAIRS_WARPS = int(parts[1])
    if "tlsort" in parts[2:]:
        @triton.jit
        def _tl_sort(x, N: tl.constexpr):
            return tl.sort(x)
        cp._sort = _tl_sort
    shape = (8, 4096, 8, 64, 65536, 8, 8)
    a = bench.make_workload(*shape, decay=True, bank_dtype=torch.float32, hot=hot)
    S, C = a["bank"].shape[-2], 64
    g = torch.Generator(device="cuda").manual_seed(5)

    def run():
        prep, X, QX, _ = ops._phase1(a["v"], a["beta"], a["write_idx"], a["write_w"],
                                             a["read_idx"], a["read_w"], a["decay"], S, C, None)
        grads = [torch.randn(t.shape, device="cuda", generator=g.manual_seed(7 + i))
                 for i, t in enumerate(prep[:6])]
        back = ops.chunk_prepare_backward(a["write_idx"], a["write_w"], a["read_idx"],
                                          a["read_w"], a["decay"], S, *grads)
        return prep[:6] + (X, QX) + tuple(back)

    outs = run()
    torch.cuda.synchronize()
    if reps == 0:      # under ncu: one call, no CUPTI of torch.profiler beside it
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time_total / 1e3 / reps
    torch.save({"times": totals, "outs": [o.cpu() for o in outs]}, result)


_NAMES = ("A", "QK", "gather_w", "gather_r", "scatter_w", "row_decay", "X", "QX",
          "d_write_w", "d_read_w", "d_decay")


def _differences(outs: list, base: list) -> str:
    """'True' when every output is bitwise the base's, else each differing output's largest
    difference relative to its largest magnitude."""
    diff = [f"{n} {((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item():.1e}"
            for n, x, y in zip(_NAMES, outs, base) if not torch.equal(x, y)]
    return "; ".join(diff) if diff else "True"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8:4,4:4,16:4,8:2,8:8,8:4:tlsort")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--hot", type=int, help="every index drawn from this many slots (the "
                        "bench's addressing: few enough make every chunk heavy)")
    parser.add_argument("--compare", metavar="FILE",
                        help="compare the outputs with those saved in FILE (saved there first "
                             "when it does not exist), to compare package copies")
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker, args.reps, args.hot)
        return
    base = torch.load(args.compare) if args.compare and os.path.exists(args.compare) else None
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in args.configs.split(","):
            path = os.path.join(tmp, "r.pt")
            hot = [] if args.hot is None else ["--hot", str(args.hot)]
            subprocess.run([sys.executable, __file__, "--reps", str(args.reps), *hot, "--worker",
                            cfg, path], check=True)
            r = torch.load(path)
            same = "-" if base is None else _differences(r["outs"], base)
            if base is None:
                base = r["outs"]
                if args.compare:
                    torch.save(base, args.compare)
            rows = sorted(((t, n) for n, t in r["times"].items() if t > 0.001), reverse=True)
            print(f"config {cfg}: phase 1 fwd+bwd {sum(t for t, _ in rows):.3f} ms a call; "
                  f"outputs bitwise those of the first: {same}")
            for t, n in rows:
                print(f"  {t * 1e3:8.1f} us  {n[:90]}")


if __name__ == "__main__":
    main()
