"""The per-stream copy of a bank, as a kernel.

    dst[b] = src[b]      (src [B, H, S, D])      or      dst[b] = src      (shared src [H, S, D])

converted to dst's dtype (float32 or bfloat16 from either; exact, or one rounding to bfloat16).
Used where phase 2 needs a fresh state (the functional forward's returned bank, the backward's
bank gradient, seeded from the incoming one). Why not ``Tensor.copy_``: a same-dtype contiguous
copy is a device-to-device memcpy, and a CUDA graph replays a memcpy of 512 MiB or more at
about half the bandwidth of the same copy run eagerly (pytorch/pytorch#191284); the bank is a
1 GiB tensor at the reference workload. A kernel replays like any other kernel.

Layout: src and dst contiguous; N = H * S * D elements per bank (offsets 64-bit). Grid
(P, B): program (i, b) copies the blocks i, i + P, i + 2P, ... of BLOCK elements of bank b.
P = cdiv(N, BLOCK) by default (one block a program); a smaller P (``programs``) makes a copy
that holds at most P programs a bank on the GPU at once, each walking larger blocks
(``BOUNDED_BLOCK``), so that SMs stay free for kernels of another stream beside it (the
inference forward runs phase 1 and the WY solve so: PERF_NOTES 27). Every element is written
by one program, with a plain load and store: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

BLOCK = 4096
BOUNDED_BLOCK = 32768   # elements a step of a bounded copy's program (64-128 KB in flight an SM)
_NUM_WARPS = 8


@triton.jit
def _bank_copy_kernel(src, dst, N, SRC_BANK_STRIDE, BLOCK: tl.constexpr):
    b = tl.program_id(1).to(tl.int64)
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64)
    for k in range(0, tl.cdiv(tl.cdiv(N, BLOCK) - tl.program_id(0), tl.num_programs(0))):
        offs = (first + k * step) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < N
        x = tl.load(src + b * SRC_BANK_STRIDE + offs, mask=keep)
        tl.store(dst + b * N + offs, x.to(dst.dtype.element_ty), mask=keep)


def bank_copy(src: torch.Tensor, dst: torch.Tensor, programs: int = 0) -> None:
    """dst [B, H, S, D] <- src ([B, H, S, D], or shared: [H, S, D] or [1, H, S, D]), both
    contiguous; ``programs`` > 0 bounds the programs a bank (the module docstring)."""
    n = dst[0].numel() if dst.shape[0] else 0
    if n == 0:
        return
    block = BOUNDED_BLOCK if programs > 0 else BLOCK
    blocks = triton.cdiv(n, block)
    grid = (min(blocks, programs) if programs > 0 else blocks, dst.shape[0])
    shared = src.dim() == 3 or src.shape[0] == 1
    wrap_triton(_bank_copy_kernel)[grid](src, dst, n, 0 if shared else n, BLOCK=block,
                                         num_warps=_NUM_WARPS)
