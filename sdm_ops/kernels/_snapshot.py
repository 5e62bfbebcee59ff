"""The snapshot of phase 2, shared by its forward (which stores it) and its backward (which
reads it): the chunk-start bank row of every entry, write entries then read entries, kept by
the forward so that the backward never reads the bank.

Modes (``reference.quantize_rows`` defines them; these kernels quantize identically):
``none`` keeps the bank's dtype, ``bf16`` bfloat16; ``fp8`` stores the float8_e4m3fn bits (as
uint8) of ``row / scale`` and ``int4`` ``row / scale`` rounded half up to [-7, 7] plus 8, two
codes a byte (the even column in the low nibble), both with a float32 scale (amax / 448 or
amax / 7, 1 for a group of zeros) per BLOCK_D = QUANT_GROUP = 16 columns: a phase-2 program
owns one such group of every row. Layouts in ``recurrence_fwd``'s docstring.
"""

import triton
import triton.language as tl

from ..layout import QUANT_GROUP
from ._tiles import snapshot_entries

BLOCK_D = QUANT_GROUP  # columns per program: a program quantizes one snapshot group
SNAP_NONE, SNAP_BF16, SNAP_FP8, SNAP_INT4 = 0, 1, 2, 3
SNAP_CODES = {"none": SNAP_NONE, "bf16": SNAP_BF16, "fp8": SNAP_FP8, "int4": SNAP_INT4}


@triton.jit
def e4m3_bits(x):
    """float8_e4m3fn bits (int32) of float32 ``x`` in [-448, 448], rounded to nearest even.

    Written out in integer arithmetic rather than ``x.to(tl.float8e4nv)`` so that the result is
    the same on every backend (Triton's interpreter rounds fp8 differently from the GPU)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2^-6): keep 3 mantissa bits, round half to even; a carry moves the
    # exponent, as it should.
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 127 + 7) << 3) | ((r >> 20) & 7)
    # Subnormal range: multiples of 2^-9.
    y = a * 512.0
    t = tl.floor(y)
    f = y - t
    ti = t.to(tl.int32)
    sub = ti + ((f > 0.5) | ((f == 0.5) & ((ti & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, code | 0x80, code)


@triton.jit
def store_snapshot(
    snap, snap_scale, ent, rows, ok, c0, cols, D: tl.constexpr, BD: tl.constexpr, MODE: tl.constexpr
):
    """Store gathered rows [TB, EP, BD] of entries ``ent`` [TB, EP] (int64 flat entry index)."""
    if MODE == 0 or MODE == 1:
        tl.store(
            snap + ent[:, :, None] * D + cols[None, None, :],
            rows.to(snap.dtype.element_ty),
            mask=ok[:, :, None],
        )
    else:
        amax = tl.max(tl.abs(rows), 2)
        if MODE == 2:
            scale = tl.where(amax > 0, amax / 448.0, 1.0)
            x = rows / scale[:, :, None]
            x = tl.minimum(tl.maximum(x, -448.0), 448.0)
            tl.store(
                snap + ent[:, :, None] * D + cols[None, None, :],
                e4m3_bits(x).to(tl.uint8),
                mask=ok[:, :, None],
            )
        else:
            scale = tl.where(amax > 0, amax / 7.0, 1.0)
            x = tl.floor(rows / scale[:, :, None] + 0.5)
            q = (tl.minimum(tl.maximum(x, -7.0), 7.0) + 8.0).to(tl.int32)
            TB: tl.constexpr = rows.shape[0]
            EP: tl.constexpr = rows.shape[1]
            lo, hi = tl.split(tl.reshape(q, (TB, EP, BD // 2, 2)))
            byte = (lo | (hi << 4)).to(tl.uint8)
            half = c0 // 2 + tl.arange(0, BD // 2)
            tl.store(
                snap + ent[:, :, None] * (D // 2) + half[None, None, :], byte, mask=ok[:, :, None]
            )
        tl.store(snap_scale + ent * (D // BD) + c0 // BD, scale, mask=ok)


@triton.jit
def store_token_rows(
    snap, snap_scale, tok, rows, wm, qrows, rm, c0, cols, W, R, WP, RP, D, BD, MODE
):
    """Store a tile's gathered write rows [TB, WP, BD] and read rows [TB, RP, BD] (masks ``wm``,
    ``rm``) as the snapshot of the tokens ``tok``: a token's W write entries, then its R read
    entries (``snapshot_entries``)."""
    store_snapshot(
        snap, snap_scale, snapshot_entries(tok, 0, W + R, WP), rows, wm, c0, cols, D, BD, MODE
    )
    store_snapshot(
        snap, snap_scale, snapshot_entries(tok, W, W + R, RP), qrows, rm, c0, cols, D, BD, MODE
    )


@triton.jit
def load_snapshot(
    snap, snap_scale, ent, ok, c0, cols, D: tl.constexpr, BD: tl.constexpr, MODE: tl.constexpr
):
    """Dequantized snapshot rows [TB, EP, BD] of entries ``ent`` (flat int64 index)."""
    if MODE == 0 or MODE == 1:
        return tl.load(
            snap + ent[:, :, None] * D + cols[None, None, :], mask=ok[:, :, None], other=0.0
        ).to(tl.float32)
    else:
        scale = tl.load(snap_scale + ent * (D // BD) + c0 // BD, mask=ok, other=0.0)
        if MODE == 2:
            bits = tl.load(
                snap + ent[:, :, None] * D + cols[None, None, :], mask=ok[:, :, None], other=0
            ).to(tl.int32)  # raw e4m3 bits
            ex = (bits >> 3) & 15
            mant = bits & 7
            normal = (((ex + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True)
            x = tl.where(ex == 0, mant.to(tl.float32) * 0.001953125, normal)
            # The sign as a bit, not a negation: code 0x80 is -0 (Triton's -x is 0 - x).
            x = (x.to(tl.int32, bitcast=True) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)
        else:
            half = c0 // 2 + tl.arange(0, BD // 2)
            byte = tl.load(
                snap + ent[:, :, None] * (D // 2) + half[None, None, :],
                mask=ok[:, :, None],
                other=0,
            ).to(tl.int32)
            lo = (byte & 15) - 8
            hi = (byte >> 4) - 8
            TB: tl.constexpr = byte.shape[0]
            EP: tl.constexpr = byte.shape[1]
            x = tl.reshape(tl.join(lo, hi), (TB, EP, BD)).to(tl.float32)
        return x * scale[:, :, None]
