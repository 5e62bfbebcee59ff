"""One decode step (T = 1) of the recurrence, in place, in one launch.

For every stream (b, h) and its one token (the recurrence of docs/design.md), with d[s] the
product of the token's decays on slot s and K[s] the sum of its write weights on s:

    retrieved = sum_a write_w[a] d[s_a] M[s_a]          u = beta (v - retrieved)
    M[s] <- d[s] M[s] + K[s] u                           (each slot the token writes)
    out = sum_r read_w[r] (d[s_r] M[s_r] + K[s_r] u)     (read after the write; d = 1, K = 0
                                                          on slots the token does not write)

Every bank row the step needs is gathered from the state before the token (the read rows after
the write follow from d and K), then, after a barrier, the first write entry on each slot
stores its slot's new row: each row has one writer, and every sum and product over entries
runs in entry order (pairwise [W, W] and [R, W] matches, no atomics): bitwise deterministic.

Layout (contiguous): bank [B, H, S, D] float32 or bfloat16, updated in place (offsets 64-bit);
v, out [B, 1, H, D] (out in v's dtype); beta [B, 1, H]; write_idx, write_w, decay [B, 1, H, W];
read_idx, read_w [B, 1, H, R]; any int index dtype. An index outside [0, S) is padding (reads
and writes nothing). Grid (B * H, D // 16): a program owns one stream and 16 columns; 1 warp.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton

from ._tiles import bank_slots

BLOCK_D = 16
_NUM_WARPS = 1


@triton.jit
def _decode_step_kernel(
    bank,
    v,
    beta,
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    out,
    S,
    D: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    BD: tl.constexpr,
    HAS_DECAY: tl.constexpr,
):
    p = tl.program_id(0)  # stream b * H + h, and also its token's row
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    bank_p = bank + p.to(tl.int64) * S * D
    a = tl.arange(0, WP)
    went = p * W + a
    s, ok = bank_slots(tl.load(write_idx + went, mask=a < W, other=-1), a < W, S)
    w = tl.where(ok, tl.load(write_w + went, mask=ok, other=0.0).to(tl.float32), 0.0)
    if HAS_DECAY:
        dec = tl.where(ok, tl.load(decay + went, mask=ok, other=1.0).to(tl.float32), 1.0)
    else:
        dec = tl.full((WP,), 1.0, tl.float32)
    same = (s[:, None] == s[None, :]) & ok[:, None] & ok[None, :]  # [WP, WP]
    k_a = tl.sum(tl.where(same, w[None, :], 0.0), 1)  # K[s_a]
    first = ok & (tl.sum((same & (a[None, :] < a[:, None])).to(tl.int32), 1) == 0)
    r = tl.arange(0, RP)
    rent = p * R + r
    q, qok = bank_slots(tl.load(read_idx + rent, mask=r < R, other=-1), r < R, S)
    rw = tl.where(qok, tl.load(read_w + rent, mask=qok, other=0.0).to(tl.float32), 0.0)
    hit = (q[:, None] == s[None, :]) & qok[:, None] & ok[None, :]  # [RP, WP]
    k_r = tl.sum(tl.where(hit, w[None, :], 0.0), 1)
    # d[s_a] and d[s_r]: each write entry's decay multiplied in, entry by entry.
    d_a = tl.full((WP,), 1.0, tl.float32)
    d_r = tl.full((RP,), 1.0, tl.float32)
    for b in tl.static_range(W):
        on_b = a == b
        s_b = tl.sum(tl.where(on_b, s, 0))
        ok_b = tl.sum(tl.where(on_b & ok, 1, 0)) > 0
        dec_b = tl.sum(tl.where(on_b, dec, 0.0))
        d_a = tl.where(ok & ok_b & (s == s_b), d_a * dec_b, d_a)
        d_r = tl.where(qok & ok_b & (q == s_b), d_r * dec_b, d_r)

    ptr = bank_p + s[:, None] * D + cols[None, :]
    rows = tl.load(ptr, mask=ok[:, None], other=0.0).to(tl.float32)  # [WP, BD]
    qrows = tl.load(bank_p + q[:, None] * D + cols[None, :], mask=qok[:, None], other=0.0).to(
        tl.float32
    )
    vv = tl.load(v + p * D + cols).to(tl.float32)
    bb = tl.load(beta + p).to(tl.float32)
    u = bb * (vv - tl.sum((w * d_a)[:, None] * rows, 0))  # [BD]
    # u reaches only the slots the token writes: selected, not multiplied by K = 0 (a token
    # that writes nothing, padding included, may hold any value; 0 x NaN is NaN).
    written = tl.max(hit.to(tl.int32), 1) > 0  # [RP]
    after = d_r[:, None] * qrows + tl.where(written[:, None], k_r[:, None] * u[None, :], 0.0)
    o = tl.sum(tl.where(qok[:, None], rw[:, None] * after, 0.0), 0)
    tl.store(out + p * D + cols, o.to(out.dtype.element_ty))
    tl.debug_barrier()  # every gather precedes the first write
    new = d_a[:, None] * rows + k_a[:, None] * u[None, :]
    tl.store(ptr, new.to(bank.dtype.element_ty), mask=first[:, None])


def decode_step(bank, v, beta, write_idx, write_w, read_idx, read_w, decay, out) -> None:
    """Launch one decode step over every stream; ``bank`` is updated in place and ``out``
    written. See the module docstring for the operands."""
    B, _, H, D = v.shape
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    if B * H == 0:
        return
    wrap_triton(_decode_step_kernel)[(B * H, D // BLOCK_D)](
        bank,
        v,
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        write_w if decay is None else decay,
        out,
        bank.shape[-2],
        D=D,
        W=W,
        R=R,
        WP=triton.next_power_of_2(max(W, 1)),
        RP=triton.next_power_of_2(max(R, 1)),
        BD=BLOCK_D,
        HAS_DECAY=decay is not None,
        num_warps=_NUM_WARPS,
    )
