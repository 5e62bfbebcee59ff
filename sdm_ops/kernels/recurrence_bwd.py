"""Backward of phase 2: the chunks of every stream in reverse, from the forward's snapshot.

For chunk n, with dM the bank gradient at the chunk's end and M the bank at the chunk's start
(its rows read from the forward's snapshot, which holds the chunk-start row of every write
and read entry: the backward never touches the bank itself):

    ddelta_j = sum_{b in j} scatter_w[b] dM[s_b]
    du = X^T ddelta + QX^T dout                   dv = beta du        dret = -beta du
    dscatter_w[b] = dM[s_b] . delta_j             drow_decay[b] = dM[s_b] . M[s_b]  (rank 0)
    dgather_w[a] = dret_i . M[s_a]                dgather_r[r] = dout_i . M[s_r]
    dM[s] <- row_decay dM[s] + sum_{a on s} gather_w[a] dret_i      (written slots)
    dM[s_r] += gather_r[r] dout_i                                     (read slots)

A program owns one stream and BD = 16 columns (grid (B * H * D // 16,), like the forward), so
the per-entry dot products come out as one partial per 16 columns, [D // 16, ...], which the
dual-matmul kernel sums over the leading dimension, block 0 first. As in the forward, a chunk
whose entries fit one tile (TB = C) is one pass through registers (ddelta, du and dout stay
there between the dots and the dM updates); otherwise it goes in steps over tiles of TB tokens
with barriers between them (ddelta passes between the steps through a scratch buffer). dM is
updated in passes by the entries' rank within their slot (write entries, then read entries),
separated by barriers: one writer per row at a time, in entry order, so the result is bitwise
deterministic (on the one-tile path every pass after the first is an atomic add; each chunk
loads the write indices and the write entries' snapshot rows of the chunk after it in the walk
while its own work is in flight, and every read-only operand of a chunk before the chunk's
first store, which a later load would wait for).

The walk's du has a part that does not depend on dM: QX^T dout. ``_qx_dout_kernel`` forms it
before the walk, one program per chunk and stream over all D columns, into du, and the walk adds
X^T ddelta onto it: one [C, C] dot a chunk in the walk's dependent chain instead of two. Its
dots run in tf32x3 (below), 4 warps and 32 columns at a time.

``_dual_matmul_bwd_kernel`` then carries the gradient through the WY solve per chunk, over all
D columns, without the solve's backward. Since delta = X u and QX u = tril(QK) delta, the
gradient reaching delta from outside is g = ddelta + tril(QK)^T dout, and du = X^T g is the one
the walk formed. The solve (I + L) delta = u then gives, with L = tril(beta A, -1):

    dL  = -du delta^T         (strict lower triangle)     dA = beta dL
    dQK = tril(dout delta^T)                               dbeta += rowsum(dL * A)

which is -X^T (dX + tril(QK)^T dQX) X^T with dX = ddelta u^T and dQX = dout u^T, the WY
solve's backward (``kernels/wy_solve.py``), in two rank-D products instead of chains of
16 x 16 tiles. The dots run in tf32x3 (three tensor-core products: about float32's accuracy at
a third of the FMA dots' time); dbeta also takes phase 2's share du . res. The same program
sums its chunk's per-entry partials (one launch where four reductions were).

Layout (contiguous): as in ``recurrence_fwd``; du [B, T, H, D] float32 (written; it holds
QX^T dout between ``_qx_dout_kernel`` and the walk), ddelta the same or one element (the tiled
path's scratch); dv [B, T, H, D] (v's dtype); dA, dQK as A [B, H, N, C, C] float32; partials
[D // 16, B, T, H, W or R] float32 (those of the read entries written only with dout); dbank
[B, H, S, D] float32 holding the gradient of the final bank on entry and of the initial bank
on exit.
8 warps (``_qx_dout_kernel`` and the dual-matmul kernel 4), pinned.
Indices outside [0, S) are masked exactly as in the forward. A packed batch walks each
sequence's chunk slots in reverse, as the forward walks them (see ``recurrence_fwd``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._common import chunk_grid
from ._snapshot import BLOCK_D, SNAP_CODES, load_snapshot
from ._tiles import bank_slots, dense_chunk, entry_offsets, snapshot_entries, token_rows
from .recurrence_fwd import recurrence_fwd_geometry

_ROWS = 32
_NUM_WARPS = 8
_DUAL_WARPS = 4
_DUAL_BLOCK_D = 32


@triton.jit
def _recurrence_bwd_kernel(
    beta,
    write_idx,
    read_idx,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    X,
    snap,
    snap_scale,
    delta,
    dout,
    chunks,
    seq_chunks,
    dbank,
    ddelta,
    du,
    dv,
    p_gw,
    p_gr,
    p_sw,
    p_rd,
    T,
    H,
    S,
    NC,
    NTOK,
    D: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    TB: tl.constexpr,
    BD: tl.constexpr,
    RB: tl.constexpr,
    MODE: tl.constexpr,
    HAS_DOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    p = tl.program_id(0) // (D // BD)
    c0 = tl.program_id(0) % (D // BD) * BD
    cols = c0 + tl.arange(0, BD)
    # The same columns, declared contiguous in runs of 4 only, for the snapshot's rows (as in
    # the forward: a bfloat16 or byte load of runs of 16 gets a layout of its own, and the
    # conversions cost registers: spills with the fp8 snapshot otherwise).
    rcols = tl.max_contiguous(cols, 4)
    h = p % H
    pid_c = tl.program_id(0) % (D // BD)
    # This program's block of the partials, [D // BD, B, T, H, W or R] over all tokens.
    p_gw += pid_c.to(tl.int64) * NTOK * W
    p_sw += pid_c.to(tl.int64) * NTOK * W
    p_rd += pid_c.to(tl.int64) * NTOK * W
    p_gr += pid_c.to(tl.int64) * NTOK * R
    dbank_p = dbank + p.to(tl.int64) * S * D
    if VARLEN:  # the sequence's chunk slots, and X tiles [1, H, NC, C, C]
        lo = tl.load(seq_chunks + p // H).to(tl.int32)
        hi = tl.load(seq_chunks + p // H + 1).to(tl.int32)
        tiles = h.to(tl.int64) * NC
    else:
        lo = 0
        hi = tl.cdiv(T, C)
        tiles = p.to(tl.int64) * hi
    ci = tl.arange(0, C)
    if TB == C:
        # As in the forward, each chunk loads the write indices of the chunk it precedes in
        # this walk (the one before it) while its own gathers are in flight. The last chunk's:
        if VARLEN:
            ltok0 = tl.load(chunks + 2 * (hi - 1), mask=lo < hi, other=0)
            lcount = tl.load(chunks + 2 * (hi - 1) + 1, mask=lo < hi, other=0).to(tl.int32)
        else:
            ltok0, lcount = dense_chunk(hi - 1, p, T, H, C)
            lcount = tl.where(hi > lo, lcount, 0)
        ltok, ltok_ok = token_rows(ltok0, h, H, lcount, ci)
        lwent, lwm = entry_offsets(ltok, ltok_ok, W, WP)
        next_w = tl.load(write_idx + lwent, mask=lwm, other=-1).to(tl.int64)
        # ... and its snapshot rows (the snapshot is read-only here, so the rows of the chunk
        # before can be in flight during a chunk's dependent chain).
        _, lok = bank_slots(next_w, lwm, S)
        next_m0 = load_snapshot(
            snap, snap_scale, snapshot_entries(ltok, 0, W + R, WP), lok, c0, rcols, D, BD, MODE
        )
    for nn in range(lo, hi):
        n = lo + hi - 1 - nn
        if VARLEN:
            tok0 = tl.load(chunks + 2 * n)
            count = tl.load(chunks + 2 * n + 1).to(tl.int32)
        else:
            tok0, count = dense_chunk(n, p, T, H, C)
        x_base = (tiles + n) * C * C
        if TB == C:
            # The whole chunk as one tile: ddelta and du stay in registers between the dots.
            tok, tok_ok = token_rows(tok0, h, H, count, ci)
            went, wm = entry_offsets(tok, tok_ok, W, WP)
            s, ok = bank_slots(next_w, wm, S)
            dptr = dbank_p + s[:, :, None] * D + cols[None, None, :]
            dm1 = tl.load(dptr, mask=ok[:, :, None], other=0.0)
            if VARLEN:
                ntok0 = tl.load(chunks + 2 * n - 2, mask=n > lo, other=0)
                ncount = tl.load(chunks + 2 * n - 1, mask=n > lo, other=0).to(tl.int32)
            else:
                ntok0, ncount = dense_chunk(n - 1, p, T, H, C)
                ncount = tl.where(n > lo, ncount, 0)
            ntok, ntok_ok = token_rows(ntok0, h, H, ncount, ci)
            nwent, nwm = entry_offsets(ntok, ntok_ok, W, WP)
            next_w = tl.load(write_idx + nwent, mask=nwm, other=-1).to(tl.int64)
            m0 = next_m0
            _, nok = bank_slots(next_w, nwm, S)
            next_m0 = load_snapshot(
                snap, snap_scale, snapshot_entries(ntok, 0, W + R, WP), nok, c0, rcols, D, BD, MODE
            )
            rk = tl.load(rank + went, mask=ok, other=-1)
            first = ok & (rk == 0)
            sw = tl.load(scatter_w + went, mask=ok, other=0.0)
            dl = tl.load(delta + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0)
            # Every read-only load of the chunk before its first store (a load after a store
            # waits for it: the compiler cannot tell they do not alias).
            bb = tl.load(beta + tok, mask=tok_ok, other=0.0).to(tl.float32)
            gw = tl.load(gather_w + went, mask=ok, other=0.0)
            rd = tl.load(row_decay + went, mask=first, other=1.0)
            rent, rm = entry_offsets(tok, tok_ok, R, RP)
            q, qok = bank_slots(tl.load(read_idx + rent, mask=rm, other=-1), rm, S)
            xt = tl.load(X + x_base + ci[None, :] * C + ci[:, None])  # X^T
            if HAS_DOUT:
                do = tl.load(
                    dout + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                ).to(tl.float32)
                # QX^T dout, which ``_qx_dout_kernel`` left in du.
                gq = tl.load(du + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0)
                qrows = load_snapshot(
                    snap,
                    snap_scale,
                    snapshot_entries(tok, W, W + R, RP),
                    qok,
                    c0,
                    rcols,
                    D,
                    BD,
                    MODE,
                )
                rrk = tl.load(read_rank + rent, mask=qok, other=-1)
                rg = tl.load(gather_r + rent, mask=qok, other=0.0)
            dd = tl.sum(sw[:, :, None] * dm1, 1)
            tl.store(p_sw + went, tl.sum(dm1 * dl[:, None, :], 2), mask=wm)
            tl.store(p_rd + went, tl.where(first, tl.sum(dm1 * m0, 2), 0.0), mask=wm)
            if HAS_DOUT:
                duu = tl.dot(xt, dd, gq, input_precision="ieee")
            else:
                duu = tl.dot(xt, dd, input_precision="ieee")
            tl.store(du + tok[:, None] * D + cols[None, :], duu, mask=tok_ok[:, None])
            tl.store(
                dv + tok[:, None] * D + cols[None, :],
                (bb[:, None] * duu).to(dv.dtype.element_ty),
                mask=tok_ok[:, None],
            )
            dret = -bb[:, None] * duu
            tl.store(p_gw + went, tl.sum(dret[:, None, :] * m0, 2), mask=wm)
            if HAS_DOUT:
                tl.store(p_gr + rent, tl.sum(do[:, None, :] * qrows, 2), mask=rm)
            gterm = gw[:, :, None] * dret[:, None, :]
            npass = tl.max(tl.max(tl.where(ok, rk + 1, 0), 1), 0)
            tl.debug_barrier()  # every load of dM at the chunk's end precedes a store
            tl.store(dptr, rd[:, :, None] * dm1 + gterm, mask=first[:, :, None])
            for k in range(1, npass):
                tl.debug_barrier()
                tl.atomic_add(dptr, gterm, mask=(ok & (rk == k))[:, :, None], sem="relaxed")
            if HAS_DOUT:
                rpass = tl.max(tl.max(tl.where(qok, rrk + 1, 0), 1), 0)
                rterm = rg[:, :, None] * do[:, None, :]
                rptr = dbank_p + q[:, :, None] * D + cols[None, None, :]
                for k in range(0, rpass):
                    tl.debug_barrier()
                    tl.atomic_add(rptr, rterm, mask=(qok & (rrk == k))[:, :, None], sem="relaxed")
            tl.debug_barrier()
        else:
            npass = 1
            rpass = 0
            # (b) ddelta, dscatter_w, drow_decay from dM at the chunk's end.
            for tb in range(0, C, TB):
                ii = tb + tl.arange(0, TB)
                tok, tok_ok = token_rows(tok0, h, H, count, ii)
                went, wm = entry_offsets(tok, tok_ok, W, WP)
                s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
                rk = tl.load(rank + went, mask=ok, other=-1)
                npass = tl.maximum(npass, tl.max(tl.max(tl.where(ok, rk + 1, 0), 1), 0))
                sw = tl.load(scatter_w + went, mask=ok, other=0.0)
                dm1 = tl.load(
                    dbank_p + s[:, :, None] * D + cols[None, None, :],
                    mask=ok[:, :, None],
                    other=0.0,
                )
                m0 = load_snapshot(
                    snap,
                    snap_scale,
                    snapshot_entries(tok, 0, W + R, WP),
                    ok,
                    c0,
                    rcols,
                    D,
                    BD,
                    MODE,
                )
                dl = tl.load(
                    delta + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                )
                tl.store(
                    ddelta + tok[:, None] * D + cols[None, :],
                    tl.sum(sw[:, :, None] * dm1, 1),
                    mask=tok_ok[:, None],
                )
                tl.store(p_sw + went, tl.sum(dm1 * dl[:, None, :], 2), mask=wm)
                tl.store(p_rd + went, tl.where(ok & (rk == 0), tl.sum(dm1 * m0, 2), 0.0), mask=wm)
            tl.debug_barrier()
            # (c) du = X^T ddelta + QX^T dout.
            tok_c, ok_c = token_rows(tok0, h, H, count, ci)
            ok_c = ok_c[:, None]
            dd = tl.load(ddelta + tok_c[:, None] * D + cols[None, :], mask=ok_c, other=0.0)
            for rb in range(0, C, RB):
                ri = rb + tl.arange(0, RB)
                xt = tl.load(X + x_base + ci[None, :] * C + ri[:, None])  # rows ri of X^T
                tok_r, ok_r = token_rows(tok0, h, H, count, ri)
                if HAS_DOUT:  # onto QX^T dout, which ``_qx_dout_kernel`` left in du
                    gq = tl.load(
                        du + tok_r[:, None] * D + cols[None, :], mask=ok_r[:, None], other=0.0
                    )
                    acc = tl.dot(xt, dd, gq, input_precision="ieee")
                else:
                    acc = tl.dot(xt, dd, input_precision="ieee")
                tl.store(du + tok_r[:, None] * D + cols[None, :], acc, mask=ok_r[:, None])
            tl.debug_barrier()
            # (d) dv, dgather_w, dgather_r; dM at the written rows (rank 0).
            for tb in range(0, C, TB):
                ii = tb + tl.arange(0, TB)
                tok, tok_ok = token_rows(tok0, h, H, count, ii)
                went, wm = entry_offsets(tok, tok_ok, W, WP)
                s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
                rk = tl.load(rank + went, mask=ok, other=-1)
                bb = tl.load(beta + tok, mask=tok_ok, other=0.0).to(tl.float32)
                duu = tl.load(
                    du + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                )
                tl.store(
                    dv + tok[:, None] * D + cols[None, :],
                    (bb[:, None] * duu).to(dv.dtype.element_ty),
                    mask=tok_ok[:, None],
                )
                dret = -bb[:, None] * duu
                m0 = load_snapshot(
                    snap,
                    snap_scale,
                    snapshot_entries(tok, 0, W + R, WP),
                    ok,
                    c0,
                    rcols,
                    D,
                    BD,
                    MODE,
                )
                tl.store(p_gw + went, tl.sum(dret[:, None, :] * m0, 2), mask=wm)
                rent, rm = entry_offsets(tok, tok_ok, R, RP)
                q, qok = bank_slots(tl.load(read_idx + rent, mask=rm, other=-1), rm, S)
                rrk = tl.load(read_rank + rent, mask=qok, other=0)
                rpass = tl.maximum(rpass, tl.max(tl.max(tl.where(qok, rrk + 1, 0), 1), 0))
                if HAS_DOUT:
                    qrows = load_snapshot(
                        snap,
                        snap_scale,
                        snapshot_entries(tok, W, W + R, RP),
                        qok,
                        c0,
                        rcols,
                        D,
                        BD,
                        MODE,
                    )
                    doo = tl.load(
                        dout + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                    ).to(tl.float32)
                    tl.store(p_gr + rent, tl.sum(doo[:, None, :] * qrows, 2), mask=rm)
                first = ok & (rk == 0)
                gw = tl.load(gather_w + went, mask=ok, other=0.0)
                rd = tl.load(row_decay + went, mask=first, other=1.0)
                dptr = dbank_p + s[:, :, None] * D + cols[None, None, :]
                dm1 = tl.load(dptr, mask=first[:, :, None], other=0.0)
                tl.store(
                    dptr,
                    rd[:, :, None] * dm1 + gw[:, :, None] * dret[:, None, :],
                    mask=first[:, :, None],
                )
            tl.debug_barrier()
            # (e) The other write entries of each slot, then the read entries, pass by pass.
            for k in range(1, npass + rpass):
                for tb in range(0, C, TB):
                    ii = tb + tl.arange(0, TB)
                    tok, tok_ok = token_rows(tok0, h, H, count, ii)
                    bb = tl.load(beta + tok, mask=tok_ok, other=0.0).to(tl.float32)
                    if k < npass:
                        went, wm = entry_offsets(tok, tok_ok, W, WP)
                        s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
                        rk = tl.load(rank + went, mask=ok, other=-1)
                        mine = ok & (rk == k)
                        gw = tl.load(gather_w + went, mask=mine, other=0.0)
                        duu = tl.load(
                            du + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                        )
                        dptr = dbank_p + s[:, :, None] * D + cols[None, None, :]
                        cur = tl.load(dptr, mask=mine[:, :, None], other=0.0)
                        tl.store(
                            dptr,
                            cur - gw[:, :, None] * (bb[:, None] * duu)[:, None, :],
                            mask=mine[:, :, None],
                        )
                    else:
                        # Read entries: names differ from the branch above (tiles of another
                        # shape).
                        if HAS_DOUT:
                            r_ent, r_m = entry_offsets(tok, tok_ok, R, RP)
                            r_raw = tl.load(read_idx + r_ent, mask=r_m, other=-1)
                            r_s, r_ok = bank_slots(r_raw, r_m, S)
                            r_rk = tl.load(read_rank + r_ent, mask=r_ok, other=-1)
                            r_mine = r_ok & (r_rk == k - npass)
                            r_g = tl.load(gather_r + r_ent, mask=r_mine, other=0.0)
                            r_do = tl.load(
                                dout + tok[:, None] * D + cols[None, :],
                                mask=tok_ok[:, None],
                                other=0.0,
                            ).to(tl.float32)
                            r_ptr = dbank_p + r_s[:, :, None] * D + cols[None, None, :]
                            r_cur = tl.load(r_ptr, mask=r_mine[:, :, None], other=0.0)
                            tl.store(
                                r_ptr,
                                r_cur + r_g[:, :, None] * r_do[:, None, :],
                                mask=r_mine[:, :, None],
                            )
                tl.debug_barrier()


@triton.jit
def _qx_dout_kernel(
    QX,
    dout,
    du,
    chunks,
    T,
    H,
    D: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """du = QX^T dout for one chunk (or chunk slot) and stream over all D columns, BK at a
    time: the part of du that does not depend on the walk, formed before it so that the walk
    keeps one dot, X^T ddelta, which it adds onto this. The dots run in tf32x3, as the
    dual-matmul kernel's."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    h = p % H
    if VARLEN:  # loaded here, not in a helper: see _tiles.bank_slots
        tok0 = tl.load(chunks + 2 * n)
        count = tl.load(chunks + 2 * n + 1).to(tl.int32)
    else:
        tok0, count = dense_chunk(n, p, T, H, C)
    ci = tl.arange(0, C)
    tok, ok = token_rows(tok0, h, H, count, ci)
    base = (p.to(tl.int64) * tl.num_programs(0) + n) * C * C
    qxt = tl.load(QX + base + ci[None, :] * C + ci[:, None])  # QX^T
    for k0 in range(0, D, BK):
        off = tok[:, None] * D + (k0 + tl.arange(0, BK))[None, :]
        do = tl.load(dout + off, mask=ok[:, None], other=0.0).to(tl.float32)
        tl.store(du + off, tl.dot(qxt, do, input_precision="tf32x3"), mask=ok[:, None])


@triton.jit
def _dual_matmul_bwd_kernel(
    solve_beta,
    res,
    delta,
    du,
    dout,
    A,
    chunks,
    p_gw,
    p_gr,
    p_sw,
    p_rd,
    dA,
    dQK,
    dbeta,
    dgw,
    dgr,
    dsw,
    drd,
    T,
    H,
    NTOK,
    D: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    BK: tl.constexpr,
    NB: tl.constexpr,
    HAS_DOUT: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The WY solve's gradients from the walk's, for one chunk (or chunk slot: an unused one gets
    zero tiles): dL = -du delta^T below the diagonal, dA = solve_beta dL, dQK = tril(dout delta^T)
    and dbeta = du . res + rowsum(dL * A); and the chunk's per-entry gradients, the walk's NB
    partials summed in order."""
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
    acc_l = tl.zeros((C, C), tl.float32)
    acc_q = tl.zeros((C, C), tl.float32)
    db = tl.zeros((C,), tl.float32)
    for k0 in range(0, D, BK):
        kc = k0 + tl.arange(0, BK)
        off = tok[:, None] * D + kc[None, :]
        g = tl.load(du + off, mask=ok[:, None], other=0.0)
        d = tl.trans(tl.load(delta + off, mask=ok[:, None], other=0.0))
        acc_l = tl.dot(g, d, acc_l, input_precision="tf32x3")
        if HAS_DOUT:
            acc_q = tl.dot(
                tl.load(dout + off, mask=ok[:, None], other=0.0).to(tl.float32),
                d,
                acc_q,
                input_precision="tf32x3",
            )
        db += tl.sum(g * tl.load(res + off, mask=ok[:, None], other=0.0), 1)
    base = (p.to(tl.int64) * tl.num_programs(0) + n) * C * C
    tile = base + ci[:, None] * C + ci[None, :]
    below = ci[:, None] > ci[None, :]
    # Selects, not products with zero: a NaN of delta (a token past the chunk's first non-finite
    # update) stays off the diagonal and above it, and off the pairs whose A is zero.
    dL = tl.where(below, -acc_l, 0.0)
    a = tl.load(A + tile, mask=below, other=0.0)
    sb = tl.load(solve_beta + tok, mask=ok, other=0.0).to(tl.float32)
    tl.store(dA + tile, dL * sb[:, None])
    tl.store(dQK + tile, tl.where(ci[:, None] >= ci[None, :], acc_q, 0.0))
    tl.store(dbeta + tok, db + tl.sum(tl.where(a != 0.0, dL * a, 0.0), 1), mask=ok)
    went, wm = entry_offsets(tok, ok, W, WP)
    _sum_partials(p_gw, dgw, went, wm, NTOK * W, NB)
    _sum_partials(p_sw, dsw, went, wm, NTOK * W, NB)
    _sum_partials(p_rd, drd, went, wm, NTOK * W, NB)
    rent, rm = entry_offsets(tok, ok, R, RP)
    if HAS_DOUT:
        _sum_partials(p_gr, dgr, rent, rm, NTOK * R, NB)
    else:  # without an output gradient the read weights get none
        tl.store(dgr + rent, tl.zeros((C, RP), tl.float32), mask=rm)


@triton.jit
def _sum_partials(part, out, ent, mask, STRIDE, NB: tl.constexpr):
    """out[ent] = the sum of the NB column blocks' partials [NB, ...] at ent, block 0 first."""
    acc = tl.load(part + ent, mask=mask, other=0.0)
    for c in tl.static_range(1, NB):
        acc += tl.load(part + c * STRIDE + ent, mask=mask, other=0.0)
    tl.store(out + ent, acc, mask=mask)


def recurrence_bwd(
    beta,
    write_idx,
    read_idx,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    X,
    QX,
    res,
    delta,
    snap,
    snap_scale,
    snapshot: str,
    dout,
    dbank,
    dv,
    dA,
    dQK,
    dbeta,
    A,
    solve_beta,
    chunks=None,
    seq_chunks=None,
):
    """Launch the phase-2 backward. ``dbank`` (the gradient of the final bank, turned into that
    of the initial bank) is a work buffer; dv, dA, dQK and dbeta are written whole (A: phase 1's,
    solve_beta: the beta the WY solve ran on). ``dout`` may be None (no gradient of ``out``).
    Returns the per-entry gradients (d_gather_w, d_gather_r, d_scatter_w, d_row_decay), which the
    dual-matmul kernel sums from the walk's partials."""
    B, T, H, D = res.shape
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    C = X.shape[-1]
    S = dbank.shape[-2]
    N, P = chunk_grid(B, T, H, C, chunks)
    streams = dbank.shape[0] * H  # B * H, or N * H for a packed batch
    wp, rp, tb = recurrence_fwd_geometry(W, R, C)
    nb = D // BLOCK_D
    f32 = dict(dtype=torch.float32, device=res.device)
    # ddelta is the tiled path's scratch between its steps; the one-tile path keeps it in
    # registers.
    ddelta = torch.empty(B, T, H, D, **f32) if tb < C else torch.empty(1, **f32)
    du = torch.empty(B, T, H, D, **f32)
    p_gw = torch.empty(nb, B, T, H, W, **f32)
    p_sw = torch.empty(nb, B, T, H, W, **f32)
    p_rd = torch.empty(nb, B, T, H, W, **f32)
    has_dout = dout is not None
    # Without an output gradient the read weights get none: the walk leaves p_gr alone.
    p_gr = torch.empty(nb, B, T, H, R, **f32) if has_dout else torch.empty(1, **f32)
    dgw, dsw, drd = (torch.empty(B, T, H, W, **f32) for _ in range(3))
    dgr = torch.empty(B, T, H, R, **f32)
    varlen = chunks is not None
    if has_dout and N * P:
        wrap_triton(_qx_dout_kernel)[(N, P)](
            QX,
            dout,
            du,
            chunks if varlen else du,
            T,
            H,
            D=D,
            C=C,
            BK=min(D, _DUAL_BLOCK_D),
            VARLEN=varlen,
            num_warps=_DUAL_WARPS,
        )
    if streams * T:
        wrap_triton(_recurrence_bwd_kernel)[(streams * nb,)](
            beta,
            write_idx,
            read_idx,
            gather_w,
            gather_r,
            scatter_w,
            row_decay,
            rank,
            read_rank,
            X,
            snap,
            snap_scale if snap_scale.numel() else gather_w,
            delta,
            dout if has_dout else delta,
            chunks if varlen else rank,
            seq_chunks if varlen else rank,
            dbank,
            ddelta,
            du,
            dv,
            p_gw,
            p_gr,
            p_sw,
            p_rd,
            T,
            H,
            S,
            N,
            B * T * H,
            D=D,
            W=W,
            R=R,
            WP=wp,
            RP=rp,
            C=C,
            TB=tb,
            BD=BLOCK_D,
            RB=min(C, _ROWS),
            MODE=SNAP_CODES[snapshot],
            HAS_DOUT=has_dout,
            VARLEN=varlen,
            num_warps=_NUM_WARPS,
        )
    if N * P:  # also when T = 0 in a packed batch: its unused chunk slots get zero tiles
        wrap_triton(_dual_matmul_bwd_kernel)[(N, P)](
            solve_beta,
            res,
            delta,
            du,
            dout if has_dout else du,
            A,
            chunks if varlen else rank,
            p_gw,
            p_gr,
            p_sw,
            p_rd,
            dA,
            dQK,
            dbeta,
            dgw,
            dgr,
            dsw,
            drd,
            T,
            H,
            B * T * H,
            D=D,
            W=W,
            R=R,
            WP=wp,
            RP=rp,
            C=C,
            BK=min(D, _DUAL_BLOCK_D),
            NB=nb,
            HAS_DOUT=has_dout,
            VARLEN=varlen,
            num_warps=_DUAL_WARPS,
        )
    return dgw, dgr, dsw, drd
