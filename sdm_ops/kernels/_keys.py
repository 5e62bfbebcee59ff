"""The keys of product-key top-k (``product_key_topk``): a float and a tie field packed into
one integer whose order is the tie rule's, and back; the rounding of a float32 result to the
row dtype; reading a short list by selects.

``pack_key``: int64 ``key32(x) << 32 | tie << 2 | flags`` of a float32 (tie < 2**29);
``pack_key16``: int32 ``key32(x) >> 16 << 16 | tie << 2 | flags`` of a widened bfloat16
(tie < 2**14). ``key32`` maps NaN to the key of -inf and -0 to +0, ``flags`` remembers both,
so ``key_value`` decodes the exact value.
"""

import triton
import triton.language as tl

# Lists of at most this many entries are read by selects (``take``) rather than ``tl.gather``,
# so that they do not bound the warp count.
SELECT_WIDTH = 4
_SELECT = tl.constexpr(SELECT_WIDTH)


@triton.jit
def key32(x):
    """Order-preserving int32 of float32 ``x``: NaN as -inf, -0 as +0."""
    s = tl.where(x != x, float("-inf"), x)
    s = tl.where(s == 0.0, 0.0, s)
    b = s.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def key_flags(x):
    """2 bits: NaN (2) and -0 (1), which ``key32`` forgets."""
    b = x.to(tl.int32, bitcast=True)
    return (x != x).to(tl.int32) * 2 + (b == -2147483648).to(tl.int32)


@triton.jit
def pack_key(x, tie):
    """int64 key of float32 ``x`` with ``tie`` (non-negative, < 2**29) breaking equal keys."""
    low = (tie << 2) | key_flags(x)
    return (key32(x).to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def pack_key16(x, tie):
    """int32 key of a float32 ``x`` that is a widened bfloat16 (its low 16 bits zero), with
    ``tie`` (non-negative, < 2**14) breaking equal keys: the high half of ``key32(x)``, which
    orders such values as ``key32`` does (a negative one's low half is all ones, a positive
    one's zero), above ``tie << 2 | flags``."""
    return ((key32(x) >> 16) << 16) | (tie << 2) | key_flags(x)


@triton.jit
def key_value(key):
    """The exact float32 packed in ``key`` by ``pack_key`` (int64) or ``pack_key16`` (int32)."""
    if key.dtype == tl.int32:
        k16 = key >> 16
        k32 = (k16 << 16) | ((k16 >> 31) & 0xFFFF)
        flags = key & 3
    else:
        k32 = (key >> 32).to(tl.int32)
        flags = (key & 3).to(tl.int32)
    b = k32 ^ ((k32 >> 31) & 0x7FFFFFFF)
    b = tl.where((flags & 2) != 0, 0x7FC00000, b)
    b = tl.where((flags & 1) != 0, -2147483648, b)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (float32 or bfloat16) to nearest even. The bfloat16
    rounding is done on the bits, so the conversion itself is exact (the interpreter's
    float32 -> bfloat16 cast truncates)."""
    if dtype == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        b = tl.where(x != x, 0x7FC00000, b)
        return b.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def key_tie(key):
    if key.dtype == tl.int32:
        return (key >> 2) & 0x3FFF
    else:
        return ((key >> 2) & 0x1FFFFFFF).to(tl.int32)


@triton.jit
def take(src, idx, L: tl.constexpr):
    """``src[r, idx[r, n]]`` for a [ROWS, L] ``src`` (int64 or float32) and a [ROWS, N]
    ``idx`` in [0, L). Up to SELECT_WIDTH columns by selects, exact for every value (a
    float32 source is read as its bits), else by ``tl.gather``, which Triton lowers within a
    warp, so only wider sources bound the launcher's warp count."""
    if L > _SELECT:
        return tl.gather(src, idx, 1)
    else:
        if src.dtype == tl.float32:
            bits = src.to(tl.int32, bitcast=True)
        else:
            bits = src
        cols = tl.arange(0, L)[None, :]
        out = tl.broadcast_to(tl.sum(tl.where(cols == 0, bits, 0), axis=1)[:, None], idx.shape)
        for c in tl.static_range(1, L):
            col = tl.sum(tl.where(cols == c, bits, 0), axis=1)
            out = tl.where(idx == c, col[:, None], out)
        if src.dtype == tl.float32:
            return out.to(tl.float32, bitcast=True)
        else:
            return out
