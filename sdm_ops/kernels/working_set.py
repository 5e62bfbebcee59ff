"""The bank gradient from the working set's: each row's gradient placed at its slot.

``grad_rows [P, U, D]`` float32 (stream p's row u) lands at ``dst[p, row_slots[p, u]]`` (or at
``dst[p, u]`` without ``row_slots``: the rows are the slots) of a
per-stream gradient ``[P, S, D]``, or is added to ``dst[p % H, row_slots[p, u]]`` of a shared
one ``[H, S, D]``. ``dst`` starts zeroed. Rows of one stream have distinct slots, so a launch
over the streams of one batch row never meets itself; a shared gradient takes one launch per
batch row, in order, so every slot sums the batch in the same order on every run
(deterministic, no atomics). Rows whose slot is -1 or outside [0, S) are skipped.

Grid: (streams of the launch, cdiv(U, BU)); a program moves BU rows of all D columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_BU = 32  # rows a program


@triton.jit
def _rows_to_bank_kernel(
    grad_rows,
    row_slots,
    dst,
    p0,
    U,
    S,
    H,
    D: tl.constexpr,
    BU: tl.constexpr,
    SHARED: tl.constexpr,
    SLOTS: tl.constexpr,
):
    p = p0 + tl.program_id(0)
    u = tl.program_id(1) * BU + tl.arange(0, BU)
    inside = u < U
    at = p.to(tl.int64) * U + u
    if SLOTS:  # the rows are the slots
        slot = tl.where(inside, u.to(tl.int64), -1)
    else:
        slot = tl.load(row_slots + at, mask=inside, other=-1)
    ok = inside & (slot >= 0) & (slot < S)
    cols = tl.arange(0, D)
    vals = tl.load(grad_rows + at[:, None] * D + cols[None, :], mask=ok[:, None], other=0.0)
    if SHARED:
        base = (p % H).to(tl.int64) * S
    else:
        base = p.to(tl.int64) * S
    ptr = dst + (base + slot)[:, None] * D + cols[None, :]
    if SHARED:
        vals += tl.load(ptr, mask=ok[:, None], other=0.0)
    tl.store(ptr, vals, mask=ok[:, None])


def rows_to_bank(grad_rows: torch.Tensor, row_slots, dst: torch.Tensor) -> None:
    """Fill the zeroed ``dst`` ([P, S, D] viewed from [banks, H, S, D], or shared [H, S, D])
    from ``grad_rows`` ([P, U, D] float32) and ``row_slots`` ([P, U] int64; None: row u is
    slot u)."""
    U, D = grad_rows.shape[-2:]
    P = grad_rows.shape[:-2].numel()
    shared = dst.dim() == 3
    H, S = dst.shape[-3], dst.shape[-2]
    if P * U == 0:
        return
    launches = [(b * H, H) for b in range(P // H)] if shared else [(0, P)]
    for p0, count in launches:
        wrap_triton(_rows_to_bank_kernel)[(count, triton.cdiv(U, _BU))](
            grad_rows,
            grad_rows if row_slots is None else row_slots,
            dst,
            p0,
            U,
            S,
            H,
            D=D,
            BU=_BU,
            SHARED=shared,
            SLOTS=row_slots is None,
            num_warps=4,
        )
