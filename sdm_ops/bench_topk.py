"""Benchmark of ``product_key_topk`` on CUDA: ``python -m sdm_ops.bench_topk``.

262144 rows of raw scores, factors (256, 256), k in {8, 32}, bfloat16 then float32 rows. Times
(median of many runs, ``triton.testing.do_bench``) of the forward, the forward plus backward
(eager, and replayed from a CUDA graph: without the host's dispatch of the autograd call),
and, for bfloat16 rows, the brute force (all 65536 sums of a row materialized in float32,
chunk of rows by chunk, then ``torch.topk``), each against its rows' floor: the bytes of raw
read once at the copy bandwidth measured in the same run (a device-to-device copy, read plus
write bytes over its time).
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import torch

ROWS = 262144
FACTORS = (256, 256)
KS = (8, 32)
BRUTE_CHUNK = 16384          # rows whose 65536 float32 sums (4 GiB) are held at once


def _bench(fn, rep_ms: int = 300) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=50, rep=rep_ms, return_mode="median")


def brute_force(raw: torch.Tensor, k: int) -> None:
    a, b = FACTORS
    for r0 in range(0, raw.shape[0], BRUTE_CHUNK):
        x = raw[r0:r0 + BRUTE_CHUNK].float()
        sums = (x[:, :a, None] + x[:, None, a:]).reshape(x.shape[0], a * b)
        torch.topk(sums, k, dim=-1)


def main() -> int:
    if not torch.cuda.is_available():
        print("sdm_ops.bench_topk needs a CUDA GPU; nothing to do here.")
        return 0
    import sdm_ops
    from sdm_ops.bench import _captured, copy_bandwidth

    bandwidth = copy_bandwidth() * 1e-3      # bytes per ms
    print(f"{torch.cuda.get_device_name()}: {ROWS} rows, factors {FACTORS}; copy bandwidth "
          f"{bandwidth / 1e6:.0f} GB/s; floor: raw read once")
    print(f"{'rows':<10}{'what':<22}{'k':>4}{'ms':>10}{'x floor':>10}")
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        raw = torch.randn(ROWS, sum(FACTORS), device="cuda", dtype=dtype)
        floor = raw.numel() * raw.element_size() / bandwidth
        name = str(dtype).removeprefix("torch.")

        def row(what, k, ms):
            print(f"{name:<10}{what:<22}{k:>4}{ms:>10.3f}{ms / floor:>10.1f}")

        x = raw.detach().requires_grad_(True)
        for k in KS:
            grad_val = torch.randn(ROWS, k, device="cuda", dtype=dtype)

            def forward():
                sdm_ops.product_key_topk(raw, FACTORS, k)

            def forward_backward():
                val, _ = sdm_ops.product_key_topk(x, FACTORS, k)
                torch.autograd.grad(val, x, grad_val)

            row("forward", k, _bench(forward))
            row("forward + backward", k, _bench(forward_backward))
            row("  replayed", k, _bench(_captured(forward_backward).replay))
            if dtype == torch.bfloat16:
                row("brute force", k, _bench(lambda: brute_force(raw, k), rep_ms=1000))
        print(f"{name:<10}floor {floor * 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
