"""Registers, spills and shared memory of phase 2's kernels as the GPU's own Triton compiled
them, for one or more copies of the ``sdm_ops`` package side by side.

``ptxas_report.py`` compiles on a machine without a GPU with the Triton installed there (3.7 in
CI); the H200 runs another (3.6), whose register allocation differs (PERF_NOTES 32, 35). This
runs the reference configuration's forward (float32 and bfloat16 banks, snapshot "none"), its
in-place forward and a forward+backward at a small B and T (the same constexprs as the reference
workload: W = R = 8, D = 64, chunk 64) in a fresh process per copy, then prints what Triton
compiled for every kernel of ``sdm_ops.kernels`` it launched.
Usage: ``python scripts/kernel_regs.py .ab/main [.ab/other ...]`` (a GPU; ``.`` for the
working tree).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from _ab import run_variant

_WORKER = r"""
import importlib, os, pkgutil, sys, torch, triton
import sdm_ops, sdm_ops.kernels
from sdm_ops import bench
assert sdm_ops.__file__.startswith(os.getcwd() + os.sep), sdm_ops.__file__
for dtype in (torch.float32, torch.bfloat16):
    a = bench.make_workload(2, 512, 8, 64, 65536, 8, 8, decay=True, bank_dtype=dtype)
    for make in (bench.forward_fn, bench.in_place_fn, bench.forward_backward_fn):
        make(a, 64)()
torch.cuda.synchronize()
rows = []
for info in pkgutil.iter_modules(sdm_ops.kernels.__path__):
    mod = importlib.import_module(f"sdm_ops.kernels.{info.name}")
    for name, fn in vars(mod).items():
        if not isinstance(fn, triton.runtime.jit.JITFunction):
            continue
        for cache in getattr(fn, "device_caches", {}).values():
            for k in cache[0].values():
                k._init_handles()
                consts = {}
                for key, val in (getattr(k.src, "constants", None) or {}).items():
                    i = key[0] if isinstance(key, tuple) else key
                    arg = fn.arg_names[i] if isinstance(i, int) else i
                    if arg in ("MODE", "SNAPSHOT", "SOURCE", "HAS_DOUT"):
                        consts[arg] = val
                consts["bank"] = str(getattr(k.src, "signature", {}).get("bank", ""))
                rows.append((name, k.n_regs, k.n_spills, k.metadata.shared,
                             k.metadata.num_warps, str(consts)))
torch.save(rows, sys.argv[1])
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="directories holding an sdm_ops copy")
    args = p.parse_args()
    print(f"{'variant':<12}{'kernel':<28}{'regs':>5}{'spill':>6}{'smem':>7}{'warps':>6}"
          "  constexprs")
    with tempfile.TemporaryDirectory() as tmp:
        for v in args.variants:
            path = os.path.join(tmp, "rows.pt")
            rows = run_variant(v, _WORKER, [path], path)
            for name, regs, spills, smem, warps, consts in sorted(rows):
                print(f"{v:<12}{name:<28}{regs:>5}{spills:>6}{smem:>7}{warps:>6}  {consts}",
                      flush=True)


if __name__ == "__main__":
    main()
