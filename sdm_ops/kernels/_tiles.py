"""Tile loaders shared by the recurrence kernels: token rows and their entries.

Tokens are rows of [B, T, H, ...] tensors: token t of stream (b, h) is row (b * T + t) * H + h
(int64). An entry is padding when it lies past T or past the entry count, or when its index is
outside [0, S): every kernel masks such entries identically, so no index reaches memory outside
the bank.
"""

import triton
import triton.language as tl


@triton.jit
def token_rows(b, h, T, H, t0, i):
    """Rows of the chunk-local tokens ``i`` of a chunk starting at ``t0``, and which exist."""
    return (b.to(tl.int64) * T + t0 + i) * H + h, (t0 + i) < T


@triton.jit
def entry_tile(idx, tok, tok_ok, E: tl.constexpr, EP: tl.constexpr, S):
    """The E entries of each token of ``tok`` as a [len(tok), EP] tile: flat offsets, the mask
    of existing entries, their slots (int64) and which slots are valid."""
    o = tl.arange(0, EP)
    ent = tok[:, None] * E + o[None, :]
    exists = tok_ok[:, None] & (o[None, :] < E)
    s = tl.load(idx + ent, mask=exists, other=-1).to(tl.int64)
    return ent, exists, s, exists & (s >= 0) & (s < S)


@triton.jit
def token_entries(idx, w, row, tok_ok, E: tl.constexpr, EP: tl.constexpr, S,
                  NOMATCH: tl.constexpr):
    """The E entries of one token (row ``row``) as [EP] vectors: slots (NOMATCH where invalid,
    so that they match nothing), float32 weights (0 where invalid) and the valid mask."""
    o = tl.arange(0, EP)
    exists = tok_ok & (o < E)
    s = tl.load(idx + row * E + o, mask=exists, other=-1).to(tl.int64)
    ok = exists & (s >= 0) & (s < S)
    ww = tl.where(ok, tl.load(w + row * E + o, mask=ok, other=0.0).to(tl.float32), 0.0)
    return tl.where(ok, s, NOMATCH), ww, ok
