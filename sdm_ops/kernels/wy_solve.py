"""Per-chunk WY solve and its backward.

Math. For each chunk n of C tokens (1 <= C <= 128), with L = tril(beta[:, None] * A, -1):

  forward   X  = (I + L)^-1                      (unit lower triangular)
            QX = tril(QK) @ X
  backward  G  = strict_lower(dX + tril(QK)^T @ dQX)
            W  = X^T @ G
            dL = strict_lower(-W @ X^T)          (= strict_lower(-X^T (dX + tril(QK)^T dQX) X^T))
            dA = dL * beta[:, None],  dbeta[i] = sum_{j<i} dL[i, j] * A[i, j]
            dQK = tril(dQX @ X^T)

Only the strict lower triangle of A, the lower triangles of QK, X and dQX and the strict lower
triangle of dX are read: the rest may hold anything (NaN included) and never reaches an output,
since it is masked out at the load (``tl.where`` semantics, not multiplication by zero). Dropping
the upper parts of X, dX and dQX is exact for the math above: X is zero there, and those parts
only reach entries of dL and dQK that are discarded.

Layout. A, QK, X, QX, dX, dQX, dA, dQK: contiguous row-major [N, C, C] float32, chunk n at
element offset n * C * C (64-bit); beta, dbeta: contiguous [N, C]. Every output element is
written, +0.0 above the diagonal (and on it for dA).

Tiling. A chunk is cut into NT = cdiv(C, 16) row and column blocks of 16; rows and columns >= C
load as zero (identity rows of I + L), and the leading block of a triangular inverse is the
inverse of the leading block, so any C is exact. Every product is a 16 x 16 x 16 ``tl.dot`` in
full float32 (input_precision="ieee": the inverse amplifies rounding).

Kernels, each launched on the grid (N, NT): program (n, b) handles block b of chunk n.

  _fwd_diag_kernel     X[b, b] = (I + L[b, b])^-1 by forward substitution, row by row.
                       With SOLVED, chunks the pairs solve took are skipped (as by the panel).
  _fwd_panel_kernel    column panel b of X and QX: zeros above block b, QX[b, b], then down the
                       blocks i > b, X[i, b] = -X[i, i] @ sum_{k=b}^{i-1} L[i, k] X[k, b] and
                       QX[i, b] = sum_{k=b}^{i} tril(QK)[i, k] X[k, b].
  _bwd_panel_kernel    column panel b of G and W, bottom block first: G[i, b] is staged in dA
                       (which the next kernel overwrites entirely) and W[i, b] goes to a scratch
                       [N, C, C] buffer allocated by the launcher.
  _bwd_row_kernel      row panel b of dA, dQK and dbeta: for each block j <= b, the dots
                       W[b, k] X[j, k]^T and dQX[b, k] X[j, k]^T over k <= j; zeros right of
                       block b; dbeta sums the row panel's dL * A locally.

The pairs solve. Phase 1's sparse path lists each chunk's entries that share a slot with
another (``layout.PairLists``); A and QK are zero outside those entries' tokens. Where a chunk's
list is one window of at most MC entries (most chunks in a large bank), ``_pairs_solve_kernel``
(grid (N,), launched by ``wy_solve_fwd`` given the lists) solves the chunk on the list alone.
With the "heads" the first entry of each (token, side) of the list, it gathers L = beta A
between the write heads' tokens and QK from the read heads' tokens to the write heads', and
with Y = X - I there (X = I elsewhere: L has no terms outside those tokens)

    Y[a] = -(L[a] + L[a] Y)        over the write heads in token order (forward substitution)
    QX   = tril(QK) + sum_k tril(QK)[:, k] Y[k]   over the write heads k in token order

on [MC, MC] registers, each sum a fixed reduction, as many steps as the chunk has write heads
(a few at the reference workload). It stores X (the identity, then Y's elements) and QX
(zeros, then its elements), one writer an element, after a barrier that orders the tile's own
stores before them. The diag and panel kernels, given the pair counts, skip those chunks and
take the rest (a list of several windows, or a chunk phase 1's dense kernels took). The two
paths round differently from each other, each deterministically; a chunk's path depends only
on its own addressing.

Zero tiles. In a large bank few entries of a chunk share a slot, so most 16 x 16 tiles of A and
QK are zero, and X is the identity plus a few tiles. The kernels skip every product whose tile
of A, QK or X holds only zeros (its other operand is then not loaded), add instead of
multiplying where a diagonal block of X is the identity, and take a diagonal block whose beta A
is zero as the identity without the substitution. A tile holding a NaN is neither zero nor the
identity. For finite operands a skipped product would add only zeros and a product with the
identity rounds as the sum does, so the results are the dense kernels' up to rounding: the
interpreter gives the same bits (a zero's sign aside), while compiled, the kernels with and
without the skips may lay out a reduction differently (the diagonal substitution's sum over 16
rows is one) and so round it in another order. On an H100 under 0.1% of the entries of X, QX
and the gradients differ, each by less than 2^-20 of the output's largest entry.
The zeros of a zero tile or of an identity block are structural: an infinite or NaN value in
the other operand does not reach through them, as in a sparse matrix product. At the reference
workload (C = 64, W = R = 8, S = 65536) this leaves about 1.5 of a chunk's 36 tile
products forward and 14 of 80 backward, and 11% of the diagonal blocks' substitutions.

The forward panel kernel loads every tile its block rows read before its products (the whole
panel at once for C <= 64) and keeps the X[k, b] it computes in registers; the backward panel
kernel reads back the G[k, b] it stored after a ``tl.debug_barrier`` (a CTA barrier, which
orders a block's global stores before its later loads). Tiles of another program are only read
in a later launch.

Determinism: no atomics; every output element (and every staged or scratch element) is written
by exactly one program of a launch, and every sum is accumulated in a fixed order by a fixed
launch configuration. Launch configurations are pinned below, not autotuned: the warp count
can change the rounding of reductions and dots, so they are part of the numerical contract,
and a fixed launch is CUDA-graph-capture-safe and gives the same bits for a chunk at any N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import chunk_prepare_sparse

TILE = 16  # edge of the square tiles (the smallest tl.dot shape)

# Pinned (num_warps, num_stages). The substitution is a chain of 16-wide row updates (one warp);
# the panel kernels chain 16 x 16 x 16 dots (two warps). num_stages=1: the backward panel kernel
# reads back what it stored behind a barrier, which no software pipelining may reorder. The row
# kernel reads only what earlier launches wrote, so its loop's loads may be pipelined (the
# stages change no sum's order); 4 warps are faster than 2 for its backward (the launch
# configuration is part of the rounding contract: dbeta, dA, dQK move by up to 2e-7 with it).
_DIAG_CONFIG = (1, 1)
_PANEL_CONFIG = (2, 1)
_ROW_CONFIG = (4, 3)

# Solve the chunks whose pair list is one window from the list (see "The pairs solve"); False
# leaves every chunk to the diag and panel kernels, as the tests' twin.
PAIRS_SOLVE = True
_PAIRS_SOLVE_WARPS = 8  # 54 registers a thread (Triton 3.6, C = 64): four programs an SM

# Skip each product whose A, QK or X tile is all zero (see "Zero tiles" above); False runs every
# product, as the tests' dense twin.
SKIP_ZERO_TILES = True


@triton.jit
def _mm(a, b, acc):
    """acc + a @ b in full float32."""
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _tile(base, R, K, C: tl.constexpr, TRI: tl.constexpr, TRANS: tl.constexpr):
    """Block (R, K) of the row-major [C, C] matrix at ``base`` as a 16 x 16 tile (its transpose
    if TRANS). Zero outside [C, C] and, by the matrix's own coordinates, outside its lower
    triangle (TRI=1, diagonal included) or strict lower triangle (TRI=2); TRI=0 keeps all."""
    return _tile_if(base, R, K, True, C, TRI, TRANS)


@triton.jit
def _tile_if(base, R, K, live, C: tl.constexpr, TRI: tl.constexpr, TRANS: tl.constexpr):
    """``_tile`` where ``live``, else zeros without reading memory."""
    o = tl.arange(0, 16)
    if TRANS:
        row = R * 16 + o[None, :]
        col = K * 16 + o[:, None]
    else:
        row = R * 16 + o[:, None]
        col = K * 16 + o[None, :]
    keep = (row < C) & (col < C) & live
    if TRI == 1:
        keep = keep & (row >= col)
    if TRI == 2:
        keep = keep & (row > col)
    return tl.load(base + row * C + col, mask=keep, other=0.0)


@triton.jit
def _put(base, R, K, v, C: tl.constexpr):
    """Store the 16 x 16 tile v as block (R, K) of the row-major [C, C] matrix at ``base``."""
    o = tl.arange(0, 16)
    row = R * 16 + o[:, None]
    col = K * 16 + o[None, :]
    tl.store(base + row * C + col, v, mask=(row < C) & (col < C))


@triton.jit
def _nonzero(t):
    """Whether the tile t holds an element that is not zero (NaN counts as not zero)."""
    return tl.max((t != 0).to(tl.int32)) != 0


@triton.jit
def _eye(t):
    """Whether the 16 x 16 tile t is the identity."""
    o = tl.arange(0, 16)
    return tl.max((t != tl.where(o[:, None] == o[None, :], 1.0, 0.0)).to(tl.int32)) == 0


@triton.jit
def _used(t, SKIP: tl.constexpr):
    """Whether a product with the tile t must run: always, unless SKIP and t is all zero."""
    if SKIP:
        return _nonzero(t)
    else:
        return True


@triton.jit
def _is_eye(t, SKIP: tl.constexpr):
    """Whether a product with the tile t may be taken as the identity's: only if SKIP."""
    if SKIP:
        return _eye(t)
    else:
        return False


@triton.jit
def _solved(count, n, MC: tl.constexpr, SOLVED: tl.constexpr):
    """Whether the pairs solve took chunk n (its pair list one window: 0 <= count <= MC)."""
    if SOLVED:
        m = tl.load(count + n)
        return (m >= 0) & (m <= MC)
    else:
        return False


@triton.jit
def _fwd_diag_kernel(
    A, Beta, X, count, C: tl.constexpr, MC: tl.constexpr, SKIP: tl.constexpr, SOLVED: tl.constexpr
):
    """X[T, T] = (I + L[T, T])^-1 for T = program_id(1); writes nothing else."""
    n = tl.program_id(0).to(tl.int64)
    if not _solved(count, n, MC, SOLVED):
        _fwd_diag(A, Beta, X, n, C, SKIP)


@triton.jit
def _fwd_diag(A, Beta, X, n, C: tl.constexpr, SKIP: tl.constexpr):
    T = tl.program_id(1)
    a = A + n * C * C
    o = tl.arange(0, 16)
    # s = (I + l)^-1 - I (strictly lower), one row at a time: s[i] = -(l[i] + l[i] @ s).
    s = tl.zeros((16, 16), dtype=tl.float32)
    rows = T * 16 + o
    b_t = tl.load(Beta + n * C + rows, mask=rows < C, other=0.0)
    if _used(_tile(a, T, T, C, 2, False) * b_t[:, None], SKIP):  # l = 0 leaves s = 0: X = I
        for i in tl.static_range(1, 16):
            r = T * 16 + i
            l_i = tl.load(a + r * C + T * 16 + o, mask=(o < i) & (r < C), other=0.0)
            l_i = l_i * tl.load(Beta + n * C + r, mask=r < C, other=0.0)
            v = l_i + tl.sum(l_i[:, None] * s, 0)
            s = tl.where(o[:, None] == i, -v[None, :], s)
    diag = o[:, None] == o[None, :]
    x = tl.where(diag, 1.0, tl.where(o[:, None] > o[None, :], s, 0.0))
    _put(X + n * C * C, T, T, x, C)


@triton.jit
def _row_tiles(a, qk, x, Beta, n, I: tl.constexpr, J, C: tl.constexpr):
    """What block row I of column panel J of the forward reads, if I > J (else zeros, with no
    memory read): beta L[I, K] and tril(QK)[I, K] for K = 0 .. I - 1 (zeros left of J) as two
    tuples, X[I, I] and tril(QK)[I, I]."""
    live = I > J
    rows = I * 16 + tl.arange(0, 16)
    b_i = tl.load(Beta + n * C + rows, mask=(rows < C) & live, other=0.0)
    ls = ()
    qs = ()
    for K in tl.static_range(I):
        ls = ls + (_tile_if(a, I, K, live & (K >= J), C, 2, False) * b_i[:, None],)
        qs = qs + (_tile_if(qk, I, K, live & (K >= J), C, 1, False),)
    return ls, qs, _tile_if(x, I, I, live, C, 1, False), _tile_if(qk, I, I, live, C, 1, False)


@triton.jit
def _fwd_panel_kernel(
    A,
    Beta,
    QK,
    X,
    QX,
    count,
    C: tl.constexpr,
    MC: tl.constexpr,
    SKIP: tl.constexpr,
    SOLVED: tl.constexpr,
):
    """Column panel J = program_id(1) of X (all but X[J, J]) and QX. Needs every X[i, i]."""
    n = tl.program_id(0).to(tl.int64)
    if not _solved(count, n, MC, SOLVED):
        _fwd_panel(A, Beta, QK, X, QX, n, C, SKIP)


@triton.jit
def _fwd_panel(A, Beta, QK, X, QX, n, C: tl.constexpr, SKIP: tl.constexpr):
    """The panel kernel's body, for chunk n.

    The blocks go down the panel in a static loop. Every tile a block row I > J may read (its
    row of A and QK from block J on, X[I, I], beta) is loaded before its products, for the whole
    panel at once where C <= 64, else a block row at a time, so that a panel waits on one or a
    few round trips instead of one a tile; the X[K, J] it computes stay in registers (a tuple
    indexed by the static K) rather than being stored and read back. The products, their skips
    and their order are those of a tile-by-tile loop: K = J first (X[J, J] often the identity),
    then K = J + 1 .. I - 1."""
    NT: tl.constexpr = (C + 15) // 16
    J = tl.program_id(1)
    base = n * C * C
    a = A + base
    qk = QK + base
    x = X + base
    qx = QX + base
    o = tl.arange(0, 16)
    zero = tl.zeros((16, 16), dtype=tl.float32)
    # Every tile a block row I > J may read, loaded before any store and product: for all
    # block rows at once where there are at most 4 (C <= 64), else block row by block row
    # (registers).
    ahead = ()
    if NT <= 4:
        for I in tl.static_range(NT):
            ahead = ahead + (_row_tiles(a, qk, x, Beta, n, I, J, C),)
    x_jj = _tile(x, J, J, C, 1, False)
    qk_jj = _tile(qk, J, J, C, 1, False)
    for R in range(0, J):
        _put(x, R, J, zero, C)
        _put(qx, R, J, zero, C)
    eye_jj = _is_eye(x_jj, SKIP)
    if eye_jj:
        q_jj = qk_jj
    else:
        q_jj = _mm(qk_jj, x_jj, zero)
    _put(qx, J, J, tl.where(o[:, None] >= o[None, :], q_jj, 0.0), C)
    xs = ()  # X[K, J] of the block rows above, by K (zeros for K <= J, never read)
    for I in tl.static_range(NT):
        x_ij = zero
        if I > J:
            if NT <= 4:
                ls, qs, x_ii, qk_ii = ahead[I]
            else:
                ls, qs, x_ii, qk_ii = _row_tiles(a, qk, x, Beta, n, I, J, C)
            lx = zero
            q_ij = zero
            hit = False  # whether lx may be nonzero
            for K in tl.static_range(I):
                l_ik = ls[K]
                q_ik = qs[K]
                if K == J:  # X[J, J], often the identity
                    hit = _used(l_ik, SKIP)
                    if eye_jj:
                        if hit:
                            lx = l_ik
                        q_ij = q_ik
                    else:
                        if hit:
                            lx = _mm(l_ik, x_jj, lx)
                        if _used(q_ik, SKIP):
                            q_ij = _mm(q_ik, x_jj, q_ij)
                elif K > J:
                    use_l = _used(l_ik, SKIP)
                    use_q = _used(q_ik, SKIP)
                    if use_l | use_q:
                        x_kj = xs[K]
                        if _used(x_kj, SKIP):
                            if use_l:
                                lx = _mm(l_ik, x_kj, lx)
                                hit = True
                            if use_q:
                                q_ij = _mm(q_ik, x_kj, q_ij)
            x_ij = -lx
            if hit:
                if not _is_eye(x_ii, SKIP):
                    x_ij = -_mm(x_ii, lx, zero)
            _put(x, I, J, x_ij, C)
            if hit:
                if _used(qk_ii, SKIP):
                    q_ij = _mm(qk_ii, x_ij, q_ij)
            _put(qx, I, J, q_ij, C)
        xs = xs + (x_ij,)


@triton.jit
def _pairs_solve_kernel(
    A,
    Beta,
    QK,
    X,
    QX,
    count,
    entries,
    C: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    MC: tl.constexpr,
):
    """X and QX of chunk program_id(0) if the pairs solve takes it (see "The pairs solve")."""
    n = tl.program_id(0).to(tl.int64)
    m = tl.load(count + n)
    if (m >= 0) & (m <= MC):
        e = tl.arange(0, MC)
        ok = e < m
        # Loaded here, not in a helper: the stores below are addressed by these tokens (see
        # kernels/chunk_prepare_pairs.py on what Inductor counts as written).
        pos = tl.load(entries + n * NP + e, mask=ok, other=0)
        tok = pos // (2 * EM)
        is_read = (pos // EM) % 2 == 1
        both = ok[:, None] & ok[None, :]
        side = both & (tok[:, None] == tok[None, :]) & (is_read[:, None] == is_read[None, :])
        head = ok & (tl.sum((side & (e[None, :] < e[:, None])).to(tl.int32), 1) == 0)
        wh = head & ~is_read  # X's rows and columns
        rh = head & is_read  # QX's rows
        base = n * C * C
        at = tok[:, None] * C + tok[None, :]  # in the chunk's [C, C] (int32)
        x_at = wh[:, None] & wh[None, :] & (tok[:, None] > tok[None, :])
        b = tl.load(Beta + n * C + tok, mask=wh, other=0.0)
        lh = tl.load(A + base + at, mask=x_at, other=0.0) * b[:, None]
        q_at = rh[:, None] & wh[None, :] & (tok[:, None] >= tok[None, :])
        qh = tl.load(QK + base + at, mask=q_at, other=0.0)
        # Forward substitution over the write heads in token order (``order``: how many write
        # heads come before, by token): Y[a] = -(L[a] + L[a] Y), with every row of Y that
        # L[a] reaches final; then QX = tril(QK) (I + Y), adding QK[:, k] Y[k] in that order.
        order = tl.sum((wh[None, :] & (tok[None, :] < tok[:, None])).to(tl.int32), 1)
        heads = tl.sum(wh.to(tl.int32), 0)
        y = tl.zeros((MC, MC), tl.float32)
        qx = qh
        for r in range(0, heads):
            row = wh & (order == r)  # the r-th write head
            l_r = tl.sum(tl.where(row[:, None], lh, 0.0), 0)
            y_r = -(l_r + tl.sum(l_r[:, None] * y, 0))
            y = tl.where(row[:, None], y_r[None, :], y)
        for r in range(0, heads):
            row = wh & (order == r)
            y_r = tl.sum(tl.where(row[:, None], y, 0.0), 0)
            q_r = tl.sum(tl.where(row[None, :], qh, 0.0), 1)
            qx += q_r[:, None] * y_r[None, :]
        cols = tl.arange(0, C)
        tile = base + cols[:, None] * C + cols[None, :]
        tl.store(X + tile, tl.where(cols[:, None] == cols[None, :], 1.0, 0.0))
        tl.store(QX + tile, tl.zeros((C, C), tl.float32))
        tl.debug_barrier()  # the tile's identity and zeros before the elements the list holds
        tl.store(X + base + at, y, mask=x_at)
        tl.store(QX + base + at, qx, mask=q_at)


@triton.jit
def _bwd_panel_kernel(QK, X, dX, dQX, G, W, C: tl.constexpr, SKIP: tl.constexpr):
    """Column panel B = program_id(1) of G (staged in G) and W = X^T G, bottom block first."""
    NT: tl.constexpr = (C + 15) // 16
    n = tl.program_id(0).to(tl.int64)
    B = tl.program_id(1)
    base = n * C * C
    qk = QK + base
    x = X + base
    dqx = dQX + base
    g_st = G + base
    w_st = W + base
    o = tl.arange(0, 16)
    zero = tl.zeros((16, 16), dtype=tl.float32)
    for t in range(0, NT - B):
        I = NT - 1 - t
        # G[I, B] = dX[I, B] + sum_{K >= I} tril(QK)[K, I]^T dQX[K, B], strict lower.
        g = _tile(dX + base, I, B, C, 2, False)
        for K in range(I, NT):
            qk_t = _tile(qk, K, I, C, 1, True)
            if _used(qk_t, SKIP):
                g = _mm(qk_t, _tile(dqx, K, B, C, 1, False), g)
        g = tl.where((I * 16 + o[:, None]) > (B * 16 + o[None, :]), g, 0.0)
        _put(g_st, I, B, g, C)
        tl.debug_barrier()  # G[I, B] is read back by the blocks above
        # W[I, B] = sum_{K >= I} X[K, I]^T G[K, B].
        x_it = _tile(x, I, I, C, 1, True)
        if _is_eye(x_it, SKIP):
            w = g
        else:
            w = _mm(x_it, g, zero)
        for K in range(I + 1, NT):
            x_t = _tile(x, K, I, C, 1, True)
            if _used(x_t, SKIP):
                w = _mm(x_t, _tile(g_st, K, B, C, 0, False), w)
        _put(w_st, I, B, w, C)


@triton.jit
def _bwd_row_kernel(A, Beta, X, dQX, W, dA, dBeta, dQK, C: tl.constexpr, SKIP: tl.constexpr):
    """Row panel I = program_id(1) of dA, dQK and dbeta, from X, dQX and W = X^T G."""
    NT: tl.constexpr = (C + 15) // 16
    n = tl.program_id(0).to(tl.int64)
    I = tl.program_id(1)
    base = n * C * C
    a = A + base
    x = X + base
    dqx = dQX + base
    w_st = W + base
    o = tl.arange(0, 16)
    rows = I * 16 + o
    zero = tl.zeros((16, 16), dtype=tl.float32)
    b_i = tl.load(Beta + n * C + rows, mask=rows < C, other=0.0)
    db = tl.zeros((16,), dtype=tl.float32)
    for J in range(0, I + 1):
        m = zero
        q = zero
        for K in range(0, J):
            xt = _tile(x, J, K, C, 1, True)
            if _used(xt, SKIP):
                m = _mm(_tile(w_st, I, K, C, 1, False), xt, m)
                q = _mm(_tile(dqx, I, K, C, 1, False), xt, q)
        # K = J: X[J, J], often the identity.
        xt = _tile(x, J, J, C, 1, True)
        w_ij = _tile(w_st, I, J, C, 1, False)
        dqx_ij = _tile(dqx, I, J, C, 1, False)
        if _is_eye(xt, SKIP):
            m = m + w_ij
            q = q + dqx_ij
        else:
            m = _mm(w_ij, xt, m)
            q = _mm(dqx_ij, xt, q)
        cols = J * 16 + o
        below = rows[:, None] > cols[None, :]
        dl = tl.where(below, -m, 0.0)
        _put(dA + base, I, J, tl.where(below, dl * b_i[:, None], 0.0), C)
        _put(dQK + base, I, J, tl.where(rows[:, None] >= cols[None, :], q, 0.0), C)
        db += tl.sum(dl * _tile(a, I, J, C, 2, False), 1)
    for J in range(I + 1, NT):
        _put(dA + base, I, J, zero, C)
        _put(dQK + base, I, J, zero, C)
    tl.store(dBeta + n * C + rows, db, mask=rows < C)


def wy_solve_fwd(
    A: torch.Tensor,
    beta: torch.Tensor,
    QK: torch.Tensor,
    X: torch.Tensor,
    QX: torch.Tensor,
    pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Fill X = (I + tril(beta A, -1))^-1 and QX = tril(QK) X; shapes and layout as above.
    With ``pairs`` (phase 1's pair lists of these chunks: count [N] int32 and entries [N, NP]
    int32, ``layout.PairLists``), the pairs solve takes the chunks whose list is one window and
    the diag and panel kernels the others."""
    n, c = A.shape[0], A.shape[1]
    if n == 0 or c == 0:
        return
    grid = (n, triton.cdiv(c, TILE))
    # The pairs kernels' window (``chunk_prepare_sparse.sparse_geometry``); none where the
    # sparse path is off (every count is then -1).
    np_ = 0 if pairs is None else pairs[1].shape[-1]
    mc = min(chunk_prepare_sparse.COMPACT, np_)
    solved = PAIRS_SOLVE and mc >= 16
    mc = mc if solved else 16
    count = pairs[0] if solved else A
    if solved:
        wrap_triton(_pairs_solve_kernel)[(n,)](
            A,
            beta,
            QK,
            X,
            QX,
            count,
            pairs[1],
            C=c,
            EM=np_ // (2 * c),
            NP=np_,
            MC=mc,
            num_warps=_PAIRS_SOLVE_WARPS,
        )
    sizes = dict(C=c, MC=mc, SKIP=SKIP_ZERO_TILES, SOLVED=solved)
    warps, stages = _DIAG_CONFIG
    wrap_triton(_fwd_diag_kernel)[grid](
        A, beta, X, count, **sizes, num_warps=warps, num_stages=stages
    )
    warps, stages = _PANEL_CONFIG
    wrap_triton(_fwd_panel_kernel)[grid](
        A, beta, QK, X, QX, count, **sizes, num_warps=warps, num_stages=stages
    )


def wy_solve_bwd(
    A: torch.Tensor,
    beta: torch.Tensor,
    QK: torch.Tensor,
    X: torch.Tensor,
    dX: torch.Tensor,
    dQX: torch.Tensor,
    dA: torch.Tensor,
    dbeta: torch.Tensor,
    dQK: torch.Tensor,
) -> None:
    """Fill dA, dbeta, dQK, the gradients of ``wy_solve_fwd`` given X and (dX, dQX)."""
    n, c = A.shape[0], A.shape[1]
    if n == 0 or c == 0:
        return
    grid = (n, triton.cdiv(c, TILE))
    w_scratch = X.new_empty(X.shape)
    warps, stages = _PANEL_CONFIG
    wrap_triton(_bwd_panel_kernel)[grid](
        QK,
        X,
        dX,
        dQX,
        dA,
        w_scratch,
        C=c,
        SKIP=SKIP_ZERO_TILES,
        num_warps=warps,
        num_stages=stages,
    )
    warps, stages = _ROW_CONFIG
    wrap_triton(_bwd_row_kernel)[grid](
        A,
        beta,
        X,
        dQX,
        w_scratch,
        dA,
        dbeta,
        dQK,
        C=c,
        SKIP=SKIP_ZERO_TILES,
        num_warps=warps,
        num_stages=stages,
    )
