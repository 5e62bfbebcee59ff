"""Tile loaders shared by the recurrence kernels: token rows and their entries, and the
positions and slot hash buckets of phase 1's sparse path (its sort and pairs kernels).

Tokens are rows of [B, T, H, ...] tensors: token t of stream (b, h) is row (b * T + t) * H + h
(int64). A chunk is its first token and its token count: computed for a dense batch, read from
the chunk table for a packed one. An entry is padding when its token lies past the chunk's
count or it lies past the entry count, or when its index is outside [0, S): every kernel masks
such entries identically, so no index reaches memory outside the bank.
"""

import triton
import triton.language as tl


@triton.jit
def dense_chunk(n, p, T, H, C: tl.constexpr):
    """(first token, token count) of chunk n of stream p = b * H + h of a dense [B, T, H, ...]
    batch; tokens are numbered b * T + t (int64), and the count exceeds C before the last
    chunk. A packed batch reads both from its chunk table instead (``reference.varlen_chunks``)."""
    return (p // H).to(tl.int64) * T + n * C, T - n * C


@triton.jit
def token_rows(tok0, h, H, count, i):
    """Rows of the chunk-local tokens ``i`` of a chunk starting at token ``tok0`` and holding
    ``count`` tokens, and which exist."""
    return (tok0 + i) * H + h, i < count


@triton.jit
def entry_offsets(tok, tok_ok, E: tl.constexpr, EP: tl.constexpr):
    """The E entries of each token of ``tok`` as a [len(tok), EP] tile: flat offsets and the
    mask of existing entries."""
    o = tl.arange(0, EP)
    return tok[:, None] * E + o[None, :], tok_ok[:, None] & (o[None, :] < E)


@triton.jit
def bank_slots(raw, exists, S):
    """Slots (int64) from indices ``raw`` loaded under ``exists``, and which are valid.

    Callers load the indices themselves (``tl.load(idx + ent, mask=exists, other=-1)``) rather
    than have a helper return them: Inductor's analysis of which tensors a kernel writes follows
    a store's address back through helper calls to their pointer arguments, and would count the
    index tensor as written (cloning it, and copying it back, in every compiled graph)."""
    s = raw.to(tl.int64)
    return s, exists & (s >= 0) & (s < S)


@triton.jit
def token_entries(idx, w, row, tok_ok, E: tl.constexpr, EP: tl.constexpr, S, NOMATCH: tl.constexpr):
    """The E entries of one token (row ``row``) as [EP] vectors: slots (NOMATCH where invalid,
    so that they match nothing), float32 weights (0 where invalid) and the valid mask."""
    o = tl.arange(0, EP)
    exists = tok_ok & (o < E)
    s = tl.load(idx + row * E + o, mask=exists, other=-1).to(tl.int64)
    ok = exists & (s >= 0) & (s < S)
    ww = tl.where(ok, tl.load(w + row * E + o, mask=ok, other=0.0).to(tl.float32), 0.0)
    return tl.where(ok, s, NOMATCH), ww, ok


@triton.jit
def snapshot_entries(tok, E0: tl.constexpr, E: tl.constexpr, EP: tl.constexpr):
    """Flat snapshot entries [len(tok), EP] (int64) of the entries E0, E0 + 1, ... of each token
    of ``tok``, in a snapshot holding E entries per token (the write entries, then the read
    entries)."""
    return tok[:, None] * E + E0 + tl.arange(0, EP)[None, :]


@triton.jit
def entry_position(pos, EM: tl.constexpr):
    """(token, is a read entry, entry number) of phase 1's sparse entry positions
    pos = tok * 2 EM + side * EM + j (``chunk_prepare_sparse``)."""
    return pos // (2 * EM), (pos // EM) % 2 == 1, pos % EM


@triton.jit
def slot_bucket(raw, HB: tl.constexpr):
    """The hash bucket (HB bits) of valid slots ``raw`` (int64); never the one of all ones,
    which the sort keeps for invalid entries."""
    NONE: tl.constexpr = (1 << HB) - 1
    bucket = ((raw * 0x9E3779B1) >> 20) & NONE
    return tl.where(bucket == NONE, 0, bucket).to(tl.int32)
