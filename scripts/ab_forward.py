"""The inference forward (``sparse_delta_memory`` without autograd: bank copy, phase 1, WY
solve, phase 2 in place on the copy) of several versions of sdm_ops, side by side in one GPU
session (how PERF_NOTES 27 was measured).

Each variant is a directory holding a copy of the ``sdm_ops`` package, as for
``ab_phase2.py``. For each, in a fresh process with that copy as its working directory, this
times the reference workload's forward (B,T,H,D,S,W,R = 8,4096,8,64,65536,8,8, chunk 64, decay;
``--shape B,T,H,D,S`` another) eagerly and replayed from a CUDA graph (median of 20), with a
float32 and a bfloat16 bank; then
it prints each variant's largest difference from the first's at 4096 sampled positions of out
and the bank. With ``--all``, the float32 bank's in-place forward (``sparse_delta_memory_``)
and forward+backward are timed too.
Usage: ``python scripts/ab_forward.py .ab/base .ab/new [--rounds 2] [--all] [--shape
1,16384,8,128,65536]``.
"""

from __future__ import annotations

import argparse
import re

from _ab import each_run, parser, print_differences

_WORKER = r"""
import os, sys, torch
from sdm_ops import bench
path, shape = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
assert bench.__file__.startswith(os.getcwd() + os.sep), bench.__file__   # this copy's package
ms, samples = {}, {}
pick = torch.Generator(device="cuda").manual_seed(11)
for dtype in (torch.float32, torch.bfloat16):
    a = bench.make_workload(*shape, 8, 8, decay=True, bank_dtype=dtype)
    fwd = bench.forward_fn(a, 64)
    out, bank = fwd()
    name = str(dtype).split(".")[-1]
    ms[name] = (bench._time_ms(fwd), bench.replay_ms(fwd))
    if "--all" in sys.argv and dtype == torch.float32:
        for key, fn in (("in place", bench.in_place_fn(a, 64)),
                        ("fwd+bwd", bench.forward_backward_fn(a, 64))):
            ms[f"{name} {key}"] = (bench._time_ms(fn), bench.replay_ms(fn))
            del fn
    for key, t in (("out", out), ("bank", bank)):
        flat = t.reshape(-1)
        at = torch.randint(0, flat.numel(), (4096,), device="cuda", generator=pick)
        samples[f"{name} {key}"] = flat[at].double().cpu()
    del out, bank, a, fwd
    torch.cuda.empty_cache()
torch.save({"ms": ms, "samples": samples}, path)
"""


def _shape(text: str) -> str:
    """``--shape``'s value, checked here (the worker parses it): five integers B,T,H,D,S."""
    if not re.fullmatch(r"\d+(,\d+){4}", text):
        raise argparse.ArgumentTypeError(f"five integers B,T,H,D,S, not {text!r}")
    return text


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--all", action="store_true", help="also the in-place forward and fwd+bwd")
    p.add_argument("--shape", default="8,4096,8,64,65536", type=_shape,
                   help="B,T,H,D,S (W = R = 8)")
    args = p.parse_args()
    results = {}
    print(f"inference forward, B,T,H,D,S,W,R = {args.shape},8,8, C = 64, decay "
          "(ms, median of 20: eager / CUDA graph)")
    extra = [args.shape] + (["--all"] if args.all else [])
    for v, got in each_run(args.variants, args.rounds, _WORKER, extra):
        results.setdefault(v, got)
        cells = "  ".join(f"{k} {e:.3f} / {g:.3f}" for k, (e, g) in got["ms"].items())
        print(f"{v:<20} {cells}", flush=True)
    print_differences(results, args.variants)


if __name__ == "__main__":
    main()
