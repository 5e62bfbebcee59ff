"""Exact product-key top-k: forward selection and sparse backward.

Math. A row of ``raw`` holds F (1..4) factor blocks side by side, block f of ``factors[f]``
columns at column offset ``off_f = sum(factors[:f])``. Slot ``(c_0, .., c_{F-1})`` scores the
float32 sum ``((x_0[c_0] + x_1[c_1]) + ..) + x_{F-1}[c_{F-1}]`` (bfloat16 input is widened to
float32 first) and has the row-major index ``lin = (..(c_0 * factors[1] + c_1)..) *
factors[F-1] + c_{F-1}``. The forward returns the kk = min(k, prod(factors)) best slots under
the tie rule below, ``lin`` strictly ascending and ``val`` the score rounded to the input
dtype. The backward adds each slot's value gradient to the one column of each factor it sums.

Tie rule (the one of ``sdm_ops.product_key`` and ``reference.product_key_topk_reference``).
Scores compare as numbers with NaN counted as -inf and -0 equal to +0. Factor f ranks its
columns by value, larger first, equal values to the smaller column. The prefix of factors
0..f ranks its tuples by score, larger first, then by the rank of the prefix 0..f-1, then by
the rank of factor f's column.

Algorithm (forward), per row, all in registers:

1. Each factor's columns become packed int64 keys ``key32(x) << 32 | (4095 - c) << 2 | flags``
   where ``key32`` is an order-preserving signed int32 of the float (NaN -> key of -inf,
   -0 -> +0) and ``flags`` remember NaN and -0 so the exact value decodes back (bfloat16 rows:
   int32 keys ``key32(x) >> 16 << 16 | (4095 - c) << 2 | flags``, a widened bfloat16's
   ``key32`` being fixed by its high half). Keys are unique, so the top list of them
   (``_top``: ``tl.topk``, or for short lists rounds of a row maximum) is exactly the
   factor's best m_f = min(k, factors[f]) columns, in rank order. Factors wider than a chunk
   (CF columns, at most _FWD_CHUNK) are taken chunk by chunk, the running best list merged
   with each chunk's (``_merge``).
2. Stage f = 1..F-1 combines the previous list (n ranks, in order) with factor f's list
   (m ranks): candidate (i, j) scores ``prev[i] + x_f[j]`` (float32, in this order). Only
   pairs with ``(i + 1) * (j + 1) <= kk_f``, kk_f = min(k, n * m), can be among the best
   kk_f: every pair (i', j') <= (i, j) scores at least as much (float addition is monotone
   and NaN -> -inf keeps it so) and wins ties by rank. The candidates are enumerated as
   log2(B) + 1 regions of B = next_pow2(kk_f) pairs: j = 0 with i < B, and for w = 1, 2,
   4, .. < B, j in [w, 2w) with i < B / w (``_pair_keys``), in chunks of CS candidates. Their
   keys ``key32(score) << 32 | (65535 - (256 i + j)) << 2 | flags`` are unique and order
   exactly as the tie rule, so ``tl.topk`` (and ``_merge`` across chunks) yields the
   stage's list in rank order; ``lin = prev_lin[i] * factors[f] + column_f[j]`` follows from
   (i, j) by ``tl.gather``.
3. The final list is sorted by ``lin << 8 | position`` ascending and ``val`` gathered by
   position. ``val`` is rounded to bfloat16 on the bits (round to nearest even), the same
   on the GPU and under the interpreter.

Backward: the gradient of factor f's column c is the float32 sum, in slot order (j = 0, 1,
..) from +0, of ``grad_val[j]`` over the row's kk slots whose column ``(lin //
prod(factors[f+1:])) % factors[f]`` is c, rounded once to the gradient dtype at the store.
A factor no wider than KP = next_pow2(kk) is done dense: a [ROWS, columns] register
accumulator walks the slots, and every column is stored. A wider one is scattered: the
accumulator is [ROWS, KP], entry i summing the slots that share slot i's column, and it is
stored at those columns (slots sharing a column store the same value), kk x KP compares a
row instead of kk x factors[f] (at (256, 256) and kk = 8, a 32nd); from KP = 16 on, the
program loads its slots and value gradients once, as [ROWS, KP] tiles, and takes slot j's
column and gradient from them. Where any factor is scattered the program first zeroes its
rows of grad and passes a barrier, so that the columns no slot selects are zero and the sums
land after the zeros.

Layouts (all contiguous, row-major): ``rows`` [n, W] with W = sum(factors), float32 or
bfloat16; ``val`` [n, kk] in the row dtype; ``lin`` [n, kk] int64; ``grad_val`` [n, kk] float32
or bfloat16; ``grad`` [n, W] float32 or bfloat16.

Grid: one axis, ``cdiv(n, ROWS)`` programs; program p owns rows ``p * ROWS .. p * ROWS + ROWS
- 1`` (64-bit row offsets), all of its tensors being [ROWS, *] blocks. Launch configurations
(ROWS, chunk widths, warps) are pinned by the factors and k alone (no autotuning), so a
launch never syncs with the host and is CUDA-graph capturable. The warp count keeps each
gather source's rows whole within a warp, which Triton's gather lowering requires; lists of at
most 4 entries are read by selects instead, so they do not bound it.

Determinism: the forward is a pure function of the row (integer keys with no two equal, so no
ordering choice is left to the sort). The backward adds in a fixed order, with no atomics;
every writer of a gradient element after the zeros stores the same value, and its float32
sums are those of the reference (sequential in slot order, from +0).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._keys import (
    SELECT_WIDTH,
    key_tie,
    key_value,
    pack_key,
    pack_key16,
    take,
    to_dtype,
)

# Pinned launch geometry. Forward: factor columns and stage candidates go in chunks of at
# most _FWD_CHUNK; rows per program such that the widest chunk times ROWS is about
# _FWD_BLOCK; at most _FWD_WARPS warps. Backward: dense accumulator blocks of at most
# _BWD_COLS columns, rows per program (at most _BWD_MAX_ROWS) such that the widest accumulator
# holds about _BWD_BLOCK elements; the zeroing stores _BWD_BLOCK elements at a time, and a
# program that zeroes its rows has at most _BWD_ZERO_ROW_ELEMENTS elements of them (small
# programs' zeros and sums meet in L2). Where the slots' power of two KP is at least
# _BWD_TILE_SLOTS, a program loads its slots and value gradients once, as tiles, for the
# scatter factors (faster from KP = 16 on, slower for float32 at KP = 8).
_FWD_BLOCK = 2048
_FWD_CHUNK = 512
_FWD_MAX_ROWS = 16
_FWD_WARPS = 4
# Bytes of a row one warp loads (32 threads of 16 bytes); a program of one warp over rows wider
# than that holds at most _WARP_ROW_BYTES of them (64 bytes a thread).
_WARP_LOAD_BYTES = 512
_WARP_ROW_BYTES = 2048
# Elements of the widest merge stage (CS) a thread holds at most: a wide stage (k = 32 and more
# at two factors) is sorted, and its rows are best one or two to a warp.
_STAGE_PER_THREAD = 8
_BWD_COLS = 256
_BWD_BLOCK = 2048
_BWD_MAX_ROWS = 128
_BWD_ZERO_ROW_ELEMENTS = 4096
_BWD_TILE_SLOTS = 16
_BWD_WARPS = 4
# Below every key ``pack_key`` makes (their int32 part is at least that of -inf), and above every
# lin-ordered key of the final sort.
_MIN_KEY = tl.constexpr(-(2**63))
_MAX_KEY = tl.constexpr(2**63 - 1)
# Below every int32 factor key of a bfloat16 row (their high half is at least that of -inf).
_MIN_KEY32 = tl.constexpr(-(2**31))
# Top lists of at most this many int32 / int64 keys are taken by rounds of a maximum (``_top``),
# longer ones by ``tl.topk``'s sorting network (int64: the cut-off where the rounds compile to
# fewer instructions at factors (256, 256); int32: where they also take fewer shuffles, which
# cost the GPU more than other instructions).
_ITER32 = tl.constexpr(32)
_ITER64 = tl.constexpr(8)


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _log2(x: int) -> int:
    return x.bit_length() - 1


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


@triton.jit
def _top(keys, L: tl.constexpr):
    """The L largest of each row's keys ([ROWS, N], unique but for repeats of the smallest
    key), largest first: ``tl.topk`` for long lists; up to _ITER32 (int32 keys) or _ITER64
    (int64) by L rounds of a row maximum, each taking its key out, which costs L passes over
    the keys rather than a sorting network's log-squared and gives the same list."""
    if (L > _ITER32) or (keys.dtype == tl.int64 and L > _ITER64):
        return tl.topk(keys, L, dim=1)
    else:
        pos = tl.arange(0, L)[None, :]
        floor = tl.min(keys, axis=1)[:, None]
        out = tl.broadcast_to(floor, (keys.shape[0], L))
        for i in tl.static_range(L):
            best = tl.max(keys, axis=1)[:, None]
            out = tl.where(pos == i, best, out)
            keys = tl.where(keys == best, floor, keys)
        return out


@triton.jit
def _merge(best, new, L: tl.constexpr, ROWS: tl.constexpr):
    """The best L keys of two [ROWS, L] key sets, best first. Lists that ``_top`` takes by
    rounds of a maximum are merged the same way, each round over both sets, without joining
    them (on a chunked factor, Triton 3.6 and 3.7 fail to lay out the joined set's rounds
    for sm_90)."""
    if (L > _ITER32) or (best.dtype == tl.int64 and L > _ITER64):
        return tl.topk(tl.reshape(tl.join(best, new), (ROWS, 2 * L)), L, dim=1)
    else:
        pos = tl.arange(0, L)[None, :]
        floor = tl.minimum(tl.min(best, axis=1), tl.min(new, axis=1))[:, None]
        out = tl.broadcast_to(floor, (ROWS, L))
        for i in tl.static_range(L):
            top = tl.maximum(tl.max(best, axis=1), tl.max(new, axis=1))[:, None]
            out = tl.where(pos == i, top, out)
            best = tl.where(best == top, floor, best)
            new = tl.where(new == top, floor, new)
        return out


@triton.jit
def _factor_keys(base, rmask, c0, OFF: tl.constexpr, F: tl.constexpr, CH: tl.constexpr):
    """Keys of columns c0 .. c0 + CH - 1 of the factor at column OFF (F wide): [ROWS, CH],
    tie field 4095 - column; columns past F get the smallest key. int32 keys (``pack_key16``)
    for bfloat16 rows, whose values need 16 bits, so that the factor's sorts move half the
    bits; int64 (``pack_key``) for float32 rows."""
    col = c0 + tl.arange(0, CH)
    ok = col < F
    x = tl.load(
        base[:, None] + OFF + col[None, :], mask=rmask[:, None] & ok[None, :], other=0.0
    ).to(tl.float32)
    if base.dtype.element_ty == tl.bfloat16:
        key = pack_key16(x, (4095 - col)[None, :])
        return tl.where(ok[None, :], key, _MIN_KEY32)
    else:
        key = pack_key(x, (4095 - col)[None, :])
        return tl.where(ok[None, :], key, _MIN_KEY)


@triton.jit
def _factor_top(
    base,
    rmask,
    OFF: tl.constexpr,
    F: tl.constexpr,
    CH: tl.constexpr,
    LM: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Keys of the best LM columns of the factor, best first ([ROWS, LM]), from chunks of CH
    columns."""
    best = _top(_factor_keys(base, rmask, 0, OFF, F, CH), LM)
    for c0 in range(CH, F, CH):
        best = _merge(best, _top(_factor_keys(base, rmask, c0, OFF, F, CH), LM), LM, ROWS)
    return best


@triton.jit
def _factor_col(key):
    return 4095 - key_tie(key)


@triton.jit
def _pair_keys(
    ps,
    fkey,
    c0,
    NP: tl.constexpr,
    LP: tl.constexpr,
    M: tl.constexpr,
    LM: tl.constexpr,
    KK: tl.constexpr,
    B: tl.constexpr,
    LOG: tl.constexpr,
    CH: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Keys of candidates c0 .. c0 + CH - 1 of a stage: [ROWS, CH] int64, tie field
    65535 - (256 i + j); candidates that cannot be among the best KK get _MIN_KEY.
    Candidate c lies in region r = c // B at offset o = c % B: region 0 is (i, j) = (o, 0),
    region r > 0 holds j in [w, 2w), w = 2**(r - 1), as (i, j) = (o // w, w + o % w)."""
    c = c0 + tl.arange(0, CH)
    r = c // B
    o = c % B
    sh = tl.maximum(r - 1, 0)
    w = tl.full((CH,), 1, tl.int32) << sh
    i = tl.where(r == 0, o, o >> sh)
    j = tl.where(r == 0, 0, w + (o & (w - 1)))
    ok = (r <= LOG) & (i < NP) & (j < M) & ((i + 1) * (j + 1) <= KK)
    i = tl.where(ok, i, 0)
    j = tl.where(ok, j, 0)
    ii = tl.broadcast_to(i[None, :], (ROWS, CH))
    jj = tl.broadcast_to(j[None, :], (ROWS, CH))
    s = take(ps, ii, LP) + key_value(take(fkey, jj, LM))
    key = pack_key(s, (65535 - (i * 256 + j))[None, :])
    return tl.where(ok[None, :], key, _MIN_KEY)


@triton.jit
def _stage(
    ps,
    plin,
    fkey,
    F: tl.constexpr,
    NP: tl.constexpr,
    LP: tl.constexpr,
    M: tl.constexpr,
    LM: tl.constexpr,
    KK: tl.constexpr,
    B: tl.constexpr,
    LOG: tl.constexpr,
    CH: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Best KK pairs of the previous list (scores ``ps``, slots ``plin``, [ROWS, LP], NP valid
    ranks) and factor keys ``fkey`` ([ROWS, LM], M valid ranks): [ROWS, B] scores and slots
    in rank order, the first KK valid. The (LOG + 1) * B candidates go in chunks of CH."""
    best = _top(_pair_keys(ps, fkey, 0, NP, LP, M, LM, KK, B, LOG, CH, ROWS), B)
    for c0 in range(CH, (LOG + 1) * B, CH):
        keys = _pair_keys(ps, fkey, c0, NP, LP, M, LM, KK, B, LOG, CH, ROWS)
        best = _merge(best, _top(keys, B), B, ROWS)
    tie = 65535 - key_tie(best)
    ti = tl.minimum(tie >> 8, LP - 1)
    tj = tl.minimum(tie & 255, LM - 1)
    lin = take(plin, ti, LP) * F + _factor_col(take(fkey, tj, LM)).to(tl.int64)
    return key_value(best), lin


@triton.jit
def _product_key_topk_fwd(
    rows_ptr,  # [n, W] float32 / bfloat16
    val_ptr,  # [n, KK] rows dtype
    lin_ptr,  # [n, KK] int64
    n_rows,
    W: tl.constexpr,
    NF: tl.constexpr,
    KK: tl.constexpr,
    LF: tl.constexpr,
    ROWS: tl.constexpr,
    F0: tl.constexpr,
    M0: tl.constexpr,
    LM0: tl.constexpr,
    CF0: tl.constexpr,
    F1: tl.constexpr,
    M1: tl.constexpr,
    LM1: tl.constexpr,
    CF1: tl.constexpr,
    F2: tl.constexpr,
    M2: tl.constexpr,
    LM2: tl.constexpr,
    CF2: tl.constexpr,
    F3: tl.constexpr,
    M3: tl.constexpr,
    LM3: tl.constexpr,
    CF3: tl.constexpr,
    KK1: tl.constexpr,
    B1: tl.constexpr,
    LOG1: tl.constexpr,
    CS1: tl.constexpr,
    KK2: tl.constexpr,
    B2: tl.constexpr,
    LOG2: tl.constexpr,
    CS2: tl.constexpr,
    KK3: tl.constexpr,
    B3: tl.constexpr,
    LOG3: tl.constexpr,
    CS3: tl.constexpr,
):
    """Factor f: F{f} columns, M{f} = min(k, F{f}) ranked, lists of LM{f} = pow2(M{f}) from
    chunks of CF{f} columns. Stage f keeps KK{f} of B{f} = pow2(KK{f}) = 2**LOG{f} ranks from
    (LOG{f} + 1) * B{f} candidates in chunks of CS{f}. The final list has LF entries, KK
    valid."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = row < n_rows
    base = rows_ptr + row * W
    key = _factor_top(base, rmask, 0, F0, CF0, LM0, ROWS)
    score = key_value(key)
    lin = _factor_col(key).to(tl.int64)
    if NF > 1:
        key = _factor_top(base, rmask, F0, F1, CF1, LM1, ROWS)
        score, lin = _stage(score, lin, key, F1, M0, LM0, M1, LM1, KK1, B1, LOG1, CS1, ROWS)
    if NF > 2:
        key = _factor_top(base, rmask, F0 + F1, F2, CF2, LM2, ROWS)
        score, lin = _stage(score, lin, key, F2, KK1, B1, M2, LM2, KK2, B2, LOG2, CS2, ROWS)
    if NF > 3:
        key = _factor_top(base, rmask, F0 + F1 + F2, F3, CF3, LM3, ROWS)
        score, lin = _stage(score, lin, key, F3, KK2, B2, M3, LM3, KK3, B3, LOG3, CS3, ROWS)
    # Sort the KK kept slots by lin (< 2**48), carrying their rank position in the low byte.
    pos = tl.arange(0, LF)
    keep = pos < KK
    skey = tl.where(keep[None, :], (lin << 8) | pos[None, :].to(tl.int64), _MAX_KEY)
    skey = tl.sort(skey, dim=1)
    p = tl.minimum((skey & 255).to(tl.int32), LF - 1)
    val = take(score, p, LF)
    out = row[:, None] * KK + pos[None, :]
    smask = rmask[:, None] & keep[None, :]
    tl.store(lin_ptr + out, skey >> 8, mask=smask)
    tl.store(val_ptr + out, to_dtype(val, val_ptr.dtype.element_ty), mask=smask)


def _fwd_config(factors: list[int], k: int, itemsize: int) -> dict:
    """Constexprs and launch options of ``_product_key_topk_fwd``, a function of factors, k
    and the rows' element size alone. ROWS fills a block of about _FWD_BLOCK elements of the
    widest per-row tensor; the warp count is capped so that every ``tl.gather`` source has
    whole rows per warp (Triton lowers a gather warp-locally and asserts it can); lists of at
    most SELECT_WIDTH entries are read by selects (``take``) and do not count, so that a
    narrow factor (1 to 4 columns) or a small k does not leave a program of wide chunks with
    one warp. A factor chunk wider than one warp's loads (_WARP_LOAD_BYTES: Triton gives a
    thread 16 contiguous bytes, then spreads the rest of the row over the warps) would split
    each row's rounds and sorts across warps, through shared memory and barriers, so such a
    program gets one warp and at most _WARP_ROW_BYTES of rows (ptxas: float32 (256, 256) at
    k = 8, 254 registers with 8 rows on 2 warps, 137 with 4 on one). Then rows are halved
    until a thread holds at most _STAGE_PER_THREAD elements of the widest merge stage. The
    last two rules come from a sweep of launch configurations on an H200."""
    meta = {}
    narrowest, widest_factor, widest_stage = 32, 1, 1
    for f in range(4):
        width = factors[f] if f < len(factors) else 1
        m = min(k, width)
        chunk = min(_pow2(width), _FWD_CHUNK)
        meta.update({f"F{f}": width, f"M{f}": m, f"LM{f}": _pow2(m), f"CF{f}": chunk})
        if f < len(factors):
            widest_factor = max(widest_factor, chunk)
            if len(factors) > 1 and _pow2(m) > SELECT_WIDTH:
                narrowest = min(narrowest, _pow2(m))
    kept = meta["M0"]
    for f in range(1, 4):
        if f < len(factors):
            kept = min(k, kept * meta[f"M{f}"])
        b = _pow2(kept) if f < len(factors) else 1
        chunk = min(_pow2((_log2(b) + 1) * b), max(b, _FWD_CHUNK))
        meta.update({f"KK{f}": kept, f"B{f}": b, f"LOG{f}": _log2(b), f"CS{f}": chunk})
        if f < len(factors):
            widest_stage = max(widest_stage, chunk)
            if b > SELECT_WIDTH:
                narrowest = min(narrowest, b)
    kk = min(k, math.prod(factors))
    if _pow2(kk) > SELECT_WIDTH:
        narrowest = min(narrowest, _pow2(kk))
    one_warp = widest_factor * itemsize > _WARP_LOAD_BYTES
    rows = max(1, min(_FWD_MAX_ROWS, _FWD_BLOCK // max(widest_factor, widest_stage)))
    if one_warp:
        rows = max(1, min(rows, _WARP_ROW_BYTES // (widest_factor * itemsize)))

    def warps_for(rows: int) -> int:
        return 1 if one_warp else max(1, min(_FWD_WARPS, rows * narrowest // 32))

    warps = warps_for(rows)
    while rows > 1 and rows * widest_stage > _STAGE_PER_THREAD * 32 * warps:
        rows //= 2
        warps = warps_for(rows)
    meta.update(NF=len(factors), KK=kk, LF=_pow2(kk), W=sum(factors), ROWS=rows, num_warps=warps)
    return meta


@functools.lru_cache(maxsize=None)
def _launch_config(factors: tuple[int, ...], k: int, itemsize: int) -> dict:
    """``_fwd_config`` computed once per (factors, k, itemsize) for the launcher (about 10 us of
    Python a call otherwise); the dict is shared, so callers only read it."""
    return _fwd_config(list(factors), k, itemsize)


def product_key_topk_fwd(
    rows: torch.Tensor, factors: list[int], k: int, val: torch.Tensor, lin: torch.Tensor
) -> None:
    """val, lin [n, kk] <- the exact top-kk slots of each row of ``rows`` [n, sum(factors)]
    (float32 or bfloat16, contiguous), lin ascending; kk = min(k, prod(factors))."""
    n = rows.shape[0]
    if n == 0:
        return
    meta = _launch_config(tuple(factors), k, rows.element_size())
    grid = (triton.cdiv(n, meta["ROWS"]),)
    wrap_triton(_product_key_topk_fwd)[grid](rows, val, lin, n, **meta)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


@triton.jit
def _factor_grad(
    lin_row,
    g_row,
    out_row,
    rmask,
    KK: tl.constexpr,
    F: tl.constexpr,
    STRIDE: tl.constexpr,
    BC: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Dense form: out_row[:, c] = sum over slots j (in order) with column c of this factor of
    g[:, j], for every column c, in blocks of BC columns."""
    for c0 in range(0, F, BC):
        col = c0 + tl.arange(0, BC)
        acc = tl.zeros((ROWS, BC), tl.float32)
        for j in range(KK):
            slot = tl.load(lin_row + j, mask=rmask, other=0)
            g = tl.load(g_row + j, mask=rmask, other=0.0).to(tl.float32)
            c = ((slot // STRIDE) % F).to(tl.int32)
            acc += tl.where(c[:, None] == col[None, :], g[:, None], 0.0)
        tl.store(
            out_row[:, None] + col[None, :],
            to_dtype(acc, out_row.dtype.element_ty),
            mask=rmask[:, None] & (col < F)[None, :],
        )


@triton.jit
def _factor_grad_scatter(
    lin_row,
    g_row,
    lin_t,
    g_t,
    out_row,
    rmask,
    KK: tl.constexpr,
    KP: tl.constexpr,
    F: tl.constexpr,
    STRIDE: tl.constexpr,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
):
    """Scatter form: for each slot i, the same sum for its column c_i (the slots j, in order,
    whose column is c_i) is formed in a [ROWS, KP] accumulator and stored at out_row[:, c_i]
    (slots sharing a column store the same value). Columns no slot selects are left as they
    are (the caller zeroed them). With TILES, slot j's column and gradient come from the
    program's [ROWS, KP] tiles of slots and value gradients ``lin_t``, ``g_t`` (their column
    j, a sum of one element and zeros: the same bits), else from two loads a slot."""
    jj = tl.arange(0, KP)
    m2 = rmask[:, None] & (jj < KK)[None, :]
    acc = tl.zeros((ROWS, KP), tl.float32)
    if TILES:
        c = ((lin_t // STRIDE) % F).to(tl.int32)
        for j in tl.static_range(KK):
            cj = tl.sum(tl.where(jj[None, :] == j, c, 0), axis=1)
            gj = tl.sum(tl.where(jj[None, :] == j, g_t, 0.0), axis=1)
            acc += tl.where(c == cj[:, None], gj[:, None], 0.0)
    else:
        c = ((tl.load(lin_row[:, None] + jj[None, :], mask=m2, other=0) // STRIDE) % F).to(tl.int32)
        for j in range(KK):
            slot = tl.load(lin_row + j, mask=rmask, other=0)
            gj = tl.load(g_row + j, mask=rmask, other=0.0).to(tl.float32)
            cj = ((slot // STRIDE) % F).to(tl.int32)
            acc += tl.where(c == cj[:, None], gj[:, None], 0.0)
    # A negative slot's remainder is negative: that slot selects no column, as in the dense form.
    tl.store(out_row[:, None] + c, to_dtype(acc, out_row.dtype.element_ty), mask=m2 & (c >= 0))


@triton.jit
def _factor_grad_any(
    lin_row,
    g_row,
    lin_t,
    g_t,
    out_row,
    rmask,
    KK: tl.constexpr,
    KP: tl.constexpr,
    F: tl.constexpr,
    STRIDE: tl.constexpr,
    BC: tl.constexpr,
    SCATTER: tl.constexpr,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
):
    if SCATTER:
        _factor_grad_scatter(
            lin_row, g_row, lin_t, g_t, out_row, rmask, KK, KP, F, STRIDE, ROWS, TILES
        )
    else:
        _factor_grad(lin_row, g_row, out_row, rmask, KK, F, STRIDE, BC, ROWS)


@triton.jit
def _product_key_topk_bwd(
    lin_ptr,  # [n, KK] int64
    g_ptr,  # [n, KK] float32 / bfloat16
    grad_ptr,  # [n, W] float32 / bfloat16
    n_rows,
    KK: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    NF: tl.constexpr,
    ROWS: tl.constexpr,
    ZB: tl.constexpr,
    ANY_SCATTER: tl.constexpr,
    TILES: tl.constexpr,
    F0: tl.constexpr,
    S0: tl.constexpr,
    BC0: tl.constexpr,
    SC0: tl.constexpr,
    F1: tl.constexpr,
    S1: tl.constexpr,
    BC1: tl.constexpr,
    SC1: tl.constexpr,
    F2: tl.constexpr,
    S2: tl.constexpr,
    BC2: tl.constexpr,
    SC2: tl.constexpr,
    F3: tl.constexpr,
    S3: tl.constexpr,
    BC3: tl.constexpr,
    SC3: tl.constexpr,
):
    """Factor f: F{f} columns, column of slot lin = (lin // S{f}) % F{f}, S{f} =
    prod(factors[f+1:]); the scatter form where SC{f}, else the dense one in accumulator
    blocks of BC{f} columns. With any scatter factor the program first zeroes its rows (one
    contiguous range of grad, ZB elements a store), then waits for every thread's zeros
    before the factors store. With TILES the program loads its slots and value gradients
    once, as [ROWS, KP] tiles, for the scatter factors."""
    first = tl.program_id(0).to(tl.int64) * ROWS
    row = first + tl.arange(0, ROWS)
    rmask = row < n_rows
    lin_row = lin_ptr + row * KK
    g_row = g_ptr + row * KK
    out_row = grad_ptr + row * W
    if ANY_SCATTER:
        zeros = to_dtype(tl.zeros((ZB,), tl.float32), grad_ptr.dtype.element_ty)
        end = tl.minimum(first + ROWS, n_rows) * W
        for z0 in range(0, ROWS * W, ZB):
            at = first * W + z0 + tl.arange(0, ZB)
            tl.store(grad_ptr + at, zeros, mask=at < end)
        # Orders the zeros before the sums some other thread of the program stores there.
        tl.debug_barrier()
    lin_t = tl.zeros((ROWS, KP), tl.int64)
    g_t = tl.zeros((ROWS, KP), tl.float32)
    if TILES:
        jj = tl.arange(0, KP)
        m2 = rmask[:, None] & (jj < KK)[None, :]
        lin_t = tl.load(lin_row[:, None] + jj[None, :], mask=m2, other=0)
        g_t = tl.load(g_row[:, None] + jj[None, :], mask=m2, other=0.0).to(tl.float32)
    _factor_grad_any(
        lin_row, g_row, lin_t, g_t, out_row, rmask, KK, KP, F0, S0, BC0, SC0, ROWS, TILES
    )
    if NF > 1:
        _factor_grad_any(
            lin_row, g_row, lin_t, g_t, out_row + F0, rmask, KK, KP, F1, S1, BC1, SC1, ROWS, TILES
        )
    if NF > 2:
        _factor_grad_any(
            lin_row,
            g_row,
            lin_t,
            g_t,
            out_row + (F0 + F1),
            rmask,
            KK,
            KP,
            F2,
            S2,
            BC2,
            SC2,
            ROWS,
            TILES,
        )
    if NF > 3:
        _factor_grad_any(
            lin_row,
            g_row,
            lin_t,
            g_t,
            out_row + (F0 + F1 + F2),
            rmask,
            KK,
            KP,
            F3,
            S3,
            BC3,
            SC3,
            ROWS,
            TILES,
        )


def _bwd_config(factors: list[int], kk: int) -> dict:
    """Constexprs and launch options of ``_product_key_topk_bwd``, a function of the factors
    and kk alone. A factor wider than the slots' power of two KP takes the scatter form (kk x
    KP compares a row instead of kk x factor), a narrower one the dense form; ROWS fills a
    block of about _BWD_BLOCK elements of the widest accumulator, and with a scatter factor
    (whose program zeroes its rows first) at most _BWD_ZERO_ROW_ELEMENTS of the gradient;
    TILES (slots and value gradients loaded once, as tiles) with a scatter factor where KP is
    at least _BWD_TILE_SLOTS."""
    kp = _pow2(kk)
    meta = {"KK": kk, "KP": kp, "W": sum(factors), "NF": len(factors)}
    widest = 1
    any_scatter = False
    for f in range(4):  # absent factors: 1 column, dense, never the widest
        width = factors[f] if f < len(factors) else 1
        scatter = width > kp
        bc = min(_pow2(width), _BWD_COLS)
        meta.update(
            {f"F{f}": width, f"S{f}": math.prod(factors[f + 1 :]), f"BC{f}": bc, f"SC{f}": scatter}
        )
        widest = max(widest, kp if scatter else bc)
        any_scatter |= scatter
    rows = max(1, min(_BWD_MAX_ROWS, _BWD_BLOCK // widest))
    if any_scatter:
        rows = min(rows, 1 << _log2(max(1, _BWD_ZERO_ROW_ELEMENTS // meta["W"])))
    meta.update(
        ROWS=rows,
        ZB=_BWD_BLOCK,
        ANY_SCATTER=any_scatter,
        TILES=any_scatter and kp >= _BWD_TILE_SLOTS,
        num_warps=_BWD_WARPS,
    )
    return meta


@functools.lru_cache(maxsize=None)
def _bwd_launch_config(factors: tuple[int, ...], kk: int) -> dict:
    """``_bwd_config`` computed once per (factors, kk) for the launcher; callers only read it."""
    return _bwd_config(list(factors), kk)


def product_key_topk_bwd(
    lin: torch.Tensor, grad_val: torch.Tensor, factors: list[int], grad: torch.Tensor
) -> None:
    """grad [n, sum(factors)] <- the gradient of the rows from ``grad_val`` [n, kk] at the
    slots ``lin`` [n, kk] (all contiguous); every element is written."""
    n, kk = lin.shape
    if n == 0:
        return
    # kk is a SymInt when traced with dynamic shapes: the kernel specializes on it (KK is a
    # constexpr), so the launcher does too.
    meta = _bwd_launch_config(tuple(factors), int(kk))
    grid = (triton.cdiv(n, meta["ROWS"]),)
    wrap_triton(_product_key_topk_bwd)[grid](lin, grad_val, grad, n, **meta)
