"""The pairs kernels of phase 1's sparse path (``chunk_prepare_sparse``), forward and
backward: everything of a chunk's shared entries, the ones the sort kernel listed because they
share a slot hash bucket with another entry of the chunk (``chunk_prepare`` gives the math,
the operands and their layouts).

The pairs kernels (``_chunk_pairs_kernel``, and its backward twin) form everything of the
compact list's entries with [MC, MC] tiles, comparing their real slots (two slots may share a
hash). Entries pair only inside a bucket, so the list is taken in windows of at most MC
entries that end where a bucket does (a chunk of a small bank or of addressing that favours
some slots has hundreds of shared entries in many small buckets); A and QK sum the windows'
terms in window order. One slot's entries appear in position order; with D_x the product of
a token's decays on the slot, carried by the token's first write entry x (1 on every other
entry),

  Gamma[a, b] = prod_{b < x <= a, same slot} D_x      (a cumulative product down columns)
  gather_w[a] = w_a prod_{x <= a} D_x     scatter_w[a] = w_a prod_{x > a} D_x   (same slot)
  A[tok_a, tok_b] += w_a w_b Gamma[a, b]  for write entries b < a of different tokens,
  QK[tok_a, tok_b] += w_a w_b Gamma[a, b] for a read entry a and a write entry b < a,

the last two as dots with token-match matrices, so each element of A and QK is one fixed sum.
A chunk whose list is one window (most) sums the terms in [MC, MC] over the entries of a's
token and side and of b's token, and the first entry of each stores the element, after the
tile's zeros: no [C, C] tile is held (80 registers a thread at 8 warps, three programs an SM,
where the [C, C] accumulators took 214 at 4 warps, two programs an SM). A chunk of several
windows accumulates [C, C] tiles across them by one-hot dots. Products are still formed by
multiplication only. Chunks go in two tiers by their shared entries (``pairs_launch``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton

from ._common import strided_grid
from ._tiles import dense_chunk, entry_position, slot_bucket

_PAIRS_WARPS = 4  # the backward's one-window tier, below chunk 128
# The chunks whose counts a windowed-tier program loads at once, as independent scalar loads
# (the dense kernels load one at a time: a vector walk made their backward 8x slower when every
# chunk is heavy).
_WALK = 16


def pairs_launch(backward: bool, common, shared, compact, T, H, bank_rows, N, P, sizes, device):
    """Launch the pairs kernels (``_chunk_pairs_kernel``, or its backward twin) over every
    chunk, after the sort kernel wrote ``shared`` (entries per chunk, -1 for a heavy chunk) and
    the ``compact`` lists; ``common`` are the tensors of phase 1 (or of its backward) as the
    sort kernel takes them, ``sizes`` its constexprs (``chunk_prepare_sparse.sparse_launch``)."""
    if backward:
        pairs = wrap_triton(_chunk_pairs_bwd_kernel)
    else:
        pairs = wrap_triton(_chunk_pairs_kernel)
    mc, np_, C = sizes["MC"], sizes["NP"], sizes["C"]
    # Tiers by shared entries (LO < m <= HI): most chunks have at most MC and take one window,
    # straight code; the rest take a loop over windows (more registers: ptxas spills when its
    # windows are 64 entries, hence MC = 32), a grid of at most STRIDED_PROGRAMS_PER_SM
    # programs an SM. The backward's one-window chunks go in two tiers of their own, of
    # windows of MH = max(16, MC / 2) entries and of MC: a launch compiles to the registers of
    # its largest window (at chunk 64, ptxas of Triton 3.6: 80 registers a thread at 4 warps
    # for 16 entries, six programs an SM, against 198 for 32, two), and the kernel waits on
    # its loads' latency, so the more programs an SM the better; at the reference workload 59%
    # of the chunks have at most 16 shared entries. The forward holds A and QK ([C, C] each)
    # across the loop: 8 warps hold them with 200 bytes a thread spilled at chunk 64, where 4
    # spilled 680 bytes (chunk 64) and 43 KB (chunk 128); a chunk of 128 takes 8 warps in every
    # tier. The forward's one-window tier, which holds no [C, C] tile, takes 8 warps too (80
    # registers; 142 at 4; 152 for windows of 16): on an H100 at the reference workload
    # 0.127 ms against 0.133.
    mh = max(16, mc // 2)
    if backward and mh < mc:
        tiers = [(-1, mh, mh), (mh, mc, mc)]
    else:
        tiers = [(-1, mc, mc)]
    if np_ > mc:
        tiers.append((mc, np_, mc))
    for lo, hi, window in tiers:
        grid = (N, P) if hi <= mc else strided_grid(N, P, device)
        warps = 8 if C >= 128 or hi > mc or not backward else _PAIRS_WARPS
        pairs[grid](
            *common,
            shared,
            compact,
            T,
            H,
            bank_rows,
            N,
            P,
            **dict(sizes, MC=window),
            LO=lo,
            HI=hi,
            WALK=_WALK,
            num_warps=warps,
        )


@triton.jit
def _tier_steps(shared_count, k0, N, P, LO: tl.constexpr, HI: tl.constexpr, WALK: tl.constexpr):
    """Which of steps k0 .. k0 + WALK - 1 of this program's walk (every G-th chunk from its
    own, G the grid's width) are chunks of its tier (LO < count <= HI), as the bits of an
    int32: WALK scalar loads of their counts side by side (a vector and its reduction across
    warps made ptxas spill). The bits steer the walk but make no address, so
    the loads may sit in a helper (see _tiles.bank_slots)."""
    bits = 0
    for i in tl.static_range(WALK):
        c = tl.program_id(0) + (k0 + i) * tl.num_programs(0)
        m = tl.load(shared_count + c, mask=c < N * P, other=LO)
        bits |= ((m > LO) & (m <= HI)).to(tl.int32) << i
    return bits


@triton.jit
def _rowprod_scan(x, N: tl.constexpr):
    """Products along the rows of x [M, N]: the last column of a cumulative product (a scan
    compiles quickly where a tree of reshapes does not, at [64, 64])."""
    return tl.sum(tl.where(tl.arange(0, N)[None, :] == N - 1, tl.cumprod(x, 1), 0.0), 1)


@triton.jit
def _runs(slot, tok, is_read, ok, d, MC: tl.constexpr):
    """The compact list's structure (``ok`` marks its m entries; a indexes rows, b columns):
    (same slot, b < a, same token's write group, D per entry (the group's decay product on its
    first write entry, 1 elsewhere), the group's first entries, Gamma[a, b] = prod over
    b < x <= a on the slot of D_x)."""
    a = tl.arange(0, MC)
    same = (slot[:, None] == slot[None, :]) & ok[:, None] & ok[None, :]
    lower = a[None, :] < a[:, None]
    group = same & (tok[:, None] == tok[None, :]) & (~is_read[:, None]) & (~is_read[None, :])
    first = ok & (~is_read) & (tl.sum((group & lower).to(tl.int32), 1) == 0)
    dg = tl.where(first, _rowprod_scan(tl.where(group, d[None, :], 1.0), MC), 1.0)
    gam = tl.cumprod(tl.where(same & (a[:, None] > a[None, :]), dg[:, None], 1.0), 0)
    return same, lower, group, dg, first, gam


@triton.jit
def _pairs(same, lower, tok, is_read):
    """Which (a, b) meet in A or QK: b a write entry before a on the slot, and a a read entry
    or a write entry of a later token."""
    return same & lower & (~is_read[None, :]) & (is_read[:, None] | (tok[:, None] > tok[None, :]))


# Inductor finds what a user kernel writes by following each store's address back through
# the kernel's IR, stopping at loads, but not at the results of a helper's call: an address
# made from what a helper loaded makes the tensors it loaded from look written. So every index
# below is loaded in the function that stores through it, and the helpers that return offsets
# only compute; _window_at loads, but the window size it returns reaches masks and load
# addresses only (tests/test_kernels_compile_sm90.py checks what each kernel is seen to write).


@triton.jit
def _entry_offsets(pos, tok0, h, H, W: tl.constexpr, R: tl.constexpr, EM: tl.constexpr):
    """(tok, is_read, j, wo, ro) of entry positions: chunk token, side, entry number, and the
    entry's offsets in [B, T, H, W] and [B, T, H, R] tensors."""
    tok, is_read, j = entry_position(pos, EM)
    row = (tok0 + tok) * H + h
    return tok, is_read, j, row * W + j, row * R + j


@triton.jit
def _window_size(slot, slot_after, more, size, KB: tl.constexpr, MC: tl.constexpr):
    """Entries in the window of a chunk's compact list that starts at entry s (which starts a
    bucket): ``size`` = min(MC, entries left), or, when the entry after the window (``more``:
    there is one; its slot ``slot_after``) is in the bucket of the window's last entry, the
    entries before that bucket, which a later window holds whole (no bucket of a chunk that is
    not heavy exceeds MC entries). ``slot`` [MC]: the window's slots."""
    HB: tl.constexpr = 30 - KB
    a = tl.arange(0, MC)
    bucket = slot_bucket(slot.to(tl.int64), HB)
    last = tl.sum(tl.where(a == MC - 1, bucket, 0), 0)
    starts = (a > 0) & (bucket != tl.gather(bucket, tl.maximum(a - 1, 0), 0))
    cut = tl.max(tl.where(starts, a, 0), 0)
    return tl.where(more & (slot_bucket(slot_after.to(tl.int64), HB) == last), cut, size)


@triton.jit
def _window_at(
    read_idx,
    write_idx,
    base,
    s,
    m,
    tok0,
    h,
    H,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
):
    """``_window_size`` of the window from entry s of a chunk's compact list of m entries
    (``base``: the list), its slots loaded here."""
    a = tl.arange(0, MC)
    inside = s + a < m
    more = s + MC < m
    _, is_read, _, wo, ro = _entry_offsets(
        tl.load(base + s + a, mask=inside, other=0), tok0, h, H, W, R, EM
    )
    _, is_read_n, _, wo_n, ro_n = _entry_offsets(
        tl.load(base + s + MC, mask=more, other=0), tok0, h, H, W, R, EM
    )
    slot = tl.where(
        is_read,
        tl.load(read_idx + ro, mask=inside & is_read, other=-1),
        tl.load(write_idx + wo, mask=inside & ~is_read, other=-1),
    )
    slot_n = tl.where(
        is_read_n,
        tl.load(read_idx + ro_n, mask=more & is_read_n, other=-1),
        tl.load(write_idx + wo_n, mask=more & ~is_read_n, other=-1),
    )
    return _window_size(slot, slot_n, more, tl.minimum(m - s, MC), KB, MC)


@triton.jit
def _weights(write_w, decay, read_w, wo, ro, ok_w, ok_r, MC: tl.constexpr, HAS_DECAY: tl.constexpr):
    """(w, d) of a window's entries: the write or read weight, and a write entry's decay."""
    w = tl.where(
        ok_r,
        tl.load(read_w + ro, mask=ok_r, other=0.0).to(tl.float32),
        tl.load(write_w + wo, mask=ok_w, other=0.0).to(tl.float32),
    )
    if HAS_DECAY:
        d = tl.load(decay + wo, mask=ok_w, other=1.0).to(tl.float32)
    else:
        d = tl.full((MC,), 1.0, tl.float32)
    return w, d


@triton.jit
def _tile(chunk, C: tl.constexpr):
    """The offsets of chunk ``chunk``'s [C, C] tile of A or QK."""
    cols = tl.arange(0, C)
    return chunk.to(tl.int64) * C * C + cols[:, None] * C + cols[None, :]


@triton.jit
def _pairs_window(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    gather_w,
    gather_r,
    scatter_w,
    row_decay,
    rank,
    read_rank,
    A,
    QK,
    compact,
    chunk,
    s,
    size,
    tok0,
    h,
    H,
    a_acc,
    q_acc,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    MC: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    SCATTER: tl.constexpr,
):
    """The window of ``size`` entries of the compact list from entry s (``_window_size``): stores
    its entries' weights, decays and ranks; returns A and QK ([C, C] each) with its terms added
    to ``a_acc`` and ``q_acc``, or with SCATTER (the chunk's only window) stores the chunk's A
    and QK tiles itself and returns the accumulators as they came."""
    a = tl.arange(0, MC)
    ok = a < size
    pos = tl.load(compact + chunk.to(tl.int64) * NP + s + a, mask=ok, other=0)
    tok, is_read, j, wo, ro = _entry_offsets(pos, tok0, h, H, W, R, EM)
    slot = tl.where(
        is_read,
        tl.load(read_idx + ro, mask=ok & is_read, other=-1).to(tl.int64),
        tl.load(write_idx + wo, mask=ok & ~is_read, other=-1).to(tl.int64),
    )
    ok_w = ok & ~is_read
    ok_r = ok & is_read
    w, d = _weights(write_w, decay, read_w, wo, ro, ok_w, ok_r, MC, HAS_DECAY)
    same, lower, group, dg, first, gam = _runs(slot, tok, is_read, ok, d, MC)
    pincl = _rowprod_scan(tl.where(same & (a[None, :] <= a[:, None]), dg[None, :], 1.0), MC)
    sexcl = _rowprod_scan(tl.where(same & (a[None, :] > a[:, None]), dg[None, :], 1.0), MC)
    place = tl.sum((same & lower & (is_read[:, None] == is_read[None, :])).to(tl.int32), 1)
    tl.store(gather_w + wo, w * pincl, mask=ok_w)
    tl.store(scatter_w + wo, w * sexcl, mask=ok_w)
    tl.store(row_decay + wo, pincl * sexcl, mask=ok_w)
    tl.store(rank + wo, place, mask=ok_w)
    tl.store(gather_r + ro, w * pincl, mask=ok_r)
    tl.store(read_rank + ro, place, mask=ok_r)

    # A and QK: the pairs' terms summed per (token, token) by one-hot dots.
    pm = tl.where(_pairs(same, lower, tok, is_read), w[:, None] * w[None, :] * gam, 0.0)
    if SCATTER:
        # In [MC, MC]: the terms summed over the entries of b's token (write entries), then
        # over those of a's token and side, stored by the first entry of each: one store per
        # (token, token) element, after the tile's zeros. No [C, C] accumulators: registers
        # for more programs an SM.
        same_tok = tok[:, None] == tok[None, :]
        tw = same_tok & ok_w[:, None] & ok_w[None, :]
        by_tok = tl.dot(pm, tw.to(tl.float32), input_precision="ieee")
        side = same_tok & (is_read[:, None] == is_read[None, :]) & ok[:, None] & ok[None, :]
        g = tl.dot(side.to(tl.float32), by_tok, input_precision="ieee")
        head = ok & (tl.sum((side & lower).to(tl.int32), 1) == 0)  # first of its token and side
        at = chunk.to(tl.int64) * C * C + tok[:, None] * C + tok[None, :]
        put = head[:, None] & (head & ok_w)[None, :]
        tile = _tile(chunk, C)
        tl.store(A + tile, tl.zeros((C, C), tl.float32))
        tl.store(QK + tile, tl.zeros((C, C), tl.float32))
        tl.debug_barrier()  # the zeros before the elements the window holds
        tl.store(A + at, g, mask=put & ~is_read[:, None])
        tl.store(QK + at, g, mask=put & is_read[:, None])
    else:
        cols = tl.arange(0, C)
        at = (tok[:, None] == cols[None, :]) & ok[:, None]  # [MC, C]
        by_col = tl.dot(pm, at.to(tl.float32), input_precision="ieee")  # [MC, C]
        a_acc = tl.dot(
            tl.trans((at & ~is_read[:, None]).to(tl.float32)), by_col, a_acc, input_precision="ieee"
        )
        q_acc = tl.dot(
            tl.trans((at & is_read[:, None]).to(tl.float32)), by_col, q_acc, input_precision="ieee"
        )
    return a_acc, q_acc


@triton.jit
def _pairs_chunk(
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
    compact,
    chunk,
    T,
    H,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Chunk ``chunk`` of the pairs kernel, if it is its tier's (LO < shared entries <= HI)."""
    m = tl.load(shared_count + chunk, mask=chunk < N * P, other=LO)
    if (m > LO) & (m <= HI):  # not past the last chunk, nor another tier's, nor heavy (-1)
        n = chunk % N
        h = (chunk // N) % H
        if VARLEN:  # loaded here: see _tiles.bank_slots
            tok0 = tl.load(chunks + 2 * n)
        else:
            tok0, _ = dense_chunk(n, chunk // N, T, H, C)
        operands = (
            write_idx,
            write_w,
            decay,
            read_idx,
            read_w,
            gather_w,
            gather_r,
            scatter_w,
            row_decay,
            rank,
            read_rank,
            A,
            QK,
            compact,
            chunk,
        )
        if HI <= MC:  # one window, which stores the tiles (a second window size spills here)
            zero = tl.zeros((1, 1), tl.float32)
            _pairs_window(
                *operands, 0, m, tok0, h, H, zero, zero, W, R, EM, NP, MC, C, HAS_DECAY, True
            )
        else:  # windows in list order, their terms summed into A and QK in that order
            a_acc = tl.zeros((C, C), tl.float32)
            q_acc = tl.zeros((C, C), tl.float32)
            base = compact + chunk.to(tl.int64) * NP
            s = 0
            while s < m:
                size = _window_at(read_idx, write_idx, base, s, m, tok0, h, H, W, R, EM, KB, MC)
                a_acc, q_acc = _pairs_window(
                    *operands,
                    s,
                    size,
                    tok0,
                    h,
                    H,
                    a_acc,
                    q_acc,
                    W,
                    R,
                    EM,
                    NP,
                    MC,
                    C,
                    HAS_DECAY,
                    False,
                )
                s += tl.maximum(size, 1)
            tile = _tile(chunk, C)
            tl.store(A + tile, a_acc)
            tl.store(QK + tile, q_acc)


@triton.jit
def _chunk_pairs_kernel(
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
    compact,
    T,
    H,
    S,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
    WALK: tl.constexpr,
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
        shared_count,
        compact,
    )
    dims = (T, H, N, P)
    if HI <= MC:  # the one-window tier: grid (N, P), one program a chunk
        chunk = tl.program_id(1) * N + tl.program_id(0)
        _pairs_chunk(*args, chunk, *dims, W, R, EM, NP, KB, MC, LO, HI, C, HAS_DECAY, VARLEN)
    else:  # the windowed tier, for the rare chunks of more than MC: see strided_grid
        g = tl.num_programs(0)
        for k0 in range(0, tl.cdiv(N * P, g), WALK):
            bits = _tier_steps(shared_count, k0, N, P, LO, HI, WALK)
            if bits != 0:
                for j in range(WALK):
                    if ((bits >> j) & 1) != 0:
                        chunk = tl.program_id(0) + (k0 + j) * g
                        _pairs_chunk(
                            *args, chunk, *dims, W, R, EM, NP, KB, MC, LO, HI, C, HAS_DECAY, VARLEN
                        )


# The pairs' backward, in the compact list's terms (x, a, c on one slot; c a write group's first
# entry, whose D_c every product above is split around; Gx[c, b] = Gamma[c-1, b] is the product
# over b < x < c; y = dgw w or dgr w, z = dsw w, g = dA or dQK at the pair):
#
#   dw_a = dgw_a P_a + dsw_a S_a (write) or dgr_a P_a (read)
#          + sum_b g[a,b] Gamma[a,b] w_b + sum_a' g[a',a] Gamma[a',a] w_a'     (pairs)
#   dD_c = Pexcl_c sum_{x >= c} y_x Gamma[x,c] + S_c sum_{b < c} z_b Gx[c,b]
#          + Pexcl_c S_c sum_slot drd + sum_{a >= c} Gamma[a,c] (G Gx^T)[a,c],
#          G[a,b] = g[a,b] w_a w_b on pairs,
#   d_decay_e = dD_(e's group) * prod of the group's other decays,
#
# with P (inclusive), Pexcl and S (exclusive) the products of D before / after an entry on its
# slot.


@triton.jit
def _pairs_bwd_window(
    write_idx,
    write_w,
    decay,
    read_idx,
    read_w,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    d_write_w,
    d_decay,
    d_read_w,
    compact,
    chunk,
    s,
    size,
    tok0,
    h,
    H,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    MC: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
):
    """The window of ``size`` entries of the compact list from entry s (``_window_size``) in
    the pairs' backward: stores its entries' gradients."""
    a = tl.arange(0, MC)
    ok = a < size
    pos = tl.load(compact + chunk.to(tl.int64) * NP + s + a, mask=ok, other=0)
    tok, is_read, j, wo, ro = _entry_offsets(pos, tok0, h, H, W, R, EM)
    slot = tl.where(
        is_read,
        tl.load(read_idx + ro, mask=ok & is_read, other=-1).to(tl.int64),
        tl.load(write_idx + wo, mask=ok & ~is_read, other=-1).to(tl.int64),
    )
    ok_w = ok & ~is_read
    ok_r = ok & is_read
    w, d = _weights(write_w, decay, read_w, wo, ro, ok_w, ok_r, MC, HAS_DECAY)
    dgw = tl.load(d_gather_w + wo, mask=ok_w, other=0.0).to(tl.float32)
    dsw = tl.load(d_scatter_w + wo, mask=ok_w, other=0.0).to(tl.float32)
    drd = tl.load(d_row_decay + wo, mask=ok_w, other=0.0).to(tl.float32)
    dgr = tl.load(d_gather_r + ro, mask=ok_r, other=0.0).to(tl.float32)
    same, lower, group, dg, first, gam = _runs(slot, tok, is_read, ok, d, MC)
    pair = _pairs(same, lower, tok, is_read)
    at = chunk.to(tl.int64) * C * C + tok[:, None] * C + tok[None, :]
    g = tl.where(
        is_read[:, None],
        tl.load(dQK + at, mask=pair & is_read[:, None], other=0.0),
        tl.load(dA + at, mask=pair & ~is_read[:, None], other=0.0),
    )
    dw, dd = _pair_grads(
        same, lower, group, dg, first, gam, pair, g, w, d, is_read, dgw, dsw, drd, dgr, MC
    )
    tl.store(d_write_w + wo, dw, mask=ok_w)
    if HAS_DECAY:
        tl.store(d_decay + wo, dd, mask=ok_w)
    tl.store(d_read_w + ro, dw, mask=ok_r)


@triton.jit
def _pairs_bwd_chunk(
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
    compact,
    chunk,
    T,
    H,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Chunk ``chunk`` of the pairs' backward kernel, if it is its tier's."""
    m = tl.load(shared_count + chunk, mask=chunk < N * P, other=LO)
    if (m > LO) & (m <= HI):
        n = chunk % N
        h = (chunk // N) % H
        if VARLEN:  # loaded here: see _tiles.bank_slots
            tok0 = tl.load(chunks + 2 * n)
        else:
            tok0, _ = dense_chunk(n, chunk // N, T, H, C)
        operands = (
            write_idx,
            write_w,
            decay,
            read_idx,
            read_w,
            dA,
            dQK,
            d_gather_w,
            d_gather_r,
            d_scatter_w,
            d_row_decay,
            d_write_w,
            d_decay,
            d_read_w,
            compact,
            chunk,
        )
        if HI <= MC:  # one window (the launch's MC is its tier's window)
            _pairs_bwd_window(*operands, 0, m, tok0, h, H, W, R, EM, NP, MC, C, HAS_DECAY)
        else:  # the forward's windows (see _pairs_chunk)
            base = compact + chunk.to(tl.int64) * NP
            s = 0
            while s < m:
                size = _window_at(read_idx, write_idx, base, s, m, tok0, h, H, W, R, EM, KB, MC)
                _pairs_bwd_window(*operands, s, size, tok0, h, H, W, R, EM, NP, MC, C, HAS_DECAY)
                s += tl.maximum(size, 1)


@triton.jit
def _chunk_pairs_bwd_kernel(
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
    compact,
    T,
    H,
    S,
    N,
    P,
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
    WALK: tl.constexpr,
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
        shared_count,
        compact,
    )
    dims = (T, H, N, P)
    if HI <= MC:  # the tiers' grids: see _chunk_pairs_kernel
        chunk = tl.program_id(1) * N + tl.program_id(0)
        _pairs_bwd_chunk(*args, chunk, *dims, W, R, EM, NP, KB, MC, LO, HI, C, HAS_DECAY, VARLEN)
    else:
        g = tl.num_programs(0)
        for k0 in range(0, tl.cdiv(N * P, g), WALK):
            bits = _tier_steps(shared_count, k0, N, P, LO, HI, WALK)
            if bits != 0:
                for j in range(WALK):
                    if ((bits >> j) & 1) != 0:
                        chunk = tl.program_id(0) + (k0 + j) * g
                        _pairs_bwd_chunk(
                            *args,
                            chunk,
                            *dims,
                            W,
                            R,
                            EM,
                            NP,
                            KB,
                            MC,
                            LO,
                            HI,
                            C,
                            HAS_DECAY,
                            VARLEN,
                        )


@triton.jit
def _pair_grads(
    same, lower, group, dg, first, gam, pair, g, w, d, is_read, dgw, dsw, drd, dgr, MC: tl.constexpr
):
    """(dw, d_decay) of the compact list's entries; see the formulas above."""
    a = tl.arange(0, MC)
    upto = same & (a[None, :] <= a[:, None])
    pincl = _rowprod_scan(tl.where(upto, dg[None, :], 1.0), MC)
    pexcl = _rowprod_scan(tl.where(same & lower, dg[None, :], 1.0), MC)
    sexcl = _rowprod_scan(tl.where(same & (a[None, :] > a[:, None]), dg[None, :], 1.0), MC)
    hm = tl.where(pair, g * gam, 0.0)
    dw = tl.where(is_read, dgr * pincl, dgw * pincl + dsw * sexcl)
    dw += tl.sum(hm * w[None, :], 1) + tl.sum(hm * w[:, None], 0)
    # Gx[c, b] = Gamma[c - 1, b] (b < c): the rows of Gamma moved down by one.
    gx = tl.gather(gam, tl.maximum(a - 1, 0)[:, None] + 0 * a[None, :], 0)
    gx = tl.where(same & lower, gx, 0.0)
    y = tl.where(is_read, dgr, dgw) * w
    z = tl.where(is_read, 0.0, dsw * w)
    on_slot = tl.sum(tl.where(same & ~is_read[None, :], drd[None, :], 0.0), 1)
    # upto[x, c] is x >= c on the slot: sums down the columns run over x (or a) >= c.
    t_gather = tl.sum(tl.where(upto, y[:, None] * gam, 0.0), 0)
    t_scatter = tl.sum(z[None, :] * gx, 1)
    q = tl.where(pair, g * w[:, None] * w[None, :], 0.0)
    nm = tl.dot(q, tl.trans(gx), input_precision="ieee")  # [a, c]
    t_pairs = tl.sum(tl.where(upto, gam * nm, 0.0), 0)
    dd = pexcl * t_gather + sexcl * t_scatter + on_slot * pexcl * sexcl + t_pairs
    group_dd = tl.sum(tl.where(group & first[None, :], dd[None, :], 0.0), 1)
    others = _rowprod_scan(tl.where(group & (a[None, :] != a[:, None]), d[None, :], 1.0), MC)
    return dw, group_dd * others
