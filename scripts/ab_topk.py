"""The product-key top-k forward and backward of several versions of sdm_ops, side by side in
one GPU session (the companion of ``scripts/ab_wy.py``, with the same variants: directories
holding a copy of the ``sdm_ops`` package, each run in a fresh process from its own directory).

For each variant, each case (factors and k; by default those of ``sdm_ops.bench_topk``,
(256, 256) at k = 8 and 32) and each raw dtype (bfloat16, float32) this times
``sdm_ops.product_key_topk`` without autograd on 262144 rows of ``torch.randn`` (seed 0;
median of 20 calls, after a first call that compiles, whose wall time it prints too) and
replayed from a CUDA graph of ten calls (the kernels' time without the host's dispatch), then
the backward op (``sdm_internal::product_key_topk_backward``) alone on the returned lin, replayed
likewise; it keeps a SHA-1 of the returned val, lin and gradient and says, per case, whether
every variant returned the same bits as the first. Usage: ``python scripts/ab_topk.py
.ab/base .ab/new [--rounds 2] [--cases 256,256:8 256,256:32 4096,3:256] [--rows 262144]``.
"""

from __future__ import annotations

from _ab import each_run, parser

_WORKER = r"""
import hashlib, os, sys, time, torch
import sdm_ops
from sdm_ops import bench
assert bench.__file__.startswith(os.getcwd() + os.sep), bench.__file__   # this copy's package
path, rows = sys.argv[1], int(sys.argv[2])
results = {}
for case in sys.argv[3:]:
    factors, k = case.split(":")
    factors, k = tuple(int(f) for f in factors.split(",")), int(k)
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        raw = torch.randn(rows, sum(factors), device="cuda", dtype=dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            val, lin = sdm_ops.product_key_topk(raw, factors, k)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        with torch.no_grad():
            ms = bench._time_ms(lambda: sdm_ops.product_key_topk(raw, factors, k))
            # Ten calls replayed from a CUDA graph: the kernel's time without the host's.
            graph = bench._captured(
                lambda: [sdm_ops.product_key_topk(raw, factors, k) for _ in range(10)])
            replayed = bench._time_ms(graph.replay, reps=10) / 10
        # The backward op alone, replayed likewise, on fixed value gradients.
        grad_val = torch.randn(val.shape, device="cuda", generator=torch.Generator(
            "cuda").manual_seed(1)).to(dtype)
        backward = lambda: torch.ops.sdm_internal.product_key_topk_backward(lin, grad_val,
                                                                   list(factors), dtype)
        grad = backward()
        graph = bench._captured(lambda: [backward() for _ in range(10)])
        bwd_replayed = bench._time_ms(graph.replay, reps=10) / 10
        digest = hashlib.sha1()
        for t in (val, lin, grad):
            digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        results[(case, str(dtype).removeprefix("torch."))] = {
            "ms": ms, "replayed": replayed, "first_s": first_s, "bwd": bwd_replayed,
            "sha": digest.hexdigest()}
torch.save(results, path)
"""


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--cases", nargs="+", default=["256,256:8", "256,256:32"],
                   help="factors:k, factors comma-separated")
    p.add_argument("--rows", type=int, default=262144)
    args = p.parse_args()
    results = {}
    print(f"product_key_topk forward, {args.rows} rows: ms a call eager (CUDA events, median of"
          " 20, the host's dispatch included) and replayed (a CUDA graph of 10 calls, median of"
          " 10 replays), the first call's wall seconds (compiling), and the backward op"
          " alone, replayed likewise (bwd)")
    print(f"{'variant':<24}{'case':>16}{'dtype':>10}{'ms':>9}{'replayed':>10}{'first s':>9}"
          f"{'bwd':>9}  sha1 (val, lin, grad)")
    for v, got in each_run(args.variants, args.rounds, _WORKER, [str(args.rows), *args.cases]):
        results.setdefault(v, got)
        for (case, dtype), res in got.items():
            print(f"{v:<24}{case:>16}{dtype:>10}{res['ms']:>9.3f}{res['replayed']:>10.3f}"
                  f"{res['first_s']:>9.1f}{res['bwd']:>9.3f}  {res['sha'][:12]}", flush=True)
    first = results[args.variants[0]]
    for v in args.variants[1:]:
        for key, res in first.items():
            same = results[v][key]["sha"] == res["sha"]
            print(f"{v} {key[0]} {key[1]}: {'the same bits as' if same else 'DIFFERS from'} "
                  f"{args.variants[0]}")


if __name__ == "__main__":
    main()
