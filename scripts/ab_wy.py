"""The WY solve of several versions of sdm_ops, side by side in one GPU session (the companion
of ``scripts/ab_phase2.py``, with the same variants: directories holding a copy of the
``sdm_ops`` package, each run in a fresh process from its own directory).

For each variant and chunk size this times ``sdm::wy_solve`` (forward) and
``sdm_internal::wy_solve_backward`` on N chunks of random inputs (4096 of 64 and 2048 of 128 tokens,
the reference workload's count; median of 20 calls), checks that two backward calls agree
bitwise, and keeps 4096 sampled positions of every output; then it prints each variant's
largest difference from the first's at those positions, relative to the first's largest
sampled magnitude. Usage: ``python scripts/ab_wy.py .ab/base .ab/new [--rounds 2]``.
"""

from __future__ import annotations

from _ab import each_run, largest_difference, parser

_WORKER = r"""
import math, os, sys, torch
from sdm_ops import bench
assert bench.__file__.startswith(os.getcwd() + os.sep), bench.__file__   # this copy's package
path = sys.argv[1]
results = {}
for n, c in ((4096, 64), (2048, 128)):
    g = torch.Generator(device="cuda").manual_seed(c)
    A = torch.randn(n, c, c, device="cuda", generator=g) * (0.5 / math.sqrt(c))
    beta = torch.rand(n, c, device="cuda", generator=g) * 0.98 + 0.01
    QK = torch.randn(n, c, c, device="cuda", generator=g) / math.sqrt(c)
    dX = torch.randn(n, c, c, device="cuda", generator=g)
    dQX = torch.randn(n, c, c, device="cuda", generator=g)
    X, QX = torch.ops.sdm.wy_solve(A, beta, QK)
    fwd_ms = bench._time_ms(lambda: torch.ops.sdm.wy_solve(A, beta, QK))
    grads = torch.ops.sdm_internal.wy_solve_backward(A, beta, QK, X, dX, dQX)
    same = all(torch.equal(a, b) for a, b in
               zip(grads, torch.ops.sdm_internal.wy_solve_backward(A, beta, QK, X, dX, dQX)))
    bwd_ms = bench._time_ms(
        lambda: torch.ops.sdm_internal.wy_solve_backward(A, beta, QK, X, dX, dQX))
    pick = torch.Generator(device="cuda").manual_seed(11)
    samples = {}
    for name, t in zip(("X", "QX", "dA", "dbeta", "dQK"), (X, QX) + tuple(grads)):
        flat = t.reshape(-1)
        at = torch.randint(0, flat.numel(), (4096,), device="cuda", generator=pick)
        samples[name] = flat[at].double().cpu()
    results[c] = {"ms": (fwd_ms, bwd_ms), "bitwise": same, "samples": samples}
torch.save(results, path)
"""


def main() -> None:
    args = parser(__doc__).parse_args()
    results = {}
    print("WY solve alone, forward and backward ms (median of 20)")
    print(f"{'variant':<24}{'C':>5}{'chunks':>8}{'forward':>9}{'backward':>10}  backward bitwise")
    for v, got in each_run(args.variants, args.rounds, _WORKER):
        results.setdefault(v, got)
        for c, res in got.items():
            fwd, bwd = res["ms"]
            print(f"{v:<24}{c:>5}{4096 * 64 // c:>8}{fwd:>9.3f}{bwd:>10.3f}  "
                  f"{res['bitwise']}", flush=True)
    first = results[args.variants[0]]
    for v in args.variants[1:]:
        for c, res in first.items():
            worst = largest_difference(res["samples"], results[v][c]["samples"])
            print(f"{v} C={c}: largest sampled difference from {args.variants[0]}: "
                  f"{worst:.2e} of the largest sampled value")


if __name__ == "__main__":
    main()
