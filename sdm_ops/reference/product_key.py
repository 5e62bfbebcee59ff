"""Product-key top-k: the reference selection, a brute-force oracle and the backward."""

from __future__ import annotations

import math

import torch
from torch import Tensor


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


def product_key_topk_reference(
    raw: Tensor, factors: tuple[int, ...], k: int
) -> tuple[Tensor, Tensor]:
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
    lin = _best(cols[0], min(k, factors[0]))  # [n, kept], best first
    score = torch.gather(cols[0], 1, lin)
    for f in range(1, len(factors)):
        col = _best(cols[f], min(k, factors[f]))  # factor f's best columns
        fval = torch.gather(cols[f], 1, col)
        pi, pj = _candidate_pairs(lin.shape[1], col.shape[1], k, rows.device)
        cand = score[:, pi] + fval[:, pj]  # float32, in factor order
        keep = _best(cand, min(k, cand.shape[1]))
        score = torch.gather(cand, 1, keep)
        lin = torch.gather(lin[:, pi] * factors[f] + col[:, pj], 1, keep)
    lin, order = torch.sort(lin, dim=-1)
    val = torch.gather(score, 1, order).to(raw.dtype)
    kk = lin.shape[1]
    return val.reshape(*lead, kk), lin.reshape(*lead, kk)


def product_key_topk_bruteforce(
    raw: Tensor, factors: tuple[int, ...], k: int
) -> tuple[Tensor, Tensor]:
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
    score = cols[0]  # [n, prefix slots]
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


def product_key_topk_backward_reference(
    lin: Tensor, grad_val: Tensor, factors: tuple[int, ...]
) -> Tensor:
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
