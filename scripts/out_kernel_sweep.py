"""Time out = inter + QX (beta res) as a kernel of its own over tile widths, warps and dot
precision at the reference workload's shape (B, T, H, D = 8, 4096, 8, 64, chunk 64), with each
variant's largest difference from float64 (PERF_NOTES 40).

The kernel is ``recurrence_fwd._out_kernel`` for a dense batch with the dot's precision as a
parameter (the library's is tf32x3, chosen by this sweep), writing a float32 out.
Usage on a GPU machine: ``python scripts/out_kernel_sweep.py``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _out(QX, beta, res, inter, out, T, H, D: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
         PREC: tl.constexpr):
    n = tl.program_id(0)
    p = tl.program_id(1)
    h = p % H
    tok0 = (p // H).to(tl.int64) * T + n * C
    count = T - n * C
    ci = tl.arange(0, C)
    tok = (tok0 + ci) * H + h
    ok = ci < count
    bb = tl.load(beta + tok, mask=ok, other=0.0).to(tl.float32)
    base = (p.to(tl.int64) * tl.num_programs(0) + n) * C * C
    qx = tl.load(QX + base + ci[:, None] * C + ci[None, :])
    for k0 in range(0, D, BK):
        kc = k0 + tl.arange(0, BK)
        off = tok[:, None] * D + kc[None, :]
        u = bb[:, None] * tl.load(res + off, mask=ok[:, None], other=0.0)
        o = tl.load(inter + off, mask=ok[:, None], other=0.0)
        o = tl.dot(qx, u, o, input_precision=PREC)
        tl.store(out + off, o.to(out.dtype.element_ty), mask=ok[:, None])


def ms(fn, reps=50):
    """Median milliseconds of ``fn`` over ``reps`` calls, each timed by CUDA events."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def main() -> None:
    B, T, H, D, C = 8, 4096, 8, 64, 64
    N, P = T // C, B * H
    g = torch.Generator(device="cuda").manual_seed(0)
    QX = torch.randn(B, H, N, C, C, device="cuda", generator=g) / 8
    beta = torch.rand(B, T, H, device="cuda", generator=g).bfloat16()
    res = torch.randn(B, T, H, D, device="cuda", generator=g)
    inter = torch.randn(B, T, H, D, device="cuda", generator=g)
    out = torch.empty(B, T, H, D, device="cuda")     # float32 here; v's dtype in the library
    big = torch.empty(2 ** 28, device="cuda")
    moved = (QX.numel() + 3 * res.numel()) * 4
    rate = 2 * big.numel() * 4 / (ms(lambda: big.clone()) * 1e-3)
    print(f"{moved / 1e6:.0f} MB moved; floor at the clone rate {moved / rate * 1e6:.1f} us")
    u = beta.double()[..., None] * res.double()
    u = u.view(B, N, C, H, D).permute(0, 3, 1, 2, 4)
    want = (QX.double() @ u).permute(0, 2, 3, 1, 4).reshape(B, T, H, D) + inter.double()
    for prec in ("ieee", "tf32x3", "tf32"):
        for bk in (16, 32, 64):
            for w in (4, 8):
                t = ms(lambda: _out[(N, P)](QX, beta, res, inter, out, T, H, D=D, C=C, BK=bk,
                                            PREC=prec, num_warps=w))
                err = ((out.double() - want).abs().max() / want.abs().max()).item()
                print(f"{prec:<7} BK {bk:>2} warps {w}: {t * 1e3:7.1f} us  largest difference "
                      f"{err:.1e} of the largest value", flush=True)


if __name__ == "__main__":
    main()
