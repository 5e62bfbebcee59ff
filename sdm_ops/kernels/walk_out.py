"""out = inter + QX (beta res) after phase 2's walk (``recurrence_fwd``), where the walk leaves
it: the walks without a snapshot, and the capped training walk, store res = v - retrieved and
inter and form only delta, so that they fit two programs an SM; ``_out_kernel`` forms out
afterwards, one program a chunk (or chunk slot) and stream. Also the walks' helpers that find
the first token whose update or read is not finite (``sdm_ops/_finite.py``): out from there on
is NaN, found again here from the same res, beta and inter."""

from __future__ import annotations

import triton
import triton.language as tl

from .._finite import FLT_MAX as _FLT_MAX
from ._tiles import dense_chunk, token_rows

FLT_MAX = tl.constexpr(_FLT_MAX)


@triton.jit
def bad_rows(x):
    """Which rows of ``x`` [TB, BD] hold a value that is not finite."""
    return tl.max(tl.where(tl.abs(x) <= FLT_MAX, 0, 1), 1) > 0


@triton.jit
def first_of(bad, i, C: tl.constexpr):
    """The first of the tokens ``i`` that is ``bad`` (C where none is)."""
    return tl.min(tl.where(bad, i, C), 0)


@triton.jit
def _out_kernel(
    QX,
    beta,
    res,
    inter,
    out,
    chunks,
    T,
    H,
    D: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """out = inter + QX u (u = beta res) for one chunk (or chunk slot) and stream over all D
    columns, BK at a time, after the one-tile walk without a snapshot stored res and inter. The
    product in tf32x3 (three tensor-core products, about float32's accuracy: the numerical
    contract asks full float32 dots of the WY solve, not of this one): 1.9e-7 of the largest
    value from a float64 one at the reference shape against full float32's 6.1e-7, and faster
    than full float32 dots."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    h = p % H
    if VARLEN:
        tok0 = tl.load(chunks + 2 * n)
        count = tl.load(chunks + 2 * n + 1).to(tl.int32)
    else:
        tok0, count = dense_chunk(n, p, T, H, C)
    ci = tl.arange(0, C)
    tok, ok = token_rows(tok0, h, H, count, ci)
    bb = tl.load(beta + tok, mask=ok, other=0.0).to(tl.float32)
    qx = tl.load(
        QX + (p.to(tl.int64) * tl.num_programs(0) + n) * C * C + ci[:, None] * C + ci[None, :]
    )
    for k0 in range(0, D, BK):
        kc = k0 + tl.arange(0, BK)
        off = tok[:, None] * D + kc[None, :]
        u = bb[:, None] * tl.load(res + off, mask=ok[:, None], other=0.0)
        o = tl.load(inter + off, mask=ok[:, None], other=0.0)
        # As the walk: the product on the tokens before the first whose update or read is
        # not finite, out NaN from there on (found again from the same res, beta and inter).
        f_o = tl.minimum(first_of(bad_rows(u), ci, C), first_of(bad_rows(o), ci, C))
        u = tl.where(ci[:, None] < f_o, u, 0.0)
        o = tl.dot(qx, u, o, input_precision="tf32x3")
        o = tl.where(ci[:, None] < f_o, o, float("nan"))
        tl.store(out + off, o.to(out.dtype.element_ty), mask=ok[:, None])
