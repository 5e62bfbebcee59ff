"""Phase 1 of the chunked recurrence: everything that depends on the addressing but not on
the bank, for every chunk of every stream at once.

For chunk ``n`` of stream ``p`` (tokens ``n*C .. n*C+C-1`` of ``b = p // H``, ``h = p % H``),
with ``d_t[s]`` the product of token t's decays on slot s and ``Gamma_{i/j}[s]`` the product of
``d_t[s]`` over ``j < t <= i``:

    A[i, j]      = sum_{a in i, b in j, s_a = s_b} w_a w_b Gamma_{i/j}[s]        (j < i)
    QK[i, j]     = sum_{r in i, b in j, s_r = s_b} w_r w_b Gamma_{i/j}[s]        (j <= i)
    gather_w[b]  = w_b * prod_{t <= j} d_t[s_b]          (write entry b of token j)
    gather_r[r]  = w_r * prod_{t <= i} d_t[s_r]          (read entry r of token i)
    scatter_w[b] = w_b * Gamma_{C/j}[s_b]
    row_decay[b] = prod_{t < C} d_t[s_b]
    rank[b]      = number of entries of the chunk before b (token-major) on the same slot

Every product is formed by multiplication in token order, never by division, so a decay of 0 is
exact. An entry is padding when its index is outside ``[0, S)`` (``-1`` by contract, anything
else out of range is masked the same way): weight 0, decay 1, no match.

Layout: write_idx, write_w, decay [B, T, H, W]; read_idx, read_w [B, T, H, R]; contiguous, any
int index dtype. Outputs A, QK [B, H, N, C, C] float32 (every element written; zero outside
the strict lower / lower triangle); gather_w, scatter_w, row_decay [B, T, H, W] float32;
gather_r [B, T, H, R] float32; rank [B, T, H, W] int32.

Grid: (N, B * H, C // BJ). A program owns BJ tokens ("own" entries: their W write and R read
entries) of one chunk and walks the chunk's C tokens in order, matching each token's entries
against its own. It writes the columns of its tokens in A and QK and its entries' weights.
Each output element has one writer and every sum and product runs in a fixed order, so the
result is bitwise deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_NUM_WARPS = 4
_TILE = 4096     # own entries x token entries compared at once


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _prod(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _mul)


@triton.jit
def _chunk_prepare_kernel(
    write_idx, write_w, decay, read_idx, read_w,
    A, QK, gather_w, gather_r, scatter_w, row_decay, rank,
    T, H, S,
    W: tl.constexpr, R: tl.constexpr, WP: tl.constexpr, RP: tl.constexpr,
    C: tl.constexpr, BJ: tl.constexpr, HAS_DECAY: tl.constexpr,
):
    n = tl.program_id(0)
    p = tl.program_id(1)
    j0 = tl.program_id(2) * BJ
    b = p // H
    h = p % H
    t0 = n * C
    jj = j0 + tl.arange(0, BJ)                   # own tokens (chunk-local)
    ow = tl.arange(0, WP)
    orr = tl.arange(0, RP)
    own_ok = (t0 + jj) < T
    # Entry (b, t, h, j) of a [B, T, H, E] tensor lies at ((b * T + t) * H + h) * E + j.
    tok_row = (b.to(tl.int64) * T + t0 + jj) * H + h          # [BJ]
    w_off = tok_row[:, None] * W + ow[None, :]                 # [BJ, WP]
    w_ok = own_ok[:, None] & (ow[None, :] < W)
    r_off = tok_row[:, None] * R + orr[None, :]
    r_ok = own_ok[:, None] & (orr[None, :] < R)

    s_b = tl.load(write_idx + w_off, mask=w_ok, other=-1).to(tl.int64)
    v_b = w_ok & (s_b >= 0) & (s_b < S)
    w_b = tl.where(v_b, tl.load(write_w + w_off, mask=v_b, other=0.0).to(tl.float32), 0.0)
    s_r = tl.load(read_idx + r_off, mask=r_ok, other=-1).to(tl.int64)
    v_r = r_ok & (s_r >= 0) & (s_r < S)
    w_r = tl.where(v_r, tl.load(read_w + r_off, mask=v_r, other=0.0).to(tl.float32), 0.0)
    s_b = tl.where(v_b, s_b, -1)
    s_r = tl.where(v_r, s_r, -2)                 # never equal to a padding write slot (-1)

    since = tl.full((BJ, WP), 1.0, tl.float32)   # Gamma_{t/j} on the own write entry's slot
    upto = tl.full((BJ, WP), 1.0, tl.float32)    # prod_{t' <= min(t, j)} d_t'
    total = tl.full((BJ, WP), 1.0, tl.float32)   # prod_{t' <= t} d_t'
    rupto = tl.full((BJ, RP), 1.0, tl.float32)
    cnt = tl.zeros((BJ, WP), tl.int32)
    flat_b = jj[:, None] * WP + ow[None, :]

    a_base = ((b.to(tl.int64) * H + h) * tl.cdiv(T, C) + n) * C * C
    for t in range(0, C):
        ok_t = (t0 + t) < T
        row_t = (b.to(tl.int64) * T + t0 + t) * H + h
        m_t = ok_t & (ow < W)
        s_t = tl.load(write_idx + row_t * W + ow, mask=m_t, other=-1).to(tl.int64)
        v_t = m_t & (s_t >= 0) & (s_t < S)
        s_t = tl.where(v_t, s_t, -3)             # padding matches nothing
        w_t = tl.where(v_t, tl.load(write_w + row_t * W + ow, mask=v_t, other=0.0).to(tl.float32), 0.0)
        if HAS_DECAY:
            d_t = tl.where(v_t, tl.load(decay + row_t * W + ow, mask=v_t, other=1.0).to(tl.float32), 1.0)
        else:
            d_t = tl.full((WP,), 1.0, tl.float32)
        mr_t = ok_t & (orr < R)
        q_t = tl.load(read_idx + row_t * R + orr, mask=mr_t, other=-1).to(tl.int64)
        vq_t = mr_t & (q_t >= 0) & (q_t < S)
        q_t = tl.where(vq_t, q_t, -4)
        wq_t = tl.where(vq_t, tl.load(read_w + row_t * R + orr, mask=vq_t, other=0.0).to(tl.float32), 0.0)

        # Own write entries against token t's write and read entries.
        hit = s_b[:, :, None] == s_t[None, None, :]                      # [BJ, WP, WP]
        d = _prod(tl.where(hit, d_t[None, None, :], 1.0), 2)             # [BJ, WP]
        kw = tl.sum(tl.where(hit, w_t[None, None, :], 0.0), 2)
        qhit = s_b[:, :, None] == q_t[None, None, :]                     # [BJ, WP, RP]
        qw = tl.sum(tl.where(qhit, wq_t[None, None, :], 0.0), 2)
        after = t > jj[:, None]
        since = tl.where(after, since * d, since)
        upto = tl.where(after, upto, upto * d)
        total = total * d
        earlier = (t * WP + ow)[None, None, :] < flat_b[:, :, None]
        cnt += tl.sum((hit & earlier).to(tl.int32), 2)
        a_row = tl.sum(w_b * since * kw, 1)                              # [BJ]
        q_row = tl.sum(w_b * since * qw, 1)
        col_ok = jj < C
        tl.store(A + a_base + t * C + jj, tl.where(jj < t, a_row, 0.0), mask=col_ok)
        tl.store(QK + a_base + t * C + jj, tl.where(jj <= t, q_row, 0.0), mask=col_ok)

        # Own read entries: decay of their slot up to their token.
        rhit = s_r[:, :, None] == s_t[None, None, :]                     # [BJ, RP, WP]
        rd = _prod(tl.where(rhit, d_t[None, None, :], 1.0), 2)
        rupto = tl.where(t > jj[:, None], rupto, rupto * rd)

    tl.store(gather_w + w_off, w_b * upto, mask=w_ok)
    tl.store(scatter_w + w_off, w_b * since, mask=w_ok)
    tl.store(row_decay + w_off, total, mask=w_ok)
    tl.store(rank + w_off, tl.where(v_b, cnt, 0), mask=w_ok)
    tl.store(gather_r + r_off, w_r * rupto, mask=r_ok)


def chunk_prepare_geometry(W: int, R: int, C: int) -> tuple[int, int, int]:
    """(WP, RP, BJ): padded entry counts and own tokens per program."""
    wp = triton.next_power_of_2(max(W, 1))
    rp = triton.next_power_of_2(max(R, 1))
    bj = max(1, min(C, _TILE // (max(wp, rp) * wp)))
    return wp, rp, bj


def chunk_prepare(write_idx, write_w, read_idx, read_w, decay, bank_rows: int, chunk_size: int,
                  A, QK, gather_w, gather_r, scatter_w, row_decay, rank) -> None:
    """Launch phase 1; see the module docstring for the operands (all contiguous)."""
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    C = chunk_size
    N = triton.cdiv(T, C)
    if B * H * N == 0:
        return
    wp, rp, bj = chunk_prepare_geometry(W, R, C)
    wrap_triton(_chunk_prepare_kernel)[(N, B * H, C // bj)](
        write_idx, write_w, write_w if decay is None else decay, read_idx, read_w,
        A, QK, gather_w, gather_r, scatter_w, row_decay, rank,
        T, H, bank_rows,
        W=W, R=R, WP=wp, RP=rp, C=C, BJ=bj, HAS_DECAY=decay is not None,
        num_warps=_NUM_WARPS)
