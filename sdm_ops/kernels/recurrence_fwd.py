"""Phase 2 of the chunked recurrence: gathers, dual matmul, decay and write, chunk by chunk.

Given phase 1 (``chunk_prepare``) and the WY solve (X, QX per chunk), for chunk n of a stream
with start state M (the bank, updated in place):

    retrieved_i = sum_{a in i} gather_w[a] M[s_a]        inter_i = sum_{r in i} gather_r[r] M[s_r]
    u = beta * (v - retrieved)     delta = X u     out = inter + QX u
    M[s] <- row_decay[s] M[s] + sum_{b on s} scatter_w[b] delta_{j_b}     (written slots only)

The bank's D columns are independent, so a program owns one stream and BD = 16 columns and
walks every chunk of the stream in order: the number of launches does not grow with T.
When a chunk's entries fit one tile (TB = C: C * max(W, R) * 16 <= ``_TILE`` after rounding W
and R up to powers of two; W = R = 8 at C = 64), a chunk is one pass through registers: gather
the write and read rows (and store them as the snapshot), u = beta (v - retrieved), delta = X u
and out = inter + QX u by full-float32 dots, then, after a barrier, write. Where the walk's
programs outnumber the SMs it must fit 128 registers a thread for two programs an SM (one
wave): the in-place walk does as it is, the functional forwards' walks run capped there
(``walk_capped``, ``_capped_walk``), except the training walk over a float32 bank, which would
spill. Without a snapshot, and in the capped walk, the walk forms only delta and stores
res = v - retrieved and inter instead of out; ``_out_kernel`` forms out = inter + QX (beta
res) afterwards, one program a chunk and stream, in tf32x3. With no more programs than SMs
and a float32 bank (``walk_forms_out``), or with a snapshot where the walk is not capped, the
walk forms out itself by the full-float32 dot; the choice depends on the streams, D, bank
dtype, snapshot, source bank and SM count alone.
Otherwise the chunk goes in three steps over tiles of TB tokens, with barriers between them:
(1) gathers, storing res = v - retrieved and inter (to a per-program scratch); (2) the dots,
storing delta; (3) the writes. Writes go in passes over the entries' rank within their slot:
the first entry on each slot (rank 0) stores row_decay * M0 + its term, then entries of rank 1,
2, ... add their terms in passes separated by barriers (atomic adds into a float32 bank: no
load round trip; a load and a store into a bfloat16 one, rounding as it goes), so every bank
row has one writer at a time and the sum runs in entry order: bitwise deterministic (for a
given tile geometry and warp count, pinned here). On the one-tile path each chunk also loads
the next chunk's indices and gather weights while its own gathers are in flight.

Layout (all contiguous): v, out [B, T, H, D] (out in v's dtype); beta [B, T, H];
write_idx, gather_w, scatter_w, row_decay, rank [B, T, H, W]; read_idx, gather_r [B, T, H, R];
X, QX [B, H, N, C, C] float32; bank [B, H, S, D] float32 or bfloat16; res, delta [B, T, H, D]
float32 (written only with a snapshot, or as scratch by the three-step path; res, and inter_buf
[B, T, H, D] float32, by the one-tile path without a snapshot for ``_out_kernel``, unless the
walk forms out); scratch [B * H, C, D] float32. The snapshot holds the chunk-start row of
every entry, write entries then read entries (E = W + R per token): rows [B, T, H, E, D] (none:
bank dtype, bf16: bfloat16, fp8: float8_e4m3fn bit patterns as uint8) or [B, T, H, E, D / 2]
uint8 (int4), with scales [B, T, H, E, D / 16] float32 for fp8 and int4 (one per 16 columns,
see ``reference.quantize_rows``); the backward reads every bank row it needs from it. Indices
outside [0, S) are masked: they read and write nothing. Bank offsets are 64-bit.

With a source bank (the functional operator's: ``source`` [B, H, S, D] or shared [H, S, D]
and ``first`` [B * H, S], ``bank_copy.first_writes``), the state starts from ``source`` and
``bank`` holds only what phase 2 writes (and the rows no chunk writes, copied beforehand by
``bank_copy.bank_copy_unwritten``): an entry of chunk n gathers its row from ``bank`` when
``first`` of its slot is below n (an earlier chunk of the stream wrote it), else from
``source``; a row's first write stores all its columns. So the copy moves only the rows no
chunk writes. The one-tile path loads the next chunk's ``first`` entries after its dots, with
the next chunk's indices long arrived.

With a working set (``ROWS``: ``write_src`` and ``read_src``, see ``sdm_ops/working_set.py``),
``bank`` is ``[P, U, D]``, ``write_idx`` and ``read_idx`` hold the entries' rows in it and
``first`` is ``[P, U]``; a read from the source bank goes to the entry's own slot there
(``write_src`` / ``read_src``), and nothing is copied beforehand.

A packed batch (``cu_seqlens``; B = 1): a program owns sequence n = p // H of head h and walks
its chunk slots seq_chunks[n] : seq_chunks[n + 1], each slot's tokens read from the table
``chunks`` (see ``chunk_prepare``); X, QX are [1, H, NC, C, C] and the bank [N, H, S, D].

Grid: (B * H * D // 16,), or (N * H * D // 16,) for a packed batch, the D // 16 column
programs of a stream adjacent, so that they run side by side and share the chunk's indices,
X and QX (and the bank rows' other columns) through L2; 8 warps, pinned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._common import chunk_grid, sm_count
from ._snapshot import BLOCK_D, SNAP_CODES, store_token_rows
from ._tiles import bank_slots, dense_chunk, entry_offsets, token_rows
from .walk_out import _out_kernel, bad_rows, first_of

_ROWS = 32  # rows of X per dot in step 2, and tokens of u per slice
_NUM_WARPS = 8
# Registers a thread at which two 8-warp programs share an SM (65536 registers an SM).
ONE_WAVE_REGS = 128
_TILE = 8192  # entries x columns gathered at once
_OUT_TILE = 4096  # chunk tokens x out's columns a step of _out_kernel, at most
_OUT_WARPS = 4  # a chunk of 64 tokens; twice as many at 128
# The SM count ``walk_forms_out`` and ``walk_capped`` assume: None for the device's own (on the
# CPU none, so that the interpreter takes the reference shape's path: the capped walk, out after
# it); tests and ``tools/ptxas_report.py`` set it.
_WALK_SMS: int | None = None


@triton.jit
def _gather(row_p, ok, w, cols, KEEP: tl.constexpr):
    """Rows [TB, EP, BD] starting at ``row_p`` [TB, EP] (float32, zero where not ``ok``) and
    their sums weighted by ``w`` over the entries, [TB, BD]. ``KEEP`` asks L2 to keep the rows
    (evict_last): the one-tile walk without a snapshot is slightly faster so; the other walks
    keep the default."""
    rows = tl.load(
        row_p[:, :, None] + cols[None, None, :],
        mask=ok[:, :, None],
        other=0.0,
        eviction_policy="evict_last" if KEEP else "",
    ).to(tl.float32)
    return rows, tl.sum(w[:, :, None] * rows, 1)


@triton.jit
def _first_chunks(first_p, s, ok, SOURCE: tl.constexpr):
    """The first chunk of the stream that writes each slot of ``s`` (the ``first`` table), with
    a source bank; 0 without one (unused)."""
    if SOURCE:
        return tl.load(first_p + s, mask=ok, other=0)
    else:
        return 0


@triton.jit
def _row_ptr(bank_p, src_p, fw, n, s, ss, D: tl.constexpr, SOURCE: tl.constexpr):
    """Where an entry of chunk ``n`` reads its row, given ``fw`` (``_first_chunks``): row ``s``
    of the updated bank once an earlier chunk has written it, else slot ``ss`` of the source
    bank (``ss`` is ``s`` itself unless the bank is a working set of rows, ``ROWS``)."""
    if SOURCE:
        return tl.where(fw < n, bank_p + s * D, src_p + ss * D)
    else:
        return bank_p + s * D


@triton.jit
def _recurrence_fwd_kernel(
    v,
    beta,
    write_idx,
    read_idx,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    X,
    QX,
    bank,
    out,
    res,
    delta,
    scratch,
    snap,
    snap_scale,
    chunks,
    seq_chunks,
    source,
    first,
    write_src,
    read_src,
    inter_buf,
    T,
    H,
    S,
    S_SRC,
    NC,
    SRC_PERIOD,
    D: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    C: tl.constexpr,
    TB: tl.constexpr,
    BD: tl.constexpr,
    RB: tl.constexpr,
    KB: tl.constexpr,
    MODE: tl.constexpr,
    SNAPSHOT: tl.constexpr,
    VARLEN: tl.constexpr,
    SOURCE: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_WALK: tl.constexpr,
):
    p = tl.program_id(0) // (D // BD)
    c0 = tl.program_id(0) % (D // BD) * BD
    cols = c0 + tl.arange(0, BD)
    # The same columns, declared contiguous in runs of 4 only, for the bank's and the snapshot's
    # rows ([TB, EP, BD] tiles): with runs of 16, Triton gives a bfloat16 or byte access 8 or 16
    # elements a thread, a layout of its own, and converting it to and from the float32 tiles'
    # 4 a thread spills hundreds of bytes a thread.
    rcols = tl.max_contiguous(cols, 4)
    h = p % H
    bank_p = bank + p.to(tl.int64) * S * D
    src_p = source + (p % SRC_PERIOD).to(tl.int64) * S_SRC * D
    first_p = first + p.to(tl.int64) * S
    scratch_p = scratch + p.to(tl.int64) * C * D
    if VARLEN:  # the sequence's chunk slots, and X / QX tiles [1, H, NC, C, C]
        lo = tl.load(seq_chunks + p // H).to(tl.int32)
        hi = tl.load(seq_chunks + p // H + 1).to(tl.int32)
        tiles = h.to(tl.int64) * NC
    else:
        lo = 0
        hi = tl.cdiv(T, C)
        tiles = p.to(tl.int64) * hi
    ci = tl.arange(0, C)
    if TB == C:
        # A chunk's indices and gather weights do not depend on the bank: each chunk loads
        # the next chunk's while its own gathers are in flight, so that a chunk starts with its
        # gathers rather than with a round trip for their addresses. Here the first chunk's.
        if VARLEN:
            ftok0 = tl.load(chunks + 2 * lo, mask=lo < hi, other=0)
            fcount = tl.load(chunks + 2 * lo + 1, mask=lo < hi, other=0).to(tl.int32)
        else:
            ftok0, fcount = dense_chunk(lo, p, T, H, C)
        ftok, ftok_ok = token_rows(ftok0, h, H, fcount, ci)
        fwent, fwm = entry_offsets(ftok, ftok_ok, W, WP)
        frent, frm = entry_offsets(ftok, ftok_ok, R, RP)
        next_w = tl.load(write_idx + fwent, mask=fwm, other=-1).to(tl.int64)
        next_gw = tl.load(gather_w + fwent, mask=fwm, other=0.0)
        next_r = tl.load(read_idx + frent, mask=frm, other=-1).to(tl.int64)
        next_gr = tl.load(gather_r + frent, mask=frm, other=0.0)
        next_ws = next_w
        next_rs = next_r
        if ROWS:
            next_ws = tl.load(write_src + fwent, mask=fwm, other=-1).to(tl.int64)
            next_rs = tl.load(read_src + frent, mask=frm, other=-1).to(tl.int64)
        fs, fok = bank_slots(next_w, fwm, S)
        next_fw = _first_chunks(first_p, fs, fok, SOURCE)
        fs, fok = bank_slots(next_r, frm, S)
        next_fr = _first_chunks(first_p, fs, fok, SOURCE)
    for n in range(lo, hi):
        if VARLEN:
            tok0 = tl.load(chunks + 2 * n)
            count = tl.load(chunks + 2 * n + 1).to(tl.int32)
        else:
            tok0, count = dense_chunk(n, p, T, H, C)
        x_base = (tiles + n) * C * C
        if TB == C:
            # The whole chunk as one tile: gathered rows, u and delta stay in registers from
            # the gathers to the writes.
            tok, tok_ok = token_rows(tok0, h, H, count, ci)
            went, wm = entry_offsets(tok, tok_ok, W, WP)
            s, ok = bank_slots(next_w, wm, S)
            wrow_p = _row_ptr(bank_p, src_p, next_fw, n, s, next_ws.to(tl.int64), D, SOURCE)
            rows, retrieved = _gather(
                wrow_p,
                ok,
                tl.where(ok, next_gw, 0.0),
                rcols,
                not SNAPSHOT,
            )
            rent, rm = entry_offsets(tok, tok_ok, R, RP)
            q, qok = bank_slots(next_r, rm, S)
            qrows, inter = _gather(
                _row_ptr(bank_p, src_p, next_fr, n, q, next_rs.to(tl.int64), D, SOURCE),
                qok,
                tl.where(qok, next_gr, 0.0),
                rcols,
                not SNAPSHOT,
            )
            if VARLEN:
                ntok0 = tl.load(chunks + 2 * n + 2, mask=n + 1 < hi, other=0)
                ncount = tl.load(chunks + 2 * n + 3, mask=n + 1 < hi, other=0).to(tl.int32)
            else:
                ntok0, ncount = dense_chunk(n + 1, p, T, H, C)
            ntok, ntok_ok = token_rows(ntok0, h, H, ncount, ci)
            nwent, nwm = entry_offsets(ntok, ntok_ok, W, WP)
            nrent, nrm = entry_offsets(ntok, ntok_ok, R, RP)
            next_w = tl.load(write_idx + nwent, mask=nwm, other=-1).to(tl.int64)
            next_gw = tl.load(gather_w + nwent, mask=nwm, other=0.0)
            next_r = tl.load(read_idx + nrent, mask=nrm, other=-1).to(tl.int64)
            next_gr = tl.load(gather_r + nrent, mask=nrm, other=0.0)
            next_ws = next_w
            next_rs = next_r
            if ROWS:
                next_ws = tl.load(write_src + nwent, mask=nwm, other=-1).to(tl.int64)
                next_rs = tl.load(read_src + nrent, mask=nrm, other=-1).to(tl.int64)
            rk = tl.load(rank + went, mask=ok, other=-1)
            vv = tl.load(v + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0).to(
                tl.float32
            )
            bb = tl.load(beta + tok, mask=tok_ok, other=0.0).to(tl.float32)
            # A token that writes nothing adds nothing, whatever its value (sdm_ops/_finite.py).
            writes = tl.max(ok.to(tl.int32), 1) > 0
            rr = tl.where(writes[:, None], vv - retrieved, 0.0)
            if SNAPSHOT:
                store_token_rows(
                    snap, snap_scale, tok, rows, wm, qrows, rm, c0, rcols, W, R, WP, RP, D, BD, MODE
                )
                tl.store(res + tok[:, None] * D + cols[None, :], rr, mask=tok_ok[:, None])
            uu = bb[:, None] * rr
            # The products run on the tokens before the first whose update (f_w) or read (f_o)
            # is not finite; delta from f_w on and out from f_o on are NaN (a token that
            # writes or reads nothing has u or inter 0: no mask needed). Without out here,
            # _out_kernel finds f_w and f_o again from the res and inter stored below.
            f_w = first_of(bad_rows(uu), ci, C)
            uu = tl.where(ci[:, None] < f_w, uu, 0.0)
            xo = x_base + ci[:, None] * C + ci[None, :]
            dl = tl.dot(tl.load(X + xo), uu, input_precision="ieee")
            dl = tl.where(ci[:, None] < f_w, dl, float("nan"))
            if OUT_WALK:
                f_o = tl.minimum(f_w, first_of(bad_rows(inter), ci, C))
                o = inter + tl.dot(tl.load(QX + xo), uu, input_precision="ieee")
                o = tl.where(ci[:, None] < f_o, o, float("nan"))
            if SNAPSHOT:
                if OUT_WALK:
                    tl.store(
                        out + tok[:, None] * D + cols[None, :],
                        o.to(out.dtype.element_ty),
                        mask=tok_ok[:, None],
                    )
                else:
                    tl.store(
                        inter_buf + tok[:, None] * D + cols[None, :], inter, mask=tok_ok[:, None]
                    )
                tl.store(delta + tok[:, None] * D + cols[None, :], dl, mask=tok_ok[:, None])
            # The next chunk's first writing chunks, now that its slots have arrived.
            fs, fok = bank_slots(next_w, nwm, S)
            next_fw = _first_chunks(first_p, fs, fok, SOURCE)
            fs, fok = bank_slots(next_r, nrm, S)
            next_fr = _first_chunks(first_p, fs, fok, SOURCE)
            sw = tl.load(scatter_w + went, mask=ok, other=0.0)
            term = sw[:, :, None] * dl[:, None, :]
            ptr = bank_p + s[:, :, None] * D + rcols[None, None, :]
            lead = ok & (rk == 0)
            rd = tl.load(row_decay + went, mask=lead, other=1.0)
            npass = tl.max(tl.max(tl.where(ok, rk + 1, 0), 1), 0)
            tl.debug_barrier()  # every gather of the chunk precedes its first write
            if not SNAPSHOT and OUT_WALK:
                # With at most one program an SM, out in the walk (the second dot costs no
                # occupancy there), stored after the barrier rather than with the dots (about a
                # quarter faster so).
                tl.store(
                    out + tok[:, None] * D + cols[None, :],
                    o.to(out.dtype.element_ty),
                    mask=tok_ok[:, None],
                )
            elif not SNAPSHOT:
                # Else out = inter + QX u is left to _out_kernel, which forms it after the walk
                # from the res and inter stored here (after the barrier, as above): the walk does
                # one dot a chunk, not two, and fits two programs an SM.
                tl.store(res + tok[:, None] * D + cols[None, :], rr, mask=tok_ok[:, None])
                tl.store(inter_buf + tok[:, None] * D + cols[None, :], inter, mask=tok_ok[:, None])
            # With a snapshot and out left to _out_kernel (the walk capped at two programs an
            # SM), the leading entries' rows again (cache hits): holding the gathered rows from
            # the gathers to here would cost about 30 registers a thread.
            if SNAPSHOT and not OUT_WALK:
                rows = tl.load(
                    wrow_p[:, :, None] + rcols[None, None, :], mask=lead[:, :, None], other=0.0
                ).to(tl.float32)
            tl.store(
                ptr, (rd[:, :, None] * rows + term).to(bank.dtype.element_ty), mask=lead[:, :, None]
            )
            for k in range(1, npass):
                tl.debug_barrier()
                mine = ok & (rk == k)
                if bank.dtype.element_ty == tl.float32:
                    tl.atomic_add(ptr, term, mask=mine[:, :, None], sem="relaxed")
                else:
                    cur = tl.load(ptr, mask=mine[:, :, None], other=0.0).to(tl.float32)
                    tl.store(ptr, (cur + term).to(bank.dtype.element_ty), mask=mine[:, :, None])
            tl.debug_barrier()
        else:
            npass = 1
            f_w = C  # the first token whose update is not finite (see the one-tile path)
            f_o = C  # ... or whose read is not
            # (1) Gathers: retrieved, inter, res = v - retrieved, snapshot.
            for tb in range(0, C, TB):
                ii = tb + tl.arange(0, TB)
                tok, tok_ok = token_rows(tok0, h, H, count, ii)  # [TB]
                went, wm = entry_offsets(tok, tok_ok, W, WP)  # [TB, WP]
                s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
                ss = s
                if ROWS:
                    ss = tl.load(write_src + went, mask=ok, other=-1).to(tl.int64)
                rk = tl.load(rank + went, mask=ok, other=0)
                npass = tl.maximum(npass, tl.max(tl.max(tl.where(ok, rk + 1, 0), 1), 0))
                fw = _first_chunks(first_p, s, ok, SOURCE)
                rows, retrieved = _gather(
                    _row_ptr(bank_p, src_p, fw, n, s, ss, D, SOURCE),
                    ok,
                    tl.load(gather_w + went, mask=ok, other=0.0),
                    rcols,
                    False,
                )
                rent, rm = entry_offsets(tok, tok_ok, R, RP)
                q, qok = bank_slots(tl.load(read_idx + rent, mask=rm, other=-1), rm, S)
                qs = q
                if ROWS:
                    qs = tl.load(read_src + rent, mask=qok, other=-1).to(tl.int64)
                fr = _first_chunks(first_p, q, qok, SOURCE)
                qrows, inter = _gather(
                    _row_ptr(bank_p, src_p, fr, n, q, qs, D, SOURCE),
                    qok,
                    tl.load(gather_r + rent, mask=qok, other=0.0),
                    rcols,
                    False,
                )
                if SNAPSHOT:
                    store_token_rows(
                        snap,
                        snap_scale,
                        tok,
                        rows,
                        wm,
                        qrows,
                        rm,
                        c0,
                        rcols,
                        W,
                        R,
                        WP,
                        RP,
                        D,
                        BD,
                        MODE,
                    )
                vv = tl.load(
                    v + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                ).to(tl.float32)
                writes = tl.max(ok.to(tl.int32), 1) > 0
                rr = tl.where(writes[:, None], vv - retrieved, 0.0)
                bb = tl.load(beta + tok, mask=tok_ok, other=0.0).to(tl.float32)
                f_w = tl.minimum(f_w, first_of(bad_rows(bb[:, None] * rr), ii, C))
                f_o = tl.minimum(f_o, first_of(bad_rows(inter), ii, C))
                tl.store(res + tok[:, None] * D + cols[None, :], rr, mask=tok_ok[:, None])
                tl.store(scratch_p + ii[:, None] * D + cols[None, :], inter)
            f_o = tl.minimum(f_o, f_w)
            tl.debug_barrier()
            # (2) Dual matmul: delta = X u, out = inter + QX u, each RB rows of X and QX in
            # slices of KB tokens of u (a float32 dot over all C = 128 tokens at once spills
            # hundreds of bytes a thread). Each block of rows
            # loads u's slices again from res (cache hits): holding u for all of them is what
            # spilled.
            for rb in range(0, C, RB):
                ri = rb + tl.arange(0, RB)
                dl = tl.zeros((RB, BD), dtype=tl.float32)
                qx = tl.zeros((RB, BD), dtype=tl.float32)
                for kb in range(0, C, KB):
                    ki = kb + tl.arange(0, KB)
                    tok_k, ok_k = token_rows(tok0, h, H, count, ki)
                    bk = tl.load(beta + tok_k, mask=ok_k, other=0.0).to(tl.float32)
                    uk = bk[:, None] * tl.load(
                        res + tok_k[:, None] * D + cols[None, :], mask=ok_k[:, None], other=0.0
                    )
                    uk = tl.where(ki[:, None] < f_w, uk, 0.0)
                    xo = x_base + ri[:, None] * C + ki[None, :]
                    dl = tl.dot(tl.load(X + xo), uk, dl, input_precision="ieee")
                    qx = tl.dot(tl.load(QX + xo), uk, qx, input_precision="ieee")
                tok_r, ok_r = token_rows(tok0, h, H, count, ri)
                ok_r = ok_r[:, None]
                dl = tl.where(ri[:, None] < f_w, dl, float("nan"))
                o = qx + tl.load(scratch_p + ri[:, None] * D + cols[None, :])
                o = tl.where(ri[:, None] < f_o, o, float("nan"))
                tl.store(delta + tok_r[:, None] * D + cols[None, :], dl, mask=ok_r)
                tl.store(
                    out + tok_r[:, None] * D + cols[None, :], o.to(out.dtype.element_ty), mask=ok_r
                )
            tl.debug_barrier()
            # (3) Decay and write, pass by pass over the entries' rank within their slot.
            for k in range(0, npass):
                for tb in range(0, C, TB):
                    ii = tb + tl.arange(0, TB)
                    tok, tok_ok = token_rows(tok0, h, H, count, ii)
                    went, wm = entry_offsets(tok, tok_ok, W, WP)
                    s, ok = bank_slots(tl.load(write_idx + went, mask=wm, other=-1), wm, S)
                    rk = tl.load(rank + went, mask=ok, other=-1)
                    mine = ok & (rk == k)
                    sw = tl.load(scatter_w + went, mask=mine, other=0.0)
                    dl = tl.load(
                        delta + tok[:, None] * D + cols[None, :], mask=tok_ok[:, None], other=0.0
                    )
                    ptr = bank_p + s[:, :, None] * D + rcols[None, None, :]
                    # A row's first write (k = 0) reads it where the gathers did.
                    fw = _first_chunks(first_p, s, mine & (k == 0), SOURCE)
                    ss = s
                    if ROWS:
                        ss = tl.load(write_src + went, mask=mine, other=-1).to(tl.int64)
                    src = _row_ptr(bank_p, src_p, tl.where(k == 0, fw, -1), n, s, ss, D, SOURCE)
                    rows = tl.load(
                        src[:, :, None] + rcols[None, None, :],
                        mask=mine[:, :, None],
                        other=0.0,
                    ).to(tl.float32)
                    term = sw[:, :, None] * dl[:, None, :]
                    if k == 0:
                        rd = tl.load(row_decay + went, mask=mine, other=1.0)
                        new = rd[:, :, None] * rows + term
                    else:
                        new = rows + term
                    tl.store(ptr, new.to(bank.dtype.element_ty), mask=mine[:, :, None])
                tl.debug_barrier()


# The walk capped at ONE_WAVE_REGS registers a thread (ptxas' maxnreg), 8 warps as the uncapped
# one: a one-config autotuner, the form in which torch.compile carries a launch's maxnreg
# into the code it generates.
_capped_walk = triton.autotune(
    configs=[triton.Config({}, num_warps=_NUM_WARPS, maxnreg=ONE_WAVE_REGS)], key=[]
)(_recurrence_fwd_kernel)


def recurrence_fwd_geometry(W: int, R: int, C: int) -> tuple[int, int, int]:
    """(WP, RP, TB): padded entry counts and tokens per gather tile."""
    wp = triton.next_power_of_2(max(W, 1))
    rp = triton.next_power_of_2(max(R, 1))
    tb = max(1, min(C, _TILE // (max(wp, rp) * BLOCK_D)))
    return wp, rp, tb


def _one_program_an_sm(streams: int, D: int, device: torch.device) -> bool:
    """Whether the walk's ``streams * D / BLOCK_D`` programs are no more than the SMs (those
    ``_WALK_SMS`` assumes), so that each has an SM to itself whatever its registers."""
    sms = sm_count(device) if _WALK_SMS is None else _WALK_SMS
    return streams * (D // BLOCK_D) <= sms


def walk_forms_out(streams: int, D: int, bank_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the one-tile walk without a snapshot forms out itself: with a float32 bank where
    its ``streams * D / BLOCK_D`` programs are no more than the SMs (one program an SM at most,
    as at B = 1 or 2, H = 8), rather than leaving out to ``_out_kernel`` so that the walk fits
    two programs an SM (the reference shape's 256 programs on 132 SMs). On an H200 the walk's
    out is 5-9% faster with a float32 bank at B = 1 and 2 and 4-9% slower with a bfloat16
    one."""
    return bank_dtype == torch.float32 and _one_program_an_sm(streams, D, device)


def walk_capped(
    streams: int,
    D: int,
    snapshot: str | None,
    source: bool,
    bank_dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether the one-tile walk runs capped at ``ONE_WAVE_REGS`` registers a thread
    (``_capped_walk``): where its ``streams * D / BLOCK_D`` programs outnumber the SMs (the
    reference shape's 256 on 132), so that two programs share an SM and all of them run in one
    wave instead of two. Only the walks from a ``source`` bank (the functional forwards): the
    in-place walk fits 128 registers uncapped. Not with a snapshot over a float32 bank: under
    the cap that walk spills 48 to 220 bytes a thread (Triton 3.6) and ran 52% slower on an
    H100; it keeps its full registers and forms out itself. The capped walk with a snapshot
    leaves out to
    ``_out_kernel``, as the walks without one do: its second dot is what the cap cannot hold.
    On an H100 at the reference shape the cap made the forward without grad 13% (float32
    bank) and 10% (bfloat16 bank) faster, and the training forward over a bfloat16 bank 7%."""
    if _one_program_an_sm(streams, D, device) or not source:
        return False
    return snapshot is None or bank_dtype != torch.float32


def recurrence_fwd(
    v,
    beta,
    write_idx,
    read_idx,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    X,
    QX,
    bank,
    out,
    res,
    delta,
    snap,
    snap_scale,
    snapshot: str | None,
    chunks=None,
    seq_chunks=None,
    source=None,
    first=None,
    write_src=None,
    read_src=None,
) -> None:
    """Launch phase 2 over every chunk; ``bank`` is updated in place. ``snapshot`` None skips
    the snapshot (in-place inference), and then ``res`` and ``delta`` may be None: they are
    allocated here only if the chunks go in tiles (as scratch). With a ``source`` bank
    ([B, H, S, D] or shared) and its ``first`` table (``bank_copy.first_writes``), the state
    starts from ``source``: ``bank`` is read only where an earlier chunk has written it. With
    ``write_src`` and ``read_src`` (the entries' slots in ``source``), ``bank`` is a working
    set of rows ``[P, U, D]`` and ``write_idx`` / ``read_idx`` hold the entries' rows in it
    (``working_set.py``). See the module docstring for the other operands."""
    B, T, H, D = v.shape
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    C = X.shape[-1]
    S = bank.shape[-2]
    streams = bank.shape[0] * H  # B * H, or N * H for a packed batch
    if streams * T == 0:
        return
    wp, rp, tb = recurrence_fwd_geometry(W, R, C)
    # The one-tile path keeps a chunk in registers and touches neither the scratch nor, without
    # a snapshot, delta (one-element stand-ins then). Without a snapshot it forms out itself
    # where the walk has at most one program an SM and the bank is float32; with one, where it
    # is not capped; else it stores res and inter for _out_kernel.
    tiled = tb < C
    capped = not tiled and walk_capped(
        streams, D, snapshot, source is not None, bank.dtype, v.device
    )
    if snapshot is None:
        out_walk = not tiled and walk_forms_out(streams, D, bank.dtype, v.device)
    else:
        out_walk = not tiled and not capped
    out_after = not tiled and not out_walk
    f32 = dict(dtype=torch.float32, device=v.device)
    scratch = torch.empty((streams, C, D) if tiled else (1,), **f32)
    if res is None:
        res = torch.empty(v.shape if tiled or out_after else (1,), **f32)
    inter = torch.empty(v.shape if out_after else (1,), **f32)
    if delta is None:
        delta = torch.empty(v.shape if tiled else (1,), **f32)
    mode = SNAP_CODES["none" if snapshot is None else snapshot]
    varlen = chunks is not None
    wrap_triton(_capped_walk if capped else _recurrence_fwd_kernel)[(streams * (D // BLOCK_D),)](
        v,
        beta,
        write_idx,
        read_idx,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        X,
        QX,
        bank,
        out,
        res,
        delta,
        scratch,
        bank if snapshot is None else snap,
        gather_w if snapshot is None else snap_scale,
        chunks if varlen else rank,
        seq_chunks if varlen else rank,
        bank if source is None else source,
        rank if first is None else first,
        write_idx if write_src is None else write_src,
        read_idx if read_src is None else read_src,
        inter,
        T,
        H,
        S,
        S if source is None else source.shape[-2],
        X.shape[2],
        H if source is not None and source.dim() == 3 else streams,
        D=D,
        W=W,
        R=R,
        WP=wp,
        RP=rp,
        C=C,
        TB=tb,
        BD=BLOCK_D,
        RB=min(C, _ROWS),
        KB=min(C, _ROWS),
        MODE=mode,
        SNAPSHOT=snapshot is not None,
        VARLEN=varlen,
        SOURCE=source is not None,
        ROWS=write_src is not None,
        OUT_WALK=out_walk,
        **({} if capped else dict(num_warps=_NUM_WARPS)),
    )
    if out_after:
        N, P = chunk_grid(B, T, H, C, chunks)
        # All of out's columns in one step up to 64 of them (the reference shape's, as timed),
        # else steps of half the tile, unpipelined. Compiled for sm_90a by Triton 3.7 without
        # the launcher's divisibility hints, no chunk size and D then spills but the reference
        # shape (120 bytes; as launched 171 registers and none, on the H200's Triton 3.6 too),
        # where the default software pipelining of the steps spilled up to 752 bytes.
        bk = D if D <= 64 and C * D <= _OUT_TILE else min(D, _OUT_TILE // 2 // C)
        wrap_triton(_out_kernel)[(N, P)](
            QX,
            beta,
            res,
            inter,
            out,
            chunks if varlen else rank,
            T,
            H,
            D=D,
            C=C,
            BK=bk,
            VARLEN=varlen,
            num_warps=_OUT_WARPS * max(1, C // 64),
            num_stages=1,
        )
