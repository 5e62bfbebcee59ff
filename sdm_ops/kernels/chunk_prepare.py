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
    read_rank[r] = the same among the chunk's read entries

Every product is formed by multiplication in token order, never by division, so a decay of 0 is
exact. An entry is padding when its index is outside ``[0, S)`` (``-1`` by contract, anything
else out of range is masked the same way): weight 0, decay 1, no match.

Layout: write_idx, write_w, decay [B, T, H, W]; read_idx, read_w [B, T, H, R]; contiguous, any
int index dtype. Outputs A, QK [B, H, N, C, C] float32 (every element written; zero outside
the strict lower / lower triangle); gather_w, scatter_w, row_decay [B, T, H, W] float32;
gather_r [B, T, H, R] float32; rank [B, T, H, W] and read_rank [B, T, H, R] int32.

A packed batch (``cu_seqlens``; B = 1) has chunk slots instead of chunks: the table ``chunks``
[NC, 2] (``reference.varlen_chunks``) gives each slot's first token and token count, A and QK
are [1, H, NC, C, C], and the grid is (NC, H, C // BJ); an unused slot has no tokens, so its
tiles are written zero.

Two paths compute it. The sparse path (``chunk_prepare_sparse``: a sort kernel and pairs
kernels; the backward reads the forward's sort, ``layout.PairLists``) pairs only the entries
that share a slot, which in a large bank are few, a window of whole hash buckets at a time; it
takes every chunk whose buckets hold at most MC entries each. The dense kernels below take the
rest ("heavy" chunks; every chunk where the geometry has no sparse path): grid
(N, B * H, C // BJ), a program owns BJ tokens ("own" entries: their W write and R read entries)
of one chunk and walks the chunk's C tokens in order, matching each token's entries against its
own, and writes the columns of its tokens in A and QK and its entries' weights. Launched after
the sparse path, a dense kernel has at most STRIDED_PROGRAMS_PER_SM programs an SM, each
walking every G-th chunk and taking a heavy one whole, BJ tokens at a time. On either path each
output element has one writer and every sum and product runs in a fixed order, so the result is
bitwise deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton

from ._common import chunk_grid, strided_grid
from ._tiles import dense_chunk, token_entries
from .chunk_prepare_sparse import sparse_launch

_NUM_WARPS = 4
_TILE = 4096  # own entries x token entries compared at once


@triton.jit
def _rowprod(x, M: tl.constexpr, N: tl.constexpr):
    """Products along the rows of x [M, N] (N a power of 2) as a tree of halvings: a fixed
    order, and far faster under the interpreter than a tl.reduce with a custom combine."""
    for k in tl.static_range(N.bit_length() - 1):
        lo, hi = tl.split(tl.reshape(x, (M, N >> (k + 1), 2)))
        x = lo * hi
    return tl.reshape(x, (M,))


@triton.jit
def _lastprod(x, L: tl.constexpr, M: tl.constexpr, N: tl.constexpr):
    """Products along the last axis of x [L, M, N]: [L, M]."""
    return tl.reshape(_rowprod(tl.reshape(x, (L * M, N)), L * M, N), (L, M))


@triton.jit
def _token_decays(decay, row, ok, E: tl.constexpr, EP: tl.constexpr, HAS_DECAY: tl.constexpr):
    """Decays [EP] of one token's valid entries ``ok`` (1 elsewhere, and without decay)."""
    if HAS_DECAY:
        o = tl.arange(0, EP)
        return tl.where(ok, tl.load(decay + row * E + o, mask=ok, other=1.0).to(tl.float32), 1.0)
    else:
        return tl.full((EP,), 1.0, tl.float32)


@triton.jit
def _prepare_chunk(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    chunks,
    A,
    QK,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    n,
    p,
    j0,
    N,
    T,
    H,
    S,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    BJ: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    h = p % H
    if VARLEN:
        tok0 = tl.load(chunks + 2 * n)
        count = tl.load(chunks + 2 * n + 1).to(tl.int32)
    else:
        tok0, count = dense_chunk(n, p, T, H, C)
    jj = j0 + tl.arange(0, BJ)  # own tokens (chunk-local)
    ow = tl.arange(0, WP)
    orr = tl.arange(0, RP)
    own_ok = jj < count
    # Entry (b, t, h, j) of a [B, T, H, E] tensor lies at ((b * T + t) * H + h) * E + j.
    tok_row = (tok0 + jj) * H + h  # [BJ]
    w_off = tok_row[:, None] * W + ow[None, :]  # [BJ, WP]
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
    s_r = tl.where(v_r, s_r, -2)  # never equal to a padding write slot (-1)

    since = tl.full((BJ, WP), 1.0, tl.float32)  # Gamma_{t/j} on the own write entry's slot
    upto = tl.full((BJ, WP), 1.0, tl.float32)  # prod_{t' <= min(t, j)} d_t'
    total = tl.full((BJ, WP), 1.0, tl.float32)  # prod_{t' <= t} d_t'
    rupto = tl.full((BJ, RP), 1.0, tl.float32)
    cnt = tl.zeros((BJ, WP), tl.int32)
    rcnt = tl.zeros((BJ, RP), tl.int32)
    flat_b = jj[:, None] * WP + ow[None, :]
    flat_r = jj[:, None] * RP + orr[None, :]

    a_base = (p.to(tl.int64) * N + n) * C * C
    for t in range(0, C):
        row_t = (tok0 + t) * H + h
        ok_t = t < count
        # Token t's entries; padding gets slots that match nothing (-3 and -4).
        s_t, w_t, v_t = token_entries(write_idx, write_w, row_t, ok_t, W, WP, S, -3)
        d_t = _token_decays(decay, row_t, v_t, W, WP, HAS_DECAY)
        q_t, wq_t, vq_t = token_entries(read_idx, read_w, row_t, ok_t, R, RP, S, -4)

        # Own write entries against token t's write and read entries.
        hit = s_b[:, :, None] == s_t[None, None, :]  # [BJ, WP, WP]
        d = _lastprod(tl.where(hit, d_t[None, None, :], 1.0), BJ, WP, WP)  # [BJ, WP]
        kw = tl.sum(tl.where(hit, w_t[None, None, :], 0.0), 2)
        qhit = s_b[:, :, None] == q_t[None, None, :]  # [BJ, WP, RP]
        qw = tl.sum(tl.where(qhit, wq_t[None, None, :], 0.0), 2)
        after = t > jj[:, None]
        since = tl.where(after, since * d, since)
        upto = tl.where(after, upto, upto * d)
        total = total * d
        earlier = (t * WP + ow)[None, None, :] < flat_b[:, :, None]
        cnt += tl.sum((hit & earlier).to(tl.int32), 2)
        a_row = tl.sum(w_b * since * kw, 1)  # [BJ]
        q_row = tl.sum(w_b * since * qw, 1)
        col_ok = jj < C
        tl.store(A + a_base + t * C + jj, tl.where(jj < t, a_row, 0.0), mask=col_ok)
        tl.store(QK + a_base + t * C + jj, tl.where(jj <= t, q_row, 0.0), mask=col_ok)

        # Own read entries: decay of their slot up to their token.
        rhit = s_r[:, :, None] == s_t[None, None, :]  # [BJ, RP, WP]
        rd = _lastprod(tl.where(rhit, d_t[None, None, :], 1.0), BJ, RP, WP)
        rupto = tl.where(t > jj[:, None], rupto, rupto * rd)
        rr = (s_r[:, :, None] == q_t[None, None, :]) & (
            (t * RP + orr)[None, None, :] < flat_r[:, :, None]
        )
        rcnt += tl.sum(rr.to(tl.int32), 2)

    tl.store(gather_w + w_off, w_b * upto, mask=w_ok)
    tl.store(scatter_w + w_off, w_b * since, mask=w_ok)
    tl.store(row_decay + w_off, total, mask=w_ok)
    tl.store(rank + w_off, tl.where(v_b, cnt, 0), mask=w_ok)
    tl.store(gather_r + r_off, w_r * rupto, mask=r_ok)
    tl.store(read_rank + r_off, tl.where(v_r, rcnt, 0), mask=r_ok)


@triton.jit
def _chunk_prepare_kernel(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    chunks,
    A,
    QK,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    shared_count,
    T,
    H,
    S,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    BJ: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
    SPARSE: tl.constexpr,
):
    args = (
        write_idx,
        write_w,
        decay,
        read_idx,
        read_w,
        chunks,
        A,
        QK,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        read_rank,
    )
    if SPARSE:  # the heavy chunks alone (count -1), usually none: see strided_grid
        step = tl.num_programs(0)
        for k in range(tl.cdiv(N * P, step)):
            chunk = tl.program_id(0) + k * step
            if tl.load(shared_count + chunk, mask=chunk < N * P, other=0) < 0:
                for jb in range(C // BJ):
                    n, p = chunk % N, chunk // N
                    _prepare_chunk(
                        *args, n, p, jb * BJ, N, T, H, S, W, R, WP, RP, C, BJ, HAS_DECAY, VARLEN
                    )
    else:  # grid (N, P, C // BJ): a program takes BJ tokens of one chunk
        n, p, j0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BJ
        _prepare_chunk(*args, n, p, j0, N, T, H, S, W, R, WP, RP, C, BJ, HAS_DECAY, VARLEN)


def chunk_prepare_geometry(W: int, R: int, C: int) -> tuple[int, int, int]:
    """(WP, RP, BJ): padded entry counts and own tokens per program."""
    wp = triton.next_power_of_2(max(W, 1))
    rp = triton.next_power_of_2(max(R, 1))
    bj = max(1, min(C, _TILE // (max(wp, rp) * wp)))
    return wp, rp, bj


def chunk_prepare(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows: int,
    chunk_size: int,
    chunks,
    A,
    QK,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    pair_count,
    pair_entries,
) -> None:
    """Launch phase 1; see the module docstring for the operands (all contiguous), and
    ``layout.PairLists`` for ``pair_count`` and ``pair_entries``, which it writes."""
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    C = chunk_size
    N, P = chunk_grid(B, T, H, C, chunks)
    if P * N == 0:
        return
    common = (
        write_idx,
        write_w,
        write_w if decay is None else decay,
        read_idx,
        read_w,
        write_idx if chunks is None else chunks,
        A,
        QK,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        read_rank,
    )
    flags = dict(HAS_DECAY=decay is not None, VARLEN=chunks is not None)
    pairs = (pair_count, pair_entries)
    shared = sparse_launch(False, common, W, R, C, N, P, T, H, bank_rows, flags, pairs)
    wp, rp, bj = chunk_prepare_geometry(W, R, C)
    grid = (N, P, C // bj) if shared is None else strided_grid(N, P, write_idx.device) + (1,)
    wrap_triton(_chunk_prepare_kernel)[grid](
        *common,
        write_idx if shared is None else shared,
        T,
        H,
        bank_rows,
        N,
        P,
        W=W,
        R=R,
        WP=wp,
        RP=rp,
        C=C,
        BJ=bj,
        SPARSE=shared is not None,
        num_warps=_NUM_WARPS,
        **flags,
    )


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------
#
# Gradients of phase 1 with respect to write_w, read_w and decay, given those of A, QK and
# the four per-entry weights. For an own write entry e (token t_e, slot s), with d_t = d_t[s],
# K(t) / Q(t) the write / read weights of token t on s, fwd(t) = prod d over (t_e, t] and
# back(j) = prod d over (j, t_e - 1]:
#
#   dw_e = sum_{t > t_e} dA[t, t_e] fwd K + sum_{t >= t_e} dQK[t, t_e] fwd Q + dgw_e upto_e
#          + dsw_e fwd(C-1) + d_{t_e} sum_{j < t_e} dA[t_e, j] K(j) back(j)
#   dd_e = sum_{j < t_e} Z[j] K(j) back(j) + fwd(C-1) sum_{j < t_e} back(j) sum_{b in j} dsw_b w_b
#          + prod_{t < t_e} d_t * (sum_{t >= t_e} fwd(t) (sum_{b in t} dgw_b w_b
#                                                      + sum_{r in t} dgr_r w_r)
#                                  + fwd(C-1) sum_{b on s} drd_b)
#   with Z = fwdK dA + fwdQ dQK (fwdK[t] = fwd(t) K(t) for t >= t_e, else 0), and
#   ddecay_e = dd_e * (the product of the other decays of token t_e on s).
#
# dd_e is the gradient with respect to the token's decay product on the slot: every product of
# phase 1 that contains d_{t_e} is split around it into a prefix and a suffix, so nothing is
# divided and decays of 0 are exact. For a read entry r (token i, slot s):
#   dw_r = sum_{j <= i} dQK[i, j] K(j) prod d over (j, i] + dgr_r prod_{t <= i} d_t.
#
# Grid: that of the forward's dense kernel; a program owns the write and read entries of BJ
# tokens, flattened (E = BJ * WP write entries), walks the chunk forward once (building fwdK,
# fwdQ in registers), forms Z with two full-float32 dots, and walks it backward once. One
# writer per output.


@triton.jit
def _prepare_chunk_bwd(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    chunks,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    d_write_w,
    d_decay,
    d_read_w,
    n,
    p,
    j0,
    N,
    T,
    H,
    S,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    BJ: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    h = p % H
    if VARLEN:
        tok0 = tl.load(chunks + 2 * n)
        count = tl.load(chunks + 2 * n + 1).to(tl.int32)
    else:
        tok0, count = dense_chunk(n, p, T, H, C)
    E: tl.constexpr = BJ * WP
    ER: tl.constexpr = BJ * RP
    e = tl.arange(0, E)
    te = j0 + e // WP  # own write entry's token (chunk-local)
    we = e % WP
    er = tl.arange(0, ER)
    ti = j0 + er // RP  # own read entry's token
    wr = er % RP
    ow = tl.arange(0, WP)
    orr = tl.arange(0, RP)
    cols = tl.arange(0, C)

    def_ok = (te < count) & (we < W)
    eo = ((tok0 + te) * H + h) * W + we
    s_e = tl.load(write_idx + eo, mask=def_ok, other=-1).to(tl.int64)
    ok_e = def_ok & (s_e >= 0) & (s_e < S)
    s_e = tl.where(ok_e, s_e, -1)
    rdef_ok = (ti < count) & (wr < R)
    ro = ((tok0 + ti) * H + h) * R + wr
    s_r = tl.load(read_idx + ro, mask=rdef_ok, other=-1).to(tl.int64)
    ok_r = rdef_ok & (s_r >= 0) & (s_r < S)
    s_r = tl.where(ok_r, s_r, -2)

    a_base = (p.to(tl.int64) * N + n) * C * C
    # Forward walk.
    fwd = tl.full((E,), 1.0, tl.float32)
    ub = tl.full((E,), 1.0, tl.float32)  # prod_{t < t_e} d_t
    d_self = tl.full((E,), 1.0, tl.float32)
    others = tl.full((E,), 1.0, tl.float32)
    g_acc = tl.zeros((E,), tl.float32)
    rd_sum = tl.zeros((E,), tl.float32)
    dw = tl.zeros((E,), tl.float32)
    fwd_k = tl.zeros((E, C), tl.float32)
    fwd_q = tl.zeros((E, C), tl.float32)
    for t in range(0, C):
        row_t = (tok0 + t) * H + h
        ok_t = t < count
        s_t, w_t, v_t = token_entries(write_idx, write_w, row_t, ok_t, W, WP, S, -3)
        d_t = _token_decays(decay, row_t, v_t, W, WP, HAS_DECAY)
        gw_t = tl.load(d_gather_w + row_t * W + ow, mask=v_t, other=0.0).to(tl.float32)
        rd_t = tl.load(d_row_decay + row_t * W + ow, mask=v_t, other=0.0).to(tl.float32)
        q_t, wq_t, vq_t = token_entries(read_idx, read_w, row_t, ok_t, R, RP, S, -4)
        gr_t = tl.load(d_gather_r + row_t * R + orr, mask=vq_t, other=0.0).to(tl.float32)

        hit = s_e[:, None] == s_t[None, :]  # [E, WP]
        dprod = _rowprod(tl.where(hit, d_t[None, :], 1.0), E, WP)
        kk = tl.sum(tl.where(hit, w_t[None, :], 0.0), 1)
        gs = tl.sum(tl.where(hit, (gw_t * w_t)[None, :], 0.0), 1)
        rds = tl.sum(tl.where(hit, rd_t[None, :], 0.0), 1)
        qhit = s_e[:, None] == q_t[None, :]  # [E, RP]
        qq = tl.sum(tl.where(qhit, wq_t[None, :], 0.0), 1)
        rg = tl.sum(tl.where(qhit, (gr_t * wq_t)[None, :], 0.0), 1)
        before = t < te
        at = t == te
        after = t > te
        ub = tl.where(before, ub * dprod, ub)
        fwd = tl.where(after, fwd * dprod, fwd)
        d_self = tl.where(at, dprod, d_self)
        not_me = at[:, None] & hit & (ow[None, :] != we[:, None])
        others = tl.where(at, _rowprod(tl.where(not_me, d_t[None, :], 1.0), E, WP), others)
        rd_sum += rds
        col_a = tl.load(dA + a_base + t * C + te, mask=after, other=0.0)
        col_q = tl.load(dQK + a_base + t * C + te, mask=t >= te, other=0.0)
        dw += col_a * fwd * kk + col_q * fwd * qq
        g_acc += tl.where(t >= te, fwd * (gs + rg), 0.0)
        sel = (cols[None, :] == t) & (t >= te)[:, None]
        fwd_k = tl.where(sel, (fwd * kk)[:, None], fwd_k)
        fwd_q = tl.where(sel, (fwd * qq)[:, None], fwd_q)

    own_gw = tl.load(d_gather_w + eo, mask=ok_e, other=0.0).to(tl.float32)
    own_sw = tl.load(d_scatter_w + eo, mask=ok_e, other=0.0).to(tl.float32)
    dw += own_gw * ub * d_self + own_sw * fwd
    dd = ub * (g_acc + fwd * rd_sum)
    tile = a_base + cols[:, None] * C + cols[None, :]
    z = tl.dot(fwd_k, tl.load(dA + tile), input_precision="ieee")
    z = tl.dot(fwd_q, tl.load(dQK + tile), z, input_precision="ieee")  # [E, C]

    # Backward walk.
    back = tl.full((E,), 1.0, tl.float32)
    term = tl.zeros((E,), tl.float32)
    ls = tl.zeros((E,), tl.float32)
    row = tl.zeros((E,), tl.float32)
    rback = tl.full((ER,), 1.0, tl.float32)
    rupto = tl.full((ER,), 1.0, tl.float32)
    rdw = tl.zeros((ER,), tl.float32)
    for tt in range(0, C):
        t = C - 1 - tt
        row_t = (tok0 + t) * H + h
        ok_t = t < count
        s_t, w_t, v_t = token_entries(write_idx, write_w, row_t, ok_t, W, WP, S, -3)
        d_t = _token_decays(decay, row_t, v_t, W, WP, HAS_DECAY)
        sw_t = tl.load(d_scatter_w + row_t * W + ow, mask=v_t, other=0.0).to(tl.float32)
        hit = s_e[:, None] == s_t[None, :]
        dprod = _rowprod(tl.where(hit, d_t[None, :], 1.0), E, WP)
        kk = tl.sum(tl.where(hit, w_t[None, :], 0.0), 1)
        gsw = tl.sum(tl.where(hit, (sw_t * w_t)[None, :], 0.0), 1)
        before = t < te
        zc = tl.sum(tl.where(cols[None, :] == t, z, 0.0), 1)
        lw = kk * back
        term += tl.where(before, zc * lw, 0.0)
        ls += tl.where(before, gsw * back, 0.0)
        row += tl.where(before, tl.load(dA + a_base + te * C + t, mask=before, other=0.0) * lw, 0.0)
        back = tl.where(before, back * dprod, back)
        # Own read entries.
        rhit = s_r[:, None] == s_t[None, :]  # [ER, WP]
        rprod = _rowprod(tl.where(rhit, d_t[None, :], 1.0), ER, WP)
        rk = tl.sum(tl.where(rhit, w_t[None, :], 0.0), 1)
        upto_r = t <= ti
        qk_it = tl.load(dQK + a_base + ti * C + t, mask=upto_r & ok_r, other=0.0)
        rdw += tl.where(upto_r, qk_it * rk * rback, 0.0)
        rback = tl.where(upto_r, rback * rprod, rback)
        rupto = tl.where(upto_r, rupto * rprod, rupto)

    dw += d_self * row
    dd += term + fwd * ls
    tl.store(d_write_w + eo, tl.where(ok_e, dw, 0.0), mask=def_ok)
    if HAS_DECAY:
        tl.store(d_decay + eo, tl.where(ok_e, dd * others, 0.0), mask=def_ok)
    own_gr = tl.load(d_gather_r + ro, mask=ok_r, other=0.0).to(tl.float32)
    tl.store(d_read_w + ro, tl.where(ok_r, rdw + own_gr * rupto, 0.0), mask=rdef_ok)


@triton.jit
def _chunk_prepare_bwd_kernel(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    chunks,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    d_write_w,
    d_decay,
    d_read_w,
    shared_count,
    T,
    H,
    S,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    BJ: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
    SPARSE: tl.constexpr,
):
    args = (
        write_idx,
        write_w,
        decay,
        read_idx,
        read_w,
        chunks,
        dA,
        dQK,
        d_gather_w,
        d_gather_r,
        d_scatter_w,
        d_row_decay,
        d_write_w,
        d_decay,
        d_read_w,
    )
    if SPARSE:  # the heavy chunks alone: see _chunk_prepare_kernel
        step = tl.num_programs(0)
        for k in range(tl.cdiv(N * P, step)):
            chunk = tl.program_id(0) + k * step
            if tl.load(shared_count + chunk, mask=chunk < N * P, other=0) < 0:
                for jb in range(C // BJ):
                    n, p = chunk % N, chunk // N
                    _prepare_chunk_bwd(
                        *args, n, p, jb * BJ, N, T, H, S, W, R, WP, RP, C, BJ, HAS_DECAY, VARLEN
                    )
    else:
        n, p, j0 = tl.program_id(0), tl.program_id(1), tl.program_id(2) * BJ
        _prepare_chunk_bwd(*args, n, p, j0, N, T, H, S, W, R, WP, RP, C, BJ, HAS_DECAY, VARLEN)


def chunk_prepare_bwd_geometry(W: int, R: int, C: int) -> tuple[int, int, int]:
    """(WP, RP, BJ): BJ tokens' entries per program, about 64 write entries and at least 16."""
    wp = triton.next_power_of_2(max(W, 1))
    rp = triton.next_power_of_2(max(R, 1))
    bj = min(C, max(1, 64 // wp, triton.cdiv(16, min(wp, rp))))
    return wp, rp, bj


def chunk_prepare_bwd(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows: int,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    d_write_w,
    d_decay,
    d_read_w,
    pair_count,
    pair_entries,
    chunks=None,
) -> None:
    """Launch the phase-1 backward (see above); dA, dQK [B, H, N, C, C] float32 and the
    per-entry gradients float32, all contiguous; d_decay is ignored without decay;
    ``pair_count`` and ``pair_entries`` what the forward sorted (``layout.PairLists``)."""
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    C = dA.shape[-1]
    N, P = chunk_grid(B, T, H, C, chunks)
    if P * N == 0:
        return
    common = (
        write_idx,
        write_w,
        write_w if decay is None else decay,
        read_idx,
        read_w,
        write_idx if chunks is None else chunks,
        dA,
        dQK,
        d_gather_w,
        d_gather_r,
        d_scatter_w,
        d_row_decay,
        d_write_w,
        d_write_w if d_decay is None else d_decay,
        d_read_w,
    )
    flags = dict(HAS_DECAY=decay is not None, VARLEN=chunks is not None)
    pairs = (pair_count, pair_entries)
    shared = sparse_launch(True, common, W, R, C, N, P, T, H, bank_rows, flags, pairs)
    wp, rp, bj = chunk_prepare_bwd_geometry(W, R, C)
    grid = (N, P, C // bj) if shared is None else strided_grid(N, P, write_idx.device) + (1,)
    wrap_triton(_chunk_prepare_bwd_kernel)[grid](
        *common,
        write_idx if shared is None else shared,
        T,
        H,
        bank_rows,
        N,
        P,
        W=W,
        R=R,
        WP=wp,
        RP=rp,
        C=C,
        BJ=bj,
        SPARSE=shared is not None,
        num_warps=_NUM_WARPS,
        **flags,
    )
