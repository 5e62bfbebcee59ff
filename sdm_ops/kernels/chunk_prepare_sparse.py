"""The sparse path of phase 1 (``chunk_prepare``, forward and backward): only entries that
share a slot meet. The dense kernels and the launchers that run both paths are in
``chunk_prepare``, whose docstring gives the math, the operands and their layouts.

Every term of phase 1 and of its backward pairs two entries of a chunk on the same slot, and
in a large bank few entries share one (at S = 65536, about 1.5% of a chunk's 1024 entries).
The sparse path runs two kernels per chunk before the dense kernels (launched with SPARSE),
which then do only the chunks it leaves them.

1. Sort (``_chunk_sort_kernel``, here): an entry's position
   p = tok * 2 EM + side * EM + j (side 0 for write entries, 1 for read entries,
   EM = max(WP, RP)) puts a token's write entries before its reads and tokens in order. The
   chunk's NP entries are sorted by (hash of the slot, p) as int32 keys hash << KB | p; an
   invalid entry gets the hash bucket no slot hashes to. Entries alone in their bucket are
   alone on their slot ("lone") and need no pairing: a lone write entry has gather_w = w d,
   scatter_w = w, row_decay = d, rank 0 (gradients dw = dgw d + dsw, dd = dgw w + drd); a
   lone read entry has gather_r = w, read_rank 0 (dw = dgr). The kernel first writes those
   for every entry, in position order (coalesced; the kernel's time went to the scattered
   stores of sorted order), then sorts and writes the positions of the entries that are not
   lone ("shared", m of them, in sorted order, so that a bucket's entries are side by side)
   into the chunk's compact list, followed by the lone entries' positions. The pairs kernel
   overwrites the shared entries' values. A chunk with a bucket of more than MC entries is
   "heavy": its count is stored as -1 and the dense kernels take it whole, overwriting all of
   its values.
2. Pairs (``chunk_prepare_pairs``) form everything of the compact list's entries, a window of
   whole buckets at a time.

The forward's sort outputs (the counts, and every chunk's positions: the compact list, then
the rest) are phase 1's ``layout.PairLists``, which the backward takes instead of sorting again:
its first kernel (``_chunk_lone_bwd_kernel``) forms the lone entries' gradients of every
entry of a chunk that is not heavy, in position order, and the pairs' backward then overwrites
those of the compact list's entries.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch.library import wrap_triton

from ..layout import pair_positions
from ._tiles import dense_chunk, entry_position, slot_bucket
from .chunk_prepare_pairs import pairs_launch

COMPACT = 32  # MC: the pairs kernel's window, the largest bucket it takes (a power of 2)
_SORT_WARPS = 4
_LONE_WARPS = 4


def sparse_geometry(W: int, R: int, C: int) -> tuple[int, int, int, int] | None:
    """(EM, NP, KB, MC) of the sparse path: entries per token side, entry positions per chunk
    (2 ** KB, ``layout.pair_positions``) and window size; None when the sparse path is off
    (COMPACT < 16) or a chunk has too many positions for it."""
    np_ = pair_positions(W, R, C)
    if np_ == 0 or COMPACT < 16:
        return None
    return np_ // (2 * C), np_, np_.bit_length() - 1, min(COMPACT, np_)


def sparse_launch(backward: bool, common, W, R, C, N, P, T, H, bank_rows, flags, pairs):
    """Launch the sparse path's kernels over every chunk. ``pairs`` is phase 1's
    ``layout.PairLists``: the forward's sort kernel writes it (where the geometry has no sparse
    path, it marks every chunk -1), the backward reads it. Returns its counts (int32 [P, N], -1
    for a chunk the dense kernels take), or None when the geometry has no sparse path (the
    dense kernels then do every chunk)."""
    count, entries = pairs
    geo = sparse_geometry(W, R, C)
    if geo is None:
        if not backward:
            count.fill_(-1)
            entries.zero_()
        return None
    em, np_, kb, mc = geo
    sizes = dict(W=W, R=R, EM=em, NP=np_, KB=kb, MC=mc, C=C, **flags)
    if backward:
        wrap_triton(_chunk_lone_bwd_kernel)[(N, P)](
            *common, count, T, H, bank_rows, **sizes, num_warps=_LONE_WARPS
        )
    else:
        wrap_triton(_chunk_sort_kernel)[(N, P)](
            *common, count, entries, T, H, bank_rows, **sizes, num_warps=_SORT_WARPS
        )
    pairs_launch(backward, common, count, entries, T, H, bank_rows, N, P, sizes, count.device)
    return count


@triton.jit
def _exchange(x, N: tl.constexpr, LEVEL: tl.constexpr, STEP: tl.constexpr):
    """One compare-exchange step of _sort: partners at stride 2^(LEVEL - 1 - STEP), runs of
    2^LEVEL alternately ascending and descending. x is viewed as [N / 2s, 2, s] and each
    element's partner is the pair's sum less itself."""
    HALF: tl.constexpr = 1 << (LEVEL - 1 - STEP)
    G: tl.constexpr = N // (2 * HALF)
    y = tl.reshape(x, (G, 2, HALF))
    partner = tl.sum(y, 1, keep_dims=True) - y
    right = (tl.arange(0, 2) == 1)[None, :, None]
    desc = (((tl.arange(0, G) * (2 * HALF)) >> LEVEL) & 1 == 1)[:, None, None]
    y = tl.where(right == desc, tl.minimum(y, partner), tl.maximum(y, partner))
    return tl.reshape(y, (N,))


@triton.jit
def _sort(x, N: tl.constexpr):
    """x [N] (N a power of 2, 0 <= x < 2^30) in ascending order by a bitonic network of
    builtins only: tl.sort's exchange step is a custom tl.reduce, which the interpreter runs
    element by element, and one through tl.gather compiles very slowly."""
    for level in tl.static_range(1, N.bit_length()):
        for step in tl.static_range(level):
            x = _exchange(x, N, level, step)
    return x


@triton.jit
def _shared_entries(raw, exists, S, NP: tl.constexpr, KB: tl.constexpr, MC: tl.constexpr):
    """Sort a chunk's entries (indices ``raw`` [NP] by position) by slot hash.

    Returns the sorted positions, which of them are valid (an existing entry with a slot in
    [0, S)), which share a hash bucket with another entry (every entry that shares a slot does;
    invalid entries never do), each one's place among those (an exclusive running count), and
    the chunk's count of them, or -1 when a bucket holds more than MC entries (the chunk is
    heavy)."""
    HB: tl.constexpr = 30 - KB
    NONE: tl.constexpr = (1 << HB) - 1  # the invalid entries' bucket
    i = tl.arange(0, NP)
    ok = exists & (raw >= 0) & (raw < S)
    bucket = tl.where(ok, slot_bucket(raw, HB), NONE)
    keys = _sort((bucket << KB) | i, NP)
    b = keys >> KB
    prev = tl.gather(b, tl.maximum(i - 1, 0), 0)
    nxt = tl.gather(b, tl.minimum(i + 1, NP - 1), 0)
    shared = (b != NONE) & (((i > 0) & (prev == b)) | ((i < NP - 1) & (nxt == b)))
    place = tl.cumsum(shared.to(tl.int32), 0) - shared.to(tl.int32)
    # Sorted, a bucket of more than MC entries holds two entries MC places apart.
    back = tl.gather(b, tl.maximum(i - MC, 0), 0)
    heavy = tl.sum(((b != NONE) & (i >= MC) & (back == b)).to(tl.int32), 0) > 0
    m = tl.where(heavy, -1, tl.sum(shared.to(tl.int32), 0))
    return keys & (NP - 1), b != NONE, shared, place, m


@triton.jit
def _publish(shared_count, compact, chunk, m, pos, shared, place, NP: tl.constexpr):
    """Store a chunk's shared-entry count (-1: heavy) and all of its entry positions: the
    shared ones in sorted order (the compact list), then the others in sorted order."""
    lone_place = tl.sum(shared.to(tl.int32), 0) + tl.arange(0, NP) - place
    tl.store(shared_count + chunk, m)
    tl.store(compact + chunk.to(tl.int64) * NP + tl.where(shared, place, lone_place), pos)


@triton.jit
def _chunk_sort_kernel(
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
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    n = tl.program_id(0)
    p = tl.program_id(1)
    h = p % H
    if VARLEN:  # loaded here: see _tiles.bank_slots
        tok0 = tl.load(chunks + 2 * n)
        count = tl.load(chunks + 2 * n + 1).to(tl.int32)
    else:
        tok0, count = dense_chunk(n, p, T, H, C)
    tok, is_read, j = entry_position(tl.arange(0, NP), EM)
    exists = (tok < count) & (j < tl.where(is_read, R, W))
    row = (tok0 + tok) * H + h
    wo = row * W + j
    ro = row * R + j
    is_w = exists & ~is_read
    is_r = exists & is_read
    raw = tl.where(
        is_read,
        tl.load(read_idx + ro, mask=is_r, other=-1).to(tl.int64),
        tl.load(write_idx + wo, mask=is_w, other=-1).to(tl.int64),
    )
    # Every entry as if it were lone, in position order (a token's entries side by side, so
    # each store touches a few sectors where the sorted order scattered it over 32), before
    # the sort: the pairs kernel overwrites the compact list's entries, the dense kernels a
    # heavy chunk's. Invalid entries get weight 0, decay 1.
    valid = (raw >= 0) & (raw < S)
    ok_w = is_w & valid
    ok_r = is_r & valid
    w = tl.load(write_w + wo, mask=ok_w, other=0.0).to(tl.float32)
    if HAS_DECAY:
        d = tl.load(decay + wo, mask=ok_w, other=1.0).to(tl.float32)
    else:
        d = tl.full((NP,), 1.0, tl.float32)
    tl.store(gather_w + wo, w * d, mask=is_w)
    tl.store(scatter_w + wo, w, mask=is_w)
    tl.store(row_decay + wo, d, mask=is_w)
    tl.store(rank + wo, tl.zeros((NP,), tl.int32), mask=is_w)
    tl.store(gather_r + ro, tl.load(read_w + ro, mask=ok_r, other=0.0).to(tl.float32), mask=is_r)
    tl.store(read_rank + ro, tl.zeros((NP,), tl.int32), mask=is_r)

    pos, _, shared, place, m = _shared_entries(raw, exists, S, NP, KB, MC)
    _publish(shared_count, compact, p * tl.num_programs(0) + n, m, pos, shared, place, NP)


@triton.jit
def _chunk_lone_bwd_kernel(
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
    W: tl.constexpr,
    R: tl.constexpr,
    EM: tl.constexpr,
    NP: tl.constexpr,
    KB: tl.constexpr,
    MC: tl.constexpr,
    C: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """The backward's first kernel: every entry of a chunk that is not heavy (the forward's
    count >= 0) gets the lone entries' gradients, in position order; the pairs' backward then
    overwrites those of the compact list, which is why no sort is needed here. Invalid entries
    (padding, a slot outside [0, S)) get zeros."""
    n = tl.program_id(0)
    p = tl.program_id(1)
    h = p % H
    m = tl.load(shared_count + p * tl.num_programs(0) + n)
    if m >= 0:
        if VARLEN:  # loaded here: see _tiles.bank_slots
            tok0 = tl.load(chunks + 2 * n)
            count = tl.load(chunks + 2 * n + 1).to(tl.int32)
        else:
            tok0, count = dense_chunk(n, p, T, H, C)
        tok, is_read, j = entry_position(tl.arange(0, NP), EM)
        exists = (tok < count) & (j < tl.where(is_read, R, W))
        row = (tok0 + tok) * H + h
        wo = row * W + j
        ro = row * R + j
        is_w = exists & ~is_read
        is_r = exists & is_read
        raw = tl.where(
            is_read,
            tl.load(read_idx + ro, mask=is_r, other=-1).to(tl.int64),
            tl.load(write_idx + wo, mask=is_w, other=-1).to(tl.int64),
        )
        valid = (raw >= 0) & (raw < S)
        ok_w = is_w & valid
        ok_r = is_r & valid
        gw = tl.load(d_gather_w + wo, mask=ok_w, other=0.0).to(tl.float32)
        if HAS_DECAY:
            d = tl.load(decay + wo, mask=ok_w, other=1.0).to(tl.float32)
        else:
            d = tl.full((NP,), 1.0, tl.float32)
        dsw = tl.load(d_scatter_w + wo, mask=ok_w, other=0.0).to(tl.float32)
        tl.store(d_write_w + wo, gw * d + dsw, mask=is_w)
        if HAS_DECAY:
            w = tl.load(write_w + wo, mask=ok_w, other=0.0).to(tl.float32)
            drd = tl.load(d_row_decay + wo, mask=ok_w, other=0.0).to(tl.float32)
            tl.store(d_decay + wo, gw * w + drd, mask=is_w)
        dgr = tl.load(d_gather_r + ro, mask=ok_r, other=0.0).to(tl.float32)
        tl.store(d_read_w + ro, dgr, mask=is_r)
