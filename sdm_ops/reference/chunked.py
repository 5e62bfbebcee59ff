"""Plain PyTorch implementations of everything sdm_ops computes.

These functions are the CPU path of every ``sdm_internal::`` operator and the oracle of every
kernel test.
They are vectorized over streams (``P = B * H``) and within a chunk, and loop over chunks only
(the token-by-token recurrence loops over tokens). They work in float32 or float64 and are
differentiable with autograd (products of decays are computed with ``prod`` and ``cumprod``,
never by division, so decays of exactly 0 are fine).

Conventions shared with the kernels:

* Streams are ``[P, T, ...]`` after :func:`to_streams`; chunk ``n`` of a stream holds tokens
  ``n * C ... n * C + C - 1``; tokens past ``T`` in the last chunk are padding.
* An index of ``-1`` is padding: its weight and decay are ignored. Callers validate that every
  other index lies in ``[0, S)``; here any index outside ``[0, S)`` is treated as padding too.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from ..layout import FP8_MAX, INT4_MAX, QUANT_GROUP, ChunkWeights, Prepared

__all__ = [
    "ChunkWeights",
    "chunk_weights",
    "compute_dtype",
    "product_key_topk_backward_reference",
    "product_key_topk_bruteforce",
    "product_key_topk_reference",
    "sdm_chunked_reference",
    "sdm_token_reference",
    "wy_solve_backward_reference",
    "wy_solve_reference",
]


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (internal arithmetic)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def to_streams(x: Tensor) -> Tensor:
    """[B, T, H, ...] -> [B * H, T, ...]."""
    b, t, h = x.shape[:3]
    return x.transpose(1, 2).reshape(b * h, t, *x.shape[3:])


def from_streams(x: Tensor, b: int, h: int) -> Tensor:
    """[B * H, T, ...] -> [B, T, H, ...]."""
    return x.reshape(b, h, *x.shape[1:]).transpose(1, 2)


# ---------------------------------------------------------------------------
# WY solve
# ---------------------------------------------------------------------------

def wy_solve_reference(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta[:, None] * A, -1))^-1 and QX = tril(QK) @ X per chunk.

    A, QK: [N, C, C]; beta: [N, C]. Only the strict lower triangle of A and the lower triangle
    of QK are read. Returns X (unit lower triangular) and QX, [N, C, C], zero above the diagonal.
    """
    n, c, _ = A.shape
    eye = torch.eye(c, dtype=A.dtype, device=A.device).expand(n, c, c)
    m = eye + torch.tril(beta.reshape(n, c, 1) * A, -1)
    X = torch.linalg.solve_triangular(m, eye, upper=False, unitriangular=True)
    QX = torch.tril(QK) @ X
    return X, QX


def wy_solve_backward_reference(A: Tensor, beta: Tensor, QK: Tensor, X: Tensor,
                                dX: Tensor, dQX: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`wy_solve_reference` given X and the output gradients.

    With M = I + L: dQK = tril(dQX X^T), dM = -X^T (dX + tril(QK)^T dQX) X^T, dA = beta * dM
    and dbeta = rowsum(dM * A), both over the strict lower triangle. Only the lower triangles of
    dX and dQX can reach the result, since X and QX are structurally zero above the diagonal.
    """
    n, c, _ = A.shape
    Xt = X.transpose(1, 2)
    dQK = torch.tril(dQX @ Xt)
    dM = -(Xt @ (dX + torch.tril(QK).transpose(1, 2) @ dQX) @ Xt)
    dL = torch.tril(dM, -1)
    dA = dL * beta.reshape(n, c, 1)
    dbeta = (dL * A).sum(-1)
    return dA, dbeta.reshape(beta.shape), dQK


# ---------------------------------------------------------------------------
# Product-key top-k
# ---------------------------------------------------------------------------

def _order_key(x: Tensor) -> Tensor:
    """Scores as compared by the top-k: float64 with NaN counted as -inf and -0 as +0."""
    x = x.to(torch.float64)
    return torch.where(torch.isnan(x), torch.full_like(x, -math.inf), x) + 0.0


def _best(score: Tensor, m: int) -> Tensor:
    """Positions of the ``m`` best columns of each row of ``score`` [n, w], best first: larger
    score first (under :func:`_order_key`), equal scores to the smaller position."""
    return torch.argsort(-_order_key(score), dim=-1, stable=True)[:, :m]


def _candidate_pairs(kp: int, kf: int, k: int, device) -> tuple[Tensor, Tensor]:
    """Rank pairs ``(i, j)``, ``i < kp``, ``j < kf``, with ``(i + 1) * (j + 1) <= k``, in
    row-major order (``i`` major): the only pairs that can be among the ``k`` best."""
    i = torch.arange(kp, device=device)[:, None]
    j = torch.arange(kf, device=device)[None, :]
    pi, pj = torch.nonzero((i + 1) * (j + 1) <= k, as_tuple=True)
    return pi, pj


def product_key_topk_reference(raw: Tensor, factors: tuple[int, ...],
                               k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys, factor by factor (the CPU path of the operator).

    Same order and results as :func:`product_key_topk_bruteforce` (bitwise: the same float32
    sums added in factor order), in memory and time that grow with ``sum(factors)`` and ``k``
    (at most about ``k * (ln(k) + 1)`` candidate tuples a row and factor), not with
    ``prod(factors)``.

    Why keeping only the ``k`` best tuples of each prefix is exact: float32 addition with NaN
    counted as -inf never reverses an order (rounding is monotone; a sum with a NaN or -inf
    operand, or inf + -inf, is NaN or -inf, the least score; -0 and +0 give equal sums). So if
    prefix tuple ``p'`` ranks before ``p``, then ``(p', c)`` scores at least ``(p, c)`` and, on
    equal scores, wins by its better prefix rank; if column ``c'`` ranks before ``c`` in its
    factor, ``(p, c')`` beats ``(p, c)`` the same way. A tuple at prefix rank ``i`` and column
    rank ``j`` thus ranks after at least ``(i + 1) * (j + 1) - 1`` others: one among the ``k``
    best has ``i < k``, ``j < k`` and ``(i + 1) * (j + 1) <= k``. These candidates, listed by
    ``(i, j)`` row-major, are in the tie order (prefix rank, then column rank), so a stable
    sort by score ranks them as in the whole product space, and their ``k`` best are the
    prefix's ``k`` best.
    """
    lead = raw.shape[:-1]
    rows = raw.reshape(-1, raw.shape[-1]).to(torch.float32)
    cols = torch.split(rows, list(factors), dim=-1)
    lin = _best(cols[0], min(k, factors[0]))               # [n, kept], best first
    score = torch.gather(cols[0], 1, lin)
    for f in range(1, len(factors)):
        col = _best(cols[f], min(k, factors[f]))           # factor f's best columns
        fval = torch.gather(cols[f], 1, col)
        pi, pj = _candidate_pairs(lin.shape[1], col.shape[1], k, rows.device)
        cand = score[:, pi] + fval[:, pj]                  # float32, in factor order
        keep = _best(cand, min(k, cand.shape[1]))
        score = torch.gather(cand, 1, keep)
        lin = torch.gather(lin[:, pi] * factors[f] + col[:, pj], 1, keep)
    lin, order = torch.sort(lin, dim=-1)
    val = torch.gather(score, 1, order).to(raw.dtype)
    kk = lin.shape[1]
    return val.reshape(*lead, kk), lin.reshape(*lead, kk)


def product_key_topk_bruteforce(raw: Tensor, factors: tuple[int, ...],
                                k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys by brute force: every slot of the product space is scored
    and ranked (memory and time grow with ``prod(factors)``; the oracle of the tests).

    The order (shared with the Triton kernels) is defined factor by factor. Factor 0 ranks its
    columns by value, larger first, equal values to the smaller column. The prefix of factors
    0..f ranks its tuples by score (the float32 sum of the factor values, added in factor order),
    larger first; equal scores go to the better rank of the prefix 0..f-1, then to the better
    rank of factor f's column. NaN counts as -inf and -0 as +0. The kk = min(k, prod(factors))
    best slots are returned with ``lin`` (row-major slot index, int64) ascending and ``val`` the
    scores in ``raw``'s dtype.
    """
    lead = raw.shape[:-1]
    rows = raw.reshape(-1, raw.shape[-1]).to(torch.float32)
    cols = torch.split(rows, list(factors), dim=-1)
    n = rows.shape[0]
    score = cols[0]                                    # [n, prefix slots]
    rank = _rank(score, torch.zeros_like(score, dtype=torch.int64))
    for f in range(1, len(factors)):
        fac = cols[f]
        frank = _rank(fac, torch.zeros_like(fac, dtype=torch.int64))
        width = score.shape[1] * fac.shape[1]
        score = (score[:, :, None] + fac[:, None, :]).reshape(n, width)
        tie = (rank[:, :, None] * factors[f] + frank[:, None, :]).reshape(n, width)
        rank = _rank(score, tie)
    kk = min(k, math.prod(factors))
    best = torch.argsort(rank, dim=-1)[:, :kk]
    lin, _ = torch.sort(best, dim=-1)
    val = torch.gather(score, 1, lin).to(raw.dtype)
    return val.reshape(*lead, kk), lin.reshape(*lead, kk)


def _rank(score: Tensor, tie: Tensor) -> Tensor:
    """Rank (0 = best) of each column: score descending, then ``tie`` ascending."""
    key = _order_key(score)
    order = torch.argsort(tie, dim=-1, stable=True)
    key_sorted = torch.gather(key, 1, order)
    order = torch.gather(order, 1, torch.argsort(-key_sorted, dim=-1, stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return rank


def product_key_topk_backward_reference(lin: Tensor, grad_val: Tensor,
                                        factors: tuple[int, ...]) -> Tensor:
    """grad_raw [..., sum(factors)] float32: each selected slot adds its value gradient to the
    one column of each factor that it sums."""
    lead = lin.shape[:-1]
    lin2 = lin.reshape(-1, lin.shape[-1])
    g = grad_val.reshape(lin2.shape).to(torch.float32)
    out = torch.zeros(lin2.shape[0], sum(factors), dtype=torch.float32, device=lin.device)
    rest = lin2
    offset = sum(factors)
    for f in reversed(factors):
        offset -= f
        col = rest % f
        rest = rest // f
        out.scatter_add_(1, col + offset, g)
    return out.reshape(*lead, sum(factors))


# ---------------------------------------------------------------------------
# The recurrence
# ---------------------------------------------------------------------------

def _entries(idx: Tensor, w: Tensor, s: int, decay: Tensor | None = None):
    """Slots (padding -> -1), masked weights and masked decays of entries."""
    valid = (idx >= 0) & (idx < s)
    slot = torch.where(valid, idx.to(torch.int64), -1)
    w = torch.where(valid, w, torch.zeros_like(w))
    if decay is not None:
        decay = torch.where(valid, decay, torch.ones_like(decay))
    return slot, w, decay


def sdm_token_reference(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None):
    """SPEC section 1 token by token on dense per-stream state (small S only).

    Returns (out [B, T, H, D], bank [B, H, S, D]) in the compute dtype.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, T, H, D = v.shape
    S = bank.shape[-2]
    M = bank.to(cd).expand(B, H, S, D).clone()
    outs = []
    for t in range(T):
        slot, w, dec = _entries(write_idx[:, t], write_w[:, t].to(cd), S,
                                None if decay is None else decay[:, t].to(cd))
        rslot, rw, _ = _entries(read_idx[:, t], read_w[:, t].to(cd), S)
        k = torch.zeros(B, H, S, dtype=cd)
        d = torch.ones(B, H, S, dtype=cd)
        for j in range(slot.shape[-1]):
            hit = torch.nn.functional.one_hot(slot[..., j].clamp(min=0), S).to(torch.bool)
            hit &= (slot[..., j] >= 0)[..., None]
            k = k + torch.where(hit, w[..., j:j + 1], 0)
            if dec is not None:
                d = d * torch.where(hit, dec[..., j:j + 1], 1)
        q = torch.zeros(B, H, S, dtype=cd)
        for j in range(rslot.shape[-1]):
            hit = torch.nn.functional.one_hot(rslot[..., j].clamp(min=0), S).to(torch.bool)
            hit &= (rslot[..., j] >= 0)[..., None]
            q = q + torch.where(hit, rw[..., j:j + 1], 0)
        Mp = d[..., None] * M
        err = v[:, t].to(cd) - torch.einsum("bhs,bhsd->bhd", k, Mp)
        M = Mp + beta[:, t].to(cd)[..., None, None] * k[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhs,bhsd->bhd", q, M))
    out = torch.stack(outs, 1) if outs else v.new_zeros(B, 0, H, D, dtype=cd)
    return out, M


def decode_step_reference(bank, v, beta, write_idx, write_w, read_idx, read_w, decay=None):
    """One token (T = 1) of SPEC section 1 on every stream, touching only the rows the token
    addresses (any S): d[s] is the product of the token's decays on slot s and K[s] the sum
    of its write weights there, so M[s] <- d[s] M[s] + K[s] u with u = beta (v - sum_a w_a
    d[s_a] M[s_a]), and out reads the written rows as d M + K u.

    bank [B, H, S, D]; v [B, 1, H, D]; the rest as in :func:`sdm_token_reference` with T = 1.
    Returns (out [B, 1, H, D], new [B, H, W, D], slot [B, H, W]) in the compute dtype: the
    new row of each write entry's slot (entries on one slot get the same row) and the slots
    (-1 for padding), for the caller to store.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, _, H, D = v.shape
    S = bank.shape[-2]
    slot, w, dec = _entries(write_idx[:, 0], write_w[:, 0].to(cd), S,
                            None if decay is None else decay[:, 0].to(cd))       # [B, H, W]
    rslot, rw, _ = _entries(read_idx[:, 0], read_w[:, 0].to(cd), S)              # [B, H, R]
    if dec is None:
        dec = torch.ones_like(w)

    def on_slot(x, y):          # [..., X, W]: entry of x and write entry of y on one slot
        return (x[..., :, None] == y[..., None, :]) & (x[..., :, None] >= 0)

    same, hit = on_slot(slot, slot), on_slot(rslot, slot)
    d = torch.where(same, dec[..., None, :], 1).prod(-1)
    K = torch.where(same, w[..., None, :], 0).sum(-1)
    d_r = torch.where(hit, dec[..., None, :], 1).prod(-1)
    K_r = torch.where(hit, w[..., None, :], 0).sum(-1)
    M = bank.to(cd).reshape(B * H, S, D)
    rows = _gather_rows(M, slot.reshape(B * H, -1)).reshape(B, H, -1, D)
    qrows = _gather_rows(M, rslot.reshape(B * H, -1)).reshape(B, H, -1, D)
    u = beta[:, 0].to(cd)[..., None] * (v[:, 0].to(cd) - ((w * d)[..., None] * rows).sum(-2))
    out = (rw[..., None] * (d_r[..., None] * qrows + K_r[..., None] * u[..., None, :])).sum(-2)
    new = d[..., None] * rows + K[..., None] * u[..., None, :]
    return out[:, None], new, slot


class _ChunkEntries(NamedTuple):
    """A chunk's entries flattened token-major (E = C * W write, Er = C * R read entries), with
    the slot-match matrices that phase 1 and its backward are built from."""
    s_b: Tensor      # [P, E] write slots, -1 for padding
    w_b: Tensor      # [P, E] write weights (0 for padding)
    d_b: Tensor      # [P, E] decays (1 for padding)
    s_r: Tensor      # [P, Er] read slots
    w_r: Tensor      # [P, Er] read weights
    ok_b: Tensor
    ok_r: Tensor
    same: Tensor     # [P, E, E] write entries on one slot
    rsame: Tensor    # [P, Er, E] read entry and write entry on one slot
    slot: Tensor     # [P, C, W]
    rslot: Tensor    # [P, C, R]


def _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s: int) -> _ChunkEntries:
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    if decay is None:
        decay = torch.ones_like(write_w)
    slot, w, dec = _entries(write_idx, write_w, s, decay)
    rslot, rw, _ = _entries(read_idx, read_w, s)
    s_b, w_b, d_b = slot.reshape(P, C * W), w.reshape(P, C * W), dec.reshape(P, C * W)
    s_r, w_r = rslot.reshape(P, C * R), rw.reshape(P, C * R)
    ok_b, ok_r = s_b >= 0, s_r >= 0
    same = (s_b[:, :, None] == s_b[:, None, :]) & ok_b[:, :, None] & ok_b[:, None, :]
    rsame = (s_r[:, :, None] == s_b[:, None, :]) & ok_r[:, :, None] & ok_b[:, None, :]
    return _ChunkEntries(s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, slot, rslot)


def chunk_weights(write_idx, write_w, read_idx, read_w, decay, s: int) -> ChunkWeights:
    """Phase 1 of SPEC section 2 for one chunk of every stream (inputs [P, C, W] / [P, C, R])."""
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    cd = write_w.dtype
    ce = _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s)
    s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, slot, rslot = ce
    E, Er = C * W, C * R
    tok = torch.arange(C, device=slot.device)
    tok_b, tok_r = tok.repeat_interleave(W), tok.repeat_interleave(R)
    one = torch.ones((), dtype=cd, device=slot.device)
    # dec_on[x, t]: decay that token t applies to the slot of entry x (product over its entries).
    dec_on = torch.where(same, d_b[:, None, :], one).reshape(P, E, C, W).prod(-1)       # [P, E, C]
    rdec_on = torch.where(rsame, d_b[:, None, :], one).reshape(P, Er, C, W).prod(-1)    # [P, Er, C]
    # since[b, i] = Gamma_{i/j} on b's slot, j = b's token (1 for i <= j).
    since = torch.cumprod(torch.where(tok[None, None, :] > tok_b[None, :, None], dec_on, one), -1)
    upto = torch.cumprod(dec_on, -1)                                                     # [P, E, C]
    rupto = torch.cumprod(rdec_on, -1)
    gather_w = w_b * upto.gather(2, tok_b.expand(P, E)[..., None]).squeeze(-1)
    gather_r = w_r * rupto.gather(2, tok_r.expand(P, Er)[..., None]).squeeze(-1)
    scatter_w = w_b * since[..., C - 1]
    row_decay = upto[..., C - 1]
    # Pair terms: w_a w_b Gamma_{i/j} for entries a (token i) and b (token j) on one slot.
    since_at_a = since.transpose(1, 2)[:, tok_b, :]                                # [P, E(a), E(b)]
    pair = torch.where(same, w_b[:, :, None] * w_b[:, None, :] * since_at_a, 0)
    A = torch.tril(pair.reshape(P, C, W, C, W).sum((2, 4)), -1)
    since_at_r = since.transpose(1, 2)[:, tok_r, :]
    rpair = torch.where(rsame, w_r[:, :, None] * w_b[:, None, :] * since_at_r, 0)
    QK = torch.tril(rpair.reshape(P, C, R, C, W).sum((2, 4)))
    earlier = torch.arange(E, device=slot.device)
    rank = (same & (earlier[None, None, :] < earlier[None, :, None])).sum(-1)
    rearlier = torch.arange(Er, device=slot.device)
    rr = (s_r[:, :, None] == s_r[:, None, :]) & ok_r[:, :, None] & ok_r[:, None, :]
    read_rank = (rr & (rearlier[None, None, :] < rearlier[None, :, None])).sum(-1)
    return ChunkWeights(A, QK, gather_w.reshape(P, C, W), gather_r.reshape(P, C, R),
                        scatter_w.reshape(P, C, W), row_decay.reshape(P, C, W),
                        rank.reshape(P, C, W), read_rank.reshape(P, C, R), slot, rslot)


def _gather_rows(M: Tensor, slot: Tensor) -> Tensor:
    """Rows M[p, slot] ([P, S, D], slot [P, N]) -> [P, N, D], zero for padding."""
    rows = torch.gather(M, 1, slot.clamp(min=0)[..., None].expand(*slot.shape, M.shape[-1]))
    zero = torch.zeros((), dtype=M.dtype, device=M.device)
    return torch.where((slot >= 0)[..., None], rows, zero)


def _chunked(x: Tensor, c: int, fill) -> Tensor:
    """[P, T, ...] -> [P * N, C, ...], padding the last chunk with ``fill``."""
    p, t = x.shape[:2]
    n = -(-t // c)
    pad = n * c - t
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad), value=fill)
    return x.reshape(p * n, c, *x.shape[2:])


def _unchunked(x: Tensor, p: int, t: int) -> Tensor:
    """[P * N, C, ...] -> [P, T, ...]."""
    n = x.shape[0] // p if p else 0
    return x.reshape(p, n * x.shape[1], *x.shape[2:])[:, :t]


def chunk_prepare_reference(write_idx, write_w, read_idx, read_w, decay, bank_rows: int,
                            chunk_size: int, *, slab: int = 256) -> Prepared:
    """Phase 1 (bank-free) for all chunks, ``slab`` chunks at a time (bounded memory)."""
    cd = compute_dtype(write_w, read_w, decay)
    B, T, H, W = write_idx.shape
    P, C = B * H, chunk_size
    wi = _chunked(to_streams(write_idx), C, -1)
    ww = _chunked(to_streams(write_w.to(cd)), C, 0)
    ri = _chunked(to_streams(read_idx), C, -1)
    rw = _chunked(to_streams(read_w.to(cd)), C, 0)
    dc = None if decay is None else _chunked(to_streams(decay.to(cd)), C, 1)
    parts = [chunk_weights(wi[i:i + slab], ww[i:i + slab], ri[i:i + slab], rw[i:i + slab],
                           None if dc is None else dc[i:i + slab], bank_rows)
             for i in range(0, wi.shape[0], slab)]
    cw = ChunkWeights(*(torch.cat(f, 0) if parts else None for f in zip(*parts))) if parts else None
    N = wi.shape[0] // max(P, 1) if P else 0
    if cw is None:   # T == 0 (or no streams)
        z = torch.zeros(B, H, 0, C, C, dtype=cd, device=write_idx.device)
        e = write_w.new_zeros(B, T, H, W, dtype=cd)
        R = read_idx.shape[-1]
        return Prepared(z, z.clone(), e, read_w.new_zeros(B, T, H, R, dtype=cd),
                        e.clone(), e + 1,
                        torch.zeros(B, T, H, W, dtype=torch.int32, device=e.device),
                        torch.zeros(B, T, H, R, dtype=torch.int32, device=e.device))

    def entries(x):
        return from_streams(_unchunked(x, P, T), B, H)

    return Prepared(cw.A.reshape(B, H, N, C, C), cw.QK.reshape(B, H, N, C, C),
                    entries(cw.gather_w), entries(cw.gather_r), entries(cw.scatter_w),
                    entries(cw.row_decay), entries(cw.rank).to(torch.int32),
                    entries(cw.read_rank).to(torch.int32))


def quantize_rows(rows: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """Snapshot rows [..., D] (float32) in ``mode``: (codes, scales [..., D / 16] or empty).

    none: the rows unchanged (callers store them in the bank dtype); bf16: rounded to bfloat16;
    fp8: float8_e4m3fn codes of rows / scale, with scale = amax / 448 per group of 16 columns,
    stored as their bit patterns (uint8);
    int4: round-half-up(rows / scale) in [-7, 7], scale = amax / 7, stored + 8 two per byte
    (even column in the low nibble). A group of zeros gets scale 1.
    """
    if mode in ("none", "bf16"):
        return (rows if mode == "none" else rows.to(torch.bfloat16)), rows.new_zeros(0)
    d = rows.shape[-1]
    g = rows.reshape(*rows.shape[:-1], d // QUANT_GROUP, QUANT_GROUP)
    top = FP8_MAX if mode == "fp8" else INT4_MAX
    amax = g.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    x = g / scale
    if mode == "fp8":
        codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).reshape(rows.shape)
        codes = codes.view(torch.uint8)
    else:
        q = torch.floor(x + 0.5).clamp(-INT4_MAX, INT4_MAX) + 8
        q = q.to(torch.uint8).reshape(rows.shape)
        codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, scale.squeeze(-1).to(torch.float32)


def dequantize_rows(codes: Tensor, scale: Tensor, mode: str) -> Tensor:
    """Inverse of :func:`quantize_rows` (float32 rows)."""
    if mode in ("none", "bf16"):
        return codes.to(torch.float32)
    if mode == "fp8":
        x = codes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        lo = (codes & 15).to(torch.float32) - 8
        hi = (codes >> 4).to(torch.float32) - 8
        x = torch.stack((lo, hi), -1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    g = x.reshape(*x.shape[:-1], -1, QUANT_GROUP) * scale[..., None]
    return g.reshape(x.shape)


def recurrence_fwd_reference(v, beta, write_idx, read_idx, prep: Prepared, X, QX, bank,
                             snapshot: str = "none"):
    """Phase 2 (gathers, dual matmul, decay and write) for all chunks, given phase 1 and the
    WY solve (X, QX: [B, H, N, C, C]).

    Returns (out [B, T, H, D], bank [B, H, S, D], snap, snap_scale, res [B, T, H, D], delta
    [B, T, H, D]) where snap holds the chunk-start bank row of every write entry, then of every
    read entry, [B, T, H, W + R, D] (zeros for padding), quantized by :func:`quantize_rows`:
    every bank row the backward reads. res = v - retrieved and
    delta = X (beta res). out, res, delta and the bank are in the compute dtype.
    """
    cd = compute_dtype(v, bank, prep.gather_w)
    B, T, H, D = v.shape
    S = bank.shape[-2]
    P = B * H
    C = X.shape[-1]
    M = bank.to(cd).expand(B, H, S, D).reshape(P, S, D).clone()     # never the input itself
    vs, bs = _chunked(to_streams(v.to(cd)), C, 0), _chunked(to_streams(beta.to(cd)), C, 0)
    slot = _chunked(to_streams(_entries(write_idx, write_idx, S)[0]), C, -1)
    rslot = _chunked(to_streams(_entries(read_idx, read_idx, S)[0]), C, -1)
    gw, sw = _chunked(to_streams(prep.gather_w), C, 0), _chunked(to_streams(prep.scatter_w), C, 0)
    rd, gr = _chunked(to_streams(prep.row_decay), C, 1), _chunked(to_streams(prep.gather_r), C, 0)
    first = _chunked(to_streams(prep.rank), C, 1) == 0
    N = vs.shape[0] // P if P else 0
    Xs, QXs = X.reshape(P, N, C, C), QX.reshape(P, N, C, C)
    outs, snaps, resids, deltas = [], [], [], []
    for n in range(N):
        c = torch.arange(P, device=v.device) * N + n
        sl, rsl = slot[c], rslot[c]
        wrows = _gather_rows(M, sl.reshape(P, -1)).reshape(P, C, -1, D)
        rrows = _gather_rows(M, rsl.reshape(P, -1)).reshape(P, C, -1, D)
        retrieved = (gw[c][..., None] * wrows).sum(2)
        inter = (gr[c][..., None] * rrows).sum(2)
        resid = vs[c] - retrieved
        u = bs[c][..., None] * resid
        delta = Xs[:, n] @ u
        outs.append(inter + QXs[:, n] @ u)
        snaps.append(torch.cat([wrows, rrows], 2))
        resids.append(resid)
        deltas.append(delta)
        # Decay and write: the first entry on a slot also moves its row by (Gamma_C - 1) M_0.
        add = sw[c][..., None] * delta[:, :, None, :]
        add = add + torch.where(first[c][..., None], (rd[c][..., None] - 1) * wrows, 0)
        flat = sl.reshape(P, -1)
        add = torch.where((flat >= 0)[..., None], add.reshape(P, -1, D), 0)
        M = M.scatter_add(1, flat.clamp(min=0)[..., None].expand(P, flat.shape[1], D), add)

    def tokens(parts, *shape):
        if not parts:
            return v.new_zeros(B, T, H, *shape, dtype=cd)
        x = torch.stack(parts, 1).reshape(P * N, C, *shape)
        return from_streams(_unchunked(x, P, T), B, H)

    rows = tokens(snaps, write_idx.shape[-1] + read_idx.shape[-1], D)
    snap, snap_scale = quantize_rows(rows.to(torch.float32) if snapshot != "none" else rows,
                                     snapshot)
    if snapshot == "none":
        snap = snap.to(bank.dtype if cd == torch.float32 else cd)
    return (tokens(outs, D), M.reshape(B, H, S, D), snap, snap_scale, tokens(resids, D),
            tokens(deltas, D))


def sdm_chunked_reference(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None,
                          chunk_size: int = 64):
    """SPEC section 2: phase 1, the WY solve and phase 2, vectorized over streams.

    v [B, T, H, D]; beta [B, T, H]; write_idx, write_w, decay [B, T, H, W]; read_idx, read_w
    [B, T, H, R]; bank [B, H, S, D] or [H, S, D]. Returns (out [B, T, H, D], bank [B, H, S, D])
    in the compute dtype (float64 if any input is float64, else float32). Differentiable.
    """
    cd = compute_dtype(v, bank, write_w, read_w, beta, decay)
    B, T, H, _ = v.shape
    C = chunk_size
    prep = chunk_prepare_reference(write_idx, write_w.to(cd), read_idx, read_w.to(cd),
                                   None if decay is None else decay.to(cd), bank.shape[-2], C)
    N = prep.A.shape[2]
    betas = _chunked(to_streams(beta.to(cd)), C, 0) if T else beta.new_zeros(0, C, dtype=cd)
    X, QX = wy_solve_reference(prep.A.reshape(-1, C, C), betas.reshape(-1, C),
                               prep.QK.reshape(-1, C, C))
    X, QX = X.reshape(B, H, N, C, C), QX.reshape(B, H, N, C, C)
    out, M = recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X, QX, bank)[:2]
    return out, M


def recurrence_bwd_reference(v, beta, write_idx, read_idx, prep: Prepared, X, QX, bank_rows: int,
                             snap, snap_scale, snapshot: str, res, delta, dout, dbank_out):
    """Backward of :func:`recurrence_fwd_reference`, walking the chunks in reverse.

    Every bank row it reads (the chunk-start row of each write and read entry) comes from
    ``snap`` (dequantized), so the rows seen are the forward's up to the snapshot's rounding;
    ``bank_rows`` is S. ``res = v - retrieved`` and ``delta`` are the forward's.
    Returns (dv, dbeta, dgather_w, dgather_r, dscatter_w, drow_decay, dX, dQX, dbank [B, H, S, D]).
    drow_decay is non-zero only on the first entry of each slot (the one the forward reads).
    """
    cd = compute_dtype(v, X, prep.gather_w)
    B, T, H, D = v.shape
    S = bank_rows
    P = B * H
    C = X.shape[-1]
    dM = (torch.zeros(P, S, D, dtype=cd, device=v.device) if dbank_out is None
          else dbank_out.to(cd).reshape(P, S, D).clone())
    dout = torch.zeros(B, T, H, D, dtype=cd, device=v.device) if dout is None else dout.to(cd)
    rows = dequantize_rows(snap, snap_scale, snapshot).to(cd) if snapshot != "none" else snap.to(cd)

    def chunks(x, fill):
        return _chunked(to_streams(x), C, fill)

    slot = chunks(_entries(write_idx, write_idx, S)[0], -1)
    rslot = chunks(_entries(read_idx, read_idx, S)[0], -1)
    gw, sw = chunks(prep.gather_w.to(cd), 0), chunks(prep.scatter_w.to(cd), 0)
    rd = chunks(prep.row_decay.to(cd), 1)
    gr = chunks(prep.gather_r.to(cd), 0)
    first = (chunks(prep.rank, 1) == 0) & (slot >= 0)
    bs, rs = chunks(beta.to(cd), 0), chunks(res.to(cd), 0)
    dl, do = chunks(delta.to(cd), 0), chunks(dout, 0)
    snaps = chunks(rows, 0)
    N = bs.shape[0] // P if P else 0
    Xs, QXs = X.to(cd).reshape(P, N, C, C), QX.to(cd).reshape(P, N, C, C)
    parts = {k: [None] * N for k in ("dv", "dbeta", "dgw", "dgr", "dsw", "drd", "dX", "dQX")}
    for n in reversed(range(N)):
        c = torch.arange(P, device=v.device) * N + n
        sl, rsl, fr = slot[c], rslot[c], first[c]
        flat = sl.reshape(P, -1)
        W = sl.shape[-1]
        wrows, rrows = snaps[c][:, :, :W], snaps[c][:, :, W:]
        dm1 = _gather_rows(dM, flat).reshape(P, C, -1, D)
        ddelta = (sw[c][..., None] * dm1).sum(2)
        parts["dsw"][n] = (dm1 * dl[c][:, :, None, :]).sum(-1)
        parts["drd"][n] = torch.where(fr, (dm1 * wrows).sum(-1), 0)
        u = bs[c][..., None] * rs[c]
        du = Xs[:, n].transpose(1, 2) @ ddelta + QXs[:, n].transpose(1, 2) @ do[c]
        parts["dX"][n] = ddelta @ u.transpose(1, 2)
        parts["dQX"][n] = do[c] @ u.transpose(1, 2)
        parts["dv"][n] = bs[c][..., None] * du
        parts["dbeta"][n] = (du * rs[c]).sum(-1)
        dret = -bs[c][..., None] * du
        parts["dgw"][n] = (dret[:, :, None, :] * wrows).sum(-1)
        parts["dgr"][n] = (do[c][:, :, None, :] * rrows).sum(-1)
        add = (torch.where(fr[..., None], (rd[c][..., None] - 1) * dm1, 0)
               + gw[c][..., None] * dret[:, :, None, :])
        add = torch.where((flat >= 0)[..., None], add.reshape(P, -1, D), 0)
        dM = dM.scatter_add(1, flat.clamp(min=0)[..., None].expand(*flat.shape, D), add)
        rflat = rsl.reshape(P, -1)
        radd = (gr[c][..., None] * do[c][:, :, None, :]).reshape(P, -1, D)
        radd = torch.where((rflat >= 0)[..., None], radd, 0)
        dM = dM.scatter_add(1, rflat.clamp(min=0)[..., None].expand(*rflat.shape, D), radd)

    def tokens(name, *shape):
        if N == 0:
            return v.new_zeros(B, T, H, *shape, dtype=cd)
        x = torch.stack(parts[name], 1).reshape(P * N, C, *shape)
        return from_streams(_unchunked(x, P, T), B, H)

    W, R = write_idx.shape[-1], read_idx.shape[-1]
    chunk = lambda name: (torch.stack(parts[name], 1).reshape(B, H, N, C, C) if N
                          else v.new_zeros(B, H, 0, C, C, dtype=cd))
    return (tokens("dv", D), tokens("dbeta"), tokens("dgw", W), tokens("dgr", R), tokens("dsw", W),
            tokens("drd", W), chunk("dX"), chunk("dQX"), dM.reshape(B, H, S, D))


def _chunk_weights_backward(write_idx, write_w, read_idx, read_w, decay, s: int, dA, dQK,
                            dgw, dgr, dsw, drd):
    """Explicit backward of :func:`chunk_weights` (inputs [P, C, W] / [P, C, R], dA and dQK
    [P, C, C]); the same algorithm as the phase-1 backward kernel: every decay product that
    contains a token's decay is split into the product before it and the product after it."""
    P, C, W = write_idx.shape
    R = read_idx.shape[-1]
    cd = write_w.dtype
    ce = _chunk_entries(write_idx, write_w, read_idx, read_w, decay, s)
    s_b, w_b, d_b, s_r, w_r, ok_b, ok_r, same, rsame, _, _ = ce
    E, Er = C * W, C * R
    dev = s_b.device
    tok = torch.arange(C, device=dev)
    te, ti = tok.repeat_interleave(W), tok.repeat_interleave(R)
    wsame = (s_b[:, :, None] == s_r[:, None, :]) & ok_b[:, :, None] & ok_r[:, None, :]  # [P, E, Er]
    one = torch.ones((), dtype=cd, device=dev)

    def per_token(match, vals, n):      # [P, X, C * n] -> sum over a token's entries: [P, X, C]
        return torch.where(match, vals[:, None, :], 0).reshape(*match.shape[:2], C, n).sum(-1)

    dec_on = torch.where(same, d_b[:, None, :], one).reshape(P, E, C, W).prod(-1)        # [P, E, C]
    K = per_token(same, w_b, W)
    Q = per_token(wsame, w_r, R)
    Gs = per_token(same, dgw.reshape(P, E) * w_b, W) + per_token(wsame, dgr.reshape(P, Er) * w_r, R)
    Gsw = per_token(same, dsw.reshape(P, E) * w_b, W)
    Rd = per_token(same, drd.reshape(P, E), W).sum(-1)
    t_ = tok[None, None, :]
    te_ = te[None, :, None]
    fwd = torch.cumprod(torch.where(t_ > te_, dec_on, one), -1)                          # (te, t]
    ub = torch.where(t_ < te_, dec_on, one).prod(-1)
    incl = torch.flip(torch.cumprod(torch.flip(torch.where(t_ < te_, dec_on, one), [-1]), -1), [-1])
    back = torch.cat([incl[..., 1:], torch.ones_like(incl[..., :1])], -1)                # (j, te-1]
    d_self = dec_on.gather(2, te.expand(P, E)[..., None]).squeeze(-1)
    me = torch.arange(E, device=dev)
    at_te = (te[None, :, None] == te[None, None, :]) & (me[None, :, None] != me[None, None, :])
    others = torch.where(same & at_te, d_b[:, None, :], one).prod(-1)
    dA_col = dA.transpose(1, 2)[:, te, :]            # [P, E, C]: dA[t, te] over t
    dQK_col = dQK.transpose(1, 2)[:, te, :]
    dA_row = dA[:, te, :]                            # [P, E, C]: dA[te, j] over j
    after, from_te, before = t_ > te_, t_ >= te_, t_ < te_
    fwd_end = fwd[..., C - 1]
    dw = (torch.where(after, dA_col * fwd * K, 0).sum(-1)
          + torch.where(from_te, dQK_col * fwd * Q, 0).sum(-1)
          + dgw.reshape(P, E) * ub * d_self + dsw.reshape(P, E) * fwd_end
          + d_self * torch.where(before, dA_row * K * back, 0).sum(-1))
    fwdK = torch.where(from_te, fwd * K, 0)
    fwdQ = torch.where(from_te, fwd * Q, 0)
    Z = fwdK @ dA + fwdQ @ dQK                                                           # [P, E, C]
    dd = (torch.where(before, Z * K * back, 0).sum(-1)
          + fwd_end * torch.where(before, back * Gsw, 0).sum(-1)
          + ub * (torch.where(from_te, fwd * Gs, 0).sum(-1) + fwd_end * Rd))
    d_decay = torch.where(ok_b, dd * others, 0)
    dw = torch.where(ok_b, dw, 0)
    # Read entries.
    rdec = torch.where(rsame, d_b[:, None, :], one).reshape(P, Er, C, W).prod(-1)       # [P, Er, C]
    Kr = per_token(rsame, w_b, W)
    ti_ = ti[None, :, None]
    upto_r = t_ <= ti_
    rincl = torch.flip(torch.cumprod(torch.flip(torch.where(upto_r, rdec, one), [-1]), -1), [-1])
    rback = torch.cat([rincl[..., 1:], torch.ones_like(rincl[..., :1])], -1)              # (j, i]
    rupto = torch.where(upto_r, rdec, one).prod(-1)
    dQK_row = dQK[:, ti, :]
    drw = (torch.where(upto_r, dQK_row * Kr * rback, 0).sum(-1) + dgr.reshape(P, Er) * rupto)
    drw = torch.where(ok_r, drw, 0)
    return dw.reshape(P, C, W), drw.reshape(P, C, R), d_decay.reshape(P, C, W)


def chunk_prepare_backward_reference(write_idx, write_w, read_idx, read_w, decay, bank_rows: int,
                                     dA, dQK, d_gather_w, d_gather_r, d_scatter_w, d_row_decay,
                                     *, slab: int = 256):
    """Backward of :func:`chunk_prepare_reference`: (d_write_w, d_read_w, d_decay or None)."""
    cd = compute_dtype(write_w, read_w, decay)
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    P, C = B * H, dA.shape[-1]

    def ch(x, fill):
        return _chunked(to_streams(x), C, fill)

    wi, ri = ch(write_idx, -1), ch(read_idx, -1)
    ww, rw = ch(write_w.to(cd), 0), ch(read_w.to(cd), 0)
    dc = None if decay is None else ch(decay.to(cd), 1)
    gw, gr, sw, rd = (ch(x.to(cd), 0) for x in (d_gather_w, d_gather_r, d_scatter_w, d_row_decay))
    a, q = dA.to(cd).reshape(-1, C, C), dQK.to(cd).reshape(-1, C, C)
    parts = [_chunk_weights_backward(wi[i:i + slab], ww[i:i + slab], ri[i:i + slab], rw[i:i + slab],
                                     None if dc is None else dc[i:i + slab], bank_rows,
                                     a[i:i + slab], q[i:i + slab], gw[i:i + slab], gr[i:i + slab],
                                     sw[i:i + slab], rd[i:i + slab])
             for i in range(0, wi.shape[0], slab)]
    if not parts:
        z = write_w.new_zeros(B, T, H, W, dtype=cd)
        return z, read_w.new_zeros(B, T, H, R, dtype=cd), (None if decay is None else z.clone())
    dww, drw, ddc = (torch.cat(f, 0) for f in zip(*parts))

    def entries(x):
        return from_streams(_unchunked(x, P, T), B, H)

    return entries(dww), entries(drw), (None if decay is None else entries(ddc))


# ---------------------------------------------------------------------------
# Variable-length batches (cu_seqlens)
# ---------------------------------------------------------------------------
#
# A packed batch is [1, T, H, ...] with sequence n on tokens cu_seqlens[n] : cu_seqlens[n + 1].
# Chunks never straddle sequences, so the chunk axis of A, QK, X, QX ([1, H, NC, C, C]) holds
# "chunk slots": sequence n owns slots seq_chunks[n] : seq_chunks[n + 1], NC = ceil(T / C) + N
# bounds their total from above without reading cu_seqlens, and slots past the total are unused
# (no tokens; phase 1 writes them zero). Every operator takes the two tables below.


def varlen_chunks(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunk tables of a packed batch, computed on cu_seqlens' device without a host sync.

    Returns ``chunks`` [NC, 2] int64, (first token, token count) of each chunk slot ((0, 0) when
    unused), and ``seq_chunks`` [N + 1] int64, the first slot of each sequence and the end.

    Compiled code and CUDA graphs skip the eager checks of ``cu_seqlens``, so the tables are
    made safe for any values: offsets are clamped to [0, T], a decrease counts as an empty
    sequence and slots stop at NC. Every chunk then lies inside the batch's T tokens and every
    slot inside the tables, whatever ``cu_seqlens`` holds (valid offsets are unchanged).
    """
    C = chunk_size
    NC = -(-T // C) + cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64).clamp(0, T)
    N = cu.shape[0] - 1
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    ends = torch.cumsum((lens + C - 1) // C, 0)
    seq_chunks = torch.cat([ends.new_zeros(1), ends]).clamp(max=NC)
    slot = torch.arange(NC, device=cu.device)
    seq = torch.searchsorted(ends, slot, right=True)            # N for unused slots
    used = seq < N
    seq = seq.clamp(max=N - 1)
    local = (slot - seq_chunks[seq]) * C
    start = torch.where(used, cu[seq] + local, 0)
    count = torch.where(used, (lens[seq] - local).clamp(max=C), 0)
    return torch.stack([start, count], 1), seq_chunks


def varlen_sequences(chunks: Tensor, seq_chunks: Tensor) -> list[tuple[int, int, int, int]]:
    """(first token, length, first chunk slot, chunk count) of each sequence (reads the tables
    on the host: the CPU path and tests only)."""
    table = chunks.tolist()
    bounds = seq_chunks.tolist()
    seqs = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        start = table[c0][0] if c1 > c0 else 0
        length = sum(table[c][1] for c in range(c0, c1))
        seqs.append((start, length, c0, c1 - c0))
    return seqs


def _seq_bank(bank: Tensor, n: int) -> Tensor:
    """Sequence n's bank as [1, H, S, D] (a shared [H, S, D] bank serves every sequence)."""
    return bank[None] if bank.dim() == 3 else bank[n:n + 1]


def _token_slice(prep: Prepared, tok: slice) -> Prepared:
    """The per-entry weights of ``prep`` for tokens ``tok`` (phase 2 does not read A, QK)."""
    return Prepared(None, None, *(None if x is None else x[:, tok] for x in prep[2:]))


def chunk_prepare_varlen_reference(write_idx, write_w, read_idx, read_w, decay, bank_rows: int,
                                   chunk_size: int, chunks: Tensor, seq_chunks: Tensor) -> Prepared:
    """:func:`chunk_prepare_reference` of a packed batch, sequence by sequence."""
    cd = compute_dtype(write_w, read_w, decay)
    _, T, H, W = write_idx.shape
    R, C, NC = read_idx.shape[-1], chunk_size, chunks.shape[0]
    dev = write_idx.device
    A = torch.zeros(1, H, NC, C, C, dtype=cd, device=dev)
    QK = torch.zeros_like(A)
    per_w = [torch.zeros(1, T, H, W, dtype=cd, device=dev) for _ in range(3)]
    gather_r = torch.zeros(1, T, H, R, dtype=cd, device=dev)
    rank = torch.zeros(1, T, H, W, dtype=torch.int32, device=dev)
    read_rank = torch.zeros(1, T, H, R, dtype=torch.int32, device=dev)
    gather_w, scatter_w, row_decay = per_w
    for t0, n_tok, c0, nc in varlen_sequences(chunks, seq_chunks):
        if n_tok == 0:
            continue
        tok = slice(t0, t0 + n_tok)
        p = chunk_prepare_reference(write_idx[:, tok], write_w[:, tok], read_idx[:, tok],
                                    read_w[:, tok], None if decay is None else decay[:, tok],
                                    bank_rows, C)
        A[:, :, c0:c0 + nc], QK[:, :, c0:c0 + nc] = p.A, p.QK
        for dst, src in zip((gather_w, gather_r, scatter_w, row_decay, rank, read_rank), p[2:]):
            dst[:, tok] = src
    return Prepared(A, QK, gather_w, gather_r, scatter_w, row_decay, rank, read_rank)


def recurrence_fwd_varlen_reference(v, beta, write_idx, read_idx, prep: Prepared, X, QX, bank,
                                    snapshot: str, chunks: Tensor, seq_chunks: Tensor):
    """:func:`recurrence_fwd_reference` of a packed batch: bank [N, H, S, D] or [H, S, D]; the
    returned bank is [N, H, S, D]; an empty sequence returns its bank unchanged."""
    seqs = varlen_sequences(chunks, seq_chunks)
    cd = compute_dtype(v, bank, prep.gather_w)
    _, T, H, D = v.shape
    E, S = write_idx.shape[-1] + read_idx.shape[-1], bank.shape[-2]
    out, res, delta = (v.new_zeros(1, T, H, D, dtype=cd) for _ in range(3))
    bank_out = bank.to(cd).expand(len(seqs), H, S, D).clone()
    snap, snap_scale = None, None
    for n, (t0, n_tok, c0, nc) in enumerate(seqs):
        tok = slice(t0, t0 + n_tok)
        sub = _token_slice(prep, tok)
        r = recurrence_fwd_reference(v[:, tok], beta[:, tok], write_idx[:, tok], read_idx[:, tok],
                                     sub, X[:, :, c0:c0 + nc], QX[:, :, c0:c0 + nc],
                                     _seq_bank(bank, n), snapshot)
        if snap is None:
            snap = r[2].new_zeros(1, T, *r[2].shape[2:])
            scaled = snapshot in ("fp8", "int4")
            snap_scale = r[3].new_ones(1, T, H, E, D // QUANT_GROUP) if scaled else r[3]
        out[:, tok], bank_out[n], snap[:, tok] = r[0], r[1][0], r[2]
        res[:, tok], delta[:, tok] = r[4], r[5]
        if snap_scale.numel():
            snap_scale[:, tok] = r[3]
    return out, bank_out, snap, snap_scale, res, delta


def recurrence_bwd_varlen_reference(v, beta, write_idx, read_idx, prep: Prepared, X, QX,
                                    bank_rows: int, snap, snap_scale, snapshot: str, res, delta,
                                    dout, dbank_out, chunks: Tensor, seq_chunks: Tensor):
    """:func:`recurrence_bwd_reference` of a packed batch (dbank [N, H, S, D])."""
    cd = compute_dtype(v, X, prep.gather_w)
    _, T, H, D = v.shape
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    dev = v.device
    dv, dX = v.new_zeros(1, T, H, D, dtype=cd), X.new_zeros(X.shape, dtype=cd)
    dbeta = v.new_zeros(1, T, H, dtype=cd)
    dgw, dsw, drd = (v.new_zeros(1, T, H, W, dtype=cd) for _ in range(3))
    dgr, dQX = v.new_zeros(1, T, H, R, dtype=cd), torch.zeros_like(dX)
    banks = seq_chunks.shape[0] - 1
    dbank = (torch.zeros(banks, H, bank_rows, D, dtype=cd, device=dev) if dbank_out is None
             else dbank_out.to(cd).clone())
    for n, (t0, n_tok, c0, nc) in enumerate(varlen_sequences(chunks, seq_chunks)):
        if n_tok == 0:      # the bank's gradient passes through
            continue
        tok, cs = slice(t0, t0 + n_tok), slice(c0, c0 + nc)
        sub = _token_slice(prep, tok)
        g = recurrence_bwd_reference(
            v[:, tok], beta[:, tok], write_idx[:, tok], read_idx[:, tok], sub, X[:, :, cs],
            QX[:, :, cs], bank_rows, snap[:, tok],
            snap_scale[:, tok] if snap_scale.numel() else snap_scale, snapshot, res[:, tok],
            delta[:, tok], None if dout is None else dout[:, tok],
            None if dbank_out is None else dbank_out[n:n + 1])
        dv[:, tok], dbeta[:, tok], dgw[:, tok], dgr[:, tok], dsw[:, tok], drd[:, tok] = g[:6]
        dX[:, :, cs], dQX[:, :, cs], dbank[n] = g[6], g[7], g[8][0]
    return dv, dbeta, dgw, dgr, dsw, drd, dX, dQX, dbank


def chunk_prepare_backward_varlen_reference(write_idx, write_w, read_idx, read_w, decay,
                                            bank_rows: int, dA, dQK, d_gather_w, d_gather_r,
                                            d_scatter_w, d_row_decay, chunks: Tensor,
                                            seq_chunks: Tensor):
    """:func:`chunk_prepare_backward_reference` of a packed batch."""
    cd = compute_dtype(write_w, read_w, decay)
    dww = write_w.new_zeros(write_w.shape, dtype=cd)
    drw = read_w.new_zeros(read_w.shape, dtype=cd)
    ddc = None if decay is None else torch.zeros_like(dww)
    for t0, n_tok, c0, nc in varlen_sequences(chunks, seq_chunks):
        if n_tok == 0:
            continue
        tok, cs = slice(t0, t0 + n_tok), slice(c0, c0 + nc)
        g = chunk_prepare_backward_reference(
            write_idx[:, tok], write_w[:, tok], read_idx[:, tok], read_w[:, tok],
            None if decay is None else decay[:, tok], bank_rows, dA[:, :, cs], dQK[:, :, cs],
            d_gather_w[:, tok], d_gather_r[:, tok], d_scatter_w[:, tok], d_row_decay[:, tok])
        dww[:, tok], drw[:, tok] = g[0], g[1]
        if ddc is not None:
            ddc[:, tok] = g[2]
    return dww, drw, ddc


def sdm_varlen_reference(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None, *,
                         cu_seqlens: Tensor, chunk_size: int = 64):
    """The oracle of a packed batch: :func:`sdm_chunked_reference` run on each sequence alone.
    Returns (out [1, T, H, D], bank [N, H, S, D]); differentiable."""
    outs, banks = [], []
    cu = cu_seqlens.tolist()
    for n in range(len(cu) - 1):
        tok = slice(cu[n], cu[n + 1])
        o, m = sdm_chunked_reference(v[:, tok], beta[:, tok], write_idx[:, tok], write_w[:, tok],
                                     read_idx[:, tok], read_w[:, tok], _seq_bank(bank, n),
                                     None if decay is None else decay[:, tok], chunk_size)
        outs.append(o)
        banks.append(m)
    return torch.cat(outs, 1), torch.cat(banks, 0)
