"""The per-stream copy of a bank, as a kernel; the table of each slot's first writing chunk.

    dst[b] = src[b]      (src [B, H, S, D])      or      dst[b] = src      (shared src [H, S, D])

converted to dst's dtype (float32 or bfloat16 from either; exact, or one rounding to bfloat16).
Used where phase 2 needs a fresh state (the functional forward's returned bank, the backward's
bank gradient, seeded from the incoming one). Why not ``Tensor.copy_``: a same-dtype contiguous
copy is a device-to-device memcpy, and a CUDA graph replays a memcpy of 512 MiB or more at
about half the bandwidth of the same copy run eagerly (pytorch/pytorch#191284); the bank is a
1 GiB tensor at the reference workload. A kernel replays like any other kernel.

The functional forward (``sdm_internal::recurrence_fwd``) copies only the rows that no chunk of
their stream writes (``first``): phase 2 reads every other row from the source bank until its
stream first writes it, and that first write stores the whole row (``recurrence_fwd``'s ``source``),
so the copy moves 61% of the bank at the reference workload. The inference forward copies the
whole bank beside phase 1 instead (``_copy_beside`` in ``ops/recurrence.py``): measured, that
was faster than the partial copy beside phase 1 followed by phase 2 from the source.

``first`` [P, S] int32 (P = B * H streams, or N * H for a packed batch, stream p = b * H + h):
the first chunk of stream p with a valid write entry on slot s, INT32_MAX where none writes s.
``first_writes`` fills it with an atomic min of each chunk's number over its write entries:
the result does not depend on their order (deterministic). Chunk numbers are those of phase 2
(0, 1, ... in a dense batch; a packed batch's chunk slots, increasing along a sequence).

Layout: src and dst contiguous; a bank is H * S rows of D elements (offsets 64-bit). Grid
(P, B): program (i, b) copies the blocks i, i + P, i + 2P, ... of BLOCK elements (BLOCK / D
rows) of bank b. P = cdiv(H * S * D, BLOCK) by default (one block a program); a smaller P
(``programs``) makes a copy that holds at most P programs a bank on the GPU at once, each
walking larger blocks (``BOUNDED_BLOCK``), so that SMs stay free for kernels of another stream
beside it (the inference forward runs phase 1 and the WY solve so). Every
element is written by one program, with a plain load and store: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._tiles import bank_slots, dense_chunk, entry_offsets, token_rows

BLOCK = 4096
BOUNDED_BLOCK = 32768  # elements a step of a bounded copy's program (64-128 KB in flight an SM)
UNWRITTEN = 2**31 - 1  # ``first`` of a slot that no chunk of its stream writes
_UNWRITTEN = tl.constexpr(UNWRITTEN)  # the same, for the kernels
_NUM_WARPS = 8
_FIRST_SPLIT = 16  # programs a stream of ``first_writes``, each every 16th chunk


@triton.jit
def _bank_copy_kernel(
    src,
    dst,
    first,
    ROWS,
    SRC_BANK_STRIDE,
    D: tl.constexpr,
    BR: tl.constexpr,
    UNWRITTEN_ONLY: tl.constexpr,
):
    b = tl.program_id(1).to(tl.int64)
    step = tl.num_programs(0).to(tl.int64) * BR
    cols = tl.arange(0, D)
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    for k in range(0, tl.cdiv(tl.cdiv(ROWS, BR) - tl.program_id(0), tl.num_programs(0))):
        keep = r < ROWS
        if UNWRITTEN_ONLY:  # launched one block a program (``bank_copy_unwritten``)
            keep = keep & (tl.load(first + b * ROWS + r, mask=keep, other=0) == _UNWRITTEN)
        offs = r[:, None] * D + cols[None, :]
        x = tl.load(src + b * SRC_BANK_STRIDE + offs, mask=keep[:, None])
        tl.store(dst + b * ROWS * D + offs, x.to(dst.dtype.element_ty), mask=keep[:, None])
        r += step


@triton.jit
def _first_writes_kernel(
    write_idx,
    chunks,
    seq_chunks,
    first,
    T,
    H,
    S,
    W: tl.constexpr,
    WP: tl.constexpr,
    C: tl.constexpr,
    VARLEN: tl.constexpr,
):
    p = tl.program_id(0)
    h = p % H
    if VARLEN:
        lo = tl.load(seq_chunks + p // H).to(tl.int32)
        hi = tl.load(seq_chunks + p // H + 1).to(tl.int32)
    else:
        lo = 0
        hi = tl.cdiv(T, C)
    first_p = first + p.to(tl.int64) * S
    ci = tl.arange(0, C)
    for n in range(lo + tl.program_id(1), hi, tl.num_programs(1)):
        if VARLEN:
            tok0 = tl.load(chunks + 2 * n)
            count = tl.load(chunks + 2 * n + 1).to(tl.int32)
        else:
            tok0, count = dense_chunk(n, p, T, H, C)
        tok, tok_ok = token_rows(tok0, h, H, count, ci)
        went, wm = entry_offsets(tok, tok_ok, W, WP)
        s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
        tl.atomic_min(first_p + s, tl.zeros_like(s).to(tl.int32) + n, mask=ok, sem="relaxed")


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, first, programs: int) -> None:
    banks, H, S, D = dst.shape
    rows = H * S
    if banks * rows == 0:
        return
    br = max(1, (BOUNDED_BLOCK if programs > 0 else BLOCK) // D)
    blocks = triton.cdiv(rows, br)
    grid = (min(blocks, programs) if programs > 0 else blocks, banks)
    shared = src.dim() == 3 or src.shape[0] == 1
    wrap_triton(_bank_copy_kernel)[grid](
        src,
        dst,
        dst if first is None else first,
        rows,
        0 if shared else rows * D,
        D=D,
        BR=br,
        UNWRITTEN_ONLY=first is not None,
        num_warps=_NUM_WARPS,
    )


def bank_copy(src: torch.Tensor, dst: torch.Tensor, programs: int = 0) -> None:
    """dst [B, H, S, D] <- src ([B, H, S, D], or shared: [H, S, D] or [1, H, S, D]), both
    contiguous; ``programs`` > 0 bounds the programs a bank (the module docstring)."""
    _launch_copy(src, dst, None, programs)


def bank_copy_unwritten(src: torch.Tensor, dst: torch.Tensor, first: torch.Tensor) -> None:
    """Like ``bank_copy`` (one block a program), for the rows whose ``first`` [B * H, S] is
    UNWRITTEN only; the other rows of dst are left as they are."""
    _launch_copy(src, dst, first, 0)


def first_writes(
    write_idx: torch.Tensor, chunk_size: int, chunks, seq_chunks, first: torch.Tensor
) -> None:
    """Fill ``first`` [P, S] int32 (see the module docstring) from write_idx [B, T, H, W]."""
    B, T, H, W = write_idx.shape
    P, S = first.shape
    first.fill_(UNWRITTEN)
    if P * T * W == 0:
        return
    varlen = chunks is not None
    wrap_triton(_first_writes_kernel)[(P, _FIRST_SPLIT)](
        write_idx,
        chunks if varlen else write_idx,
        seq_chunks if varlen else write_idx,
        first,
        T,
        H,
        S,
        W=W,
        WP=triton.next_power_of_2(W),
        C=chunk_size,
        VARLEN=varlen,
        num_warps=4,
    )
