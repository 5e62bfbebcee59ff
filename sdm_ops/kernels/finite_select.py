"""The selection of finite inputs (``sdm_ops/_finite.py``) in one launch.

Math (``_finite.select``, the CPU path and the oracle), per token n (of N = B * T * H) and
entry: an entry is valid when its index lies in [0, S), a value is kept when it is valid and
finite (|x| <= FLT_MAX; beta: when the token has a valid write entry and beta is finite).

    beta_out   = beta where kept, else 0          kept_beta    = the mask of beta
    write_w_out = write_w where kept, else 0      kept_write_w = the mask of write_w
    read_w_out = read_w where kept, else 0        kept_read_w  = the mask of read_w
    decay_out  = decay where kept, else 1         kept_decay   = the mask of decay
    beta_walk  = NaN where a valid write entry's weight or decay, or the beta of a token that
                 writes, is not finite; else beta_out
    bad_reads  = the valid read entries of a token with a valid read entry whose weight is not
                 finite

Why a kernel: in eager PyTorch (``_finite.select``, the CPU path) the same selection takes
about thirty small elementwise launches and three reductions over [B, T, H, W], each reading and
writing its own temporaries; here each input is read once and each output written once.

Layout: every tensor contiguous, [N] (beta and its outputs), [N, W] (write side) or [N, R]
(read side); indices int64; the masks bool. Grid: one program per BN tokens, [BN, WP] and
[BN, RP] tiles (WP, RP: W and R rounded up to powers of two). Selections only, no arithmetic on
the values: every output is bitwise a value of its input, 0, 1 or NaN; deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_BN = 64  # tokens a program
_FLT_MAX = tl.constexpr(3.4028234663852886e38)  # |x| <= FLT_MAX: finite (NaN compares false)


@triton.jit
def _wide(x):
    """bfloat16 and float16 values as float32, float64 as it is: exact both ways (the stores
    round each selected value back to itself), and the selects' constants are float32."""
    if x.dtype != tl.float64:
        x = x.to(tl.float32)
    return x


@triton.jit
def _finite_select_kernel(
    beta,
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    beta_out,
    beta_walk,
    write_w_out,
    read_w_out,
    decay_out,
    bad_reads,
    kept_beta,
    kept_write_w,
    kept_read_w,
    kept_decay,
    N,
    S,
    W: tl.constexpr,
    R: tl.constexpr,
    WP: tl.constexpr,
    RP: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BN: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64) * BN + tl.arange(0, BN)
    live = n < N
    # The write side: which entries are valid, kept, and valid but not kept.
    w = tl.arange(0, WP)
    at_w = n[:, None] * W + w[None, :]
    in_w = live[:, None] & (w[None, :] < W)
    w_idx = tl.load(write_idx + at_w, mask=in_w, other=-1)
    valid_w = in_w & (w_idx >= 0) & (w_idx < S)
    ww = _wide(tl.load(write_w + at_w, mask=in_w, other=0.0))
    keep_w = valid_w & (tl.abs(ww) <= _FLT_MAX)
    good_w = keep_w
    if HAS_DECAY:
        dc = _wide(tl.load(decay + at_w, mask=in_w, other=1.0))
        keep_d = valid_w & (tl.abs(dc) <= _FLT_MAX)
        good_w = good_w & keep_d
        tl.store(decay_out + at_w, tl.where(keep_d, dc, 1.0), mask=in_w)
        tl.store(kept_decay + at_w, keep_d, mask=in_w)
    tl.store(write_w_out + at_w, tl.where(keep_w, ww, 0.0), mask=in_w)
    tl.store(kept_write_w + at_w, keep_w, mask=in_w)
    writes = tl.max(valid_w.to(tl.int32), 1) > 0
    bad_w = tl.max((valid_w & ~good_w).to(tl.int32), 1) > 0
    # beta: kept where the token writes and beta is finite; NaN for phase 2 where the token's
    # write side is not finite.
    b = _wide(tl.load(beta + n, mask=live, other=0.0))
    keep_b = writes & (tl.abs(b) <= _FLT_MAX)
    b_clean = tl.where(keep_b, b, 0.0)
    tl.store(beta_out + n, b_clean, mask=live)
    tl.store(kept_beta + n, keep_b, mask=live)
    write_bad = bad_w | (writes & ~keep_b)
    tl.store(beta_walk + n, tl.where(write_bad, float("nan"), b_clean), mask=live)
    # The read side.
    r = tl.arange(0, RP)
    at_r = n[:, None] * R + r[None, :]
    in_r = live[:, None] & (r[None, :] < R)
    r_idx = tl.load(read_idx + at_r, mask=in_r, other=-1)
    valid_r = in_r & (r_idx >= 0) & (r_idx < S)
    rw = _wide(tl.load(read_w + at_r, mask=in_r, other=0.0))
    keep_r = valid_r & (tl.abs(rw) <= _FLT_MAX)
    tl.store(read_w_out + at_r, tl.where(keep_r, rw, 0.0), mask=in_r)
    tl.store(kept_read_w + at_r, keep_r, mask=in_r)
    bad_r = tl.max((valid_r & ~keep_r).to(tl.int32), 1) > 0
    tl.store(bad_reads + at_r, valid_r & bad_r[:, None], mask=in_r)


def finite_select(
    beta: torch.Tensor,
    write_idx: torch.Tensor,
    write_w: torch.Tensor,
    read_idx: torch.Tensor,
    read_w: torch.Tensor,
    decay: torch.Tensor | None,
    bank_rows: int,
    outs: tuple[torch.Tensor, ...],
) -> None:
    """Fill ``outs`` (``_finite.SELECTED``'s order, from ``meta.finite_select_fake``) from the
    contiguous inputs ``beta [B, T, H]``, ``write_idx``/``write_w``/``decay [B, T, H, W]`` and
    ``read_idx``/``read_w [B, T, H, R]`` (indices int64); without decay its two outputs are
    empty and not written."""
    N = beta.numel()
    if N == 0:
        return
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    has_decay = decay is not None
    wrap_triton(_finite_select_kernel)[(triton.cdiv(N, _BN),)](
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        decay if has_decay else write_w,  # not read without decay
        *outs[:4],
        outs[4] if has_decay else outs[2],  # not written without decay
        outs[5],
        *outs[6:9],
        outs[9] if has_decay else outs[7],
        N,
        bank_rows,
        W=W,
        R=R,
        WP=max(triton.next_power_of_2(W), 1),
        RP=max(triton.next_power_of_2(R), 1),
        HAS_DECAY=has_decay,
        BN=_BN,
        num_warps=4,
    )
