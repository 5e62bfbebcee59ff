"""Fakes of the recurrence operators: the public ``sdm::sparse_delta_memory`` and
``sdm::sparse_delta_memory_`` (composed from the internal ones' fakes), and the internal
``sdm_internal::bank_copy``, ``varlen_chunks``, ``chunk_prepare``, ``recurrence_fwd``,
``recurrence_fwd_``, ``decode_step_`` and the backwards.
Shapes follow the launchers' allocations (all contiguous). ``chunks`` and ``seq_chunks``
describe a packed batch (None otherwise)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import QUANT_GROUP, SKIP_SNAPSHOT
from ..working_set import working_set_rows


def weight_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 on the CPU path when a float input is float64, else float32."""
    wide = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if wide else torch.float32


def snapshot_layout(mode: str, bank: Tensor, B: int, T: int, H: int, E: int, D: int):
    """(shape, dtype) of the snapshot rows and the shape of their scales for ``mode``; E = W + R
    entries per token (the write entries' rows, then the read entries')."""
    rows = (B, T, H, E, D)
    if mode == "none":
        return rows, bank.dtype, (0,)
    if mode == "bf16":
        return rows, torch.bfloat16, (0,)
    scales = (B, T, H, E, D // QUANT_GROUP)
    if mode == "fp8":
        return rows, torch.uint8, scales  # float8_e4m3fn bit patterns
    return (B, T, H, E, D // 2), torch.uint8, scales


def bank_copy_fake(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
    """[banks, H, S, D] in the bank's dtype, from [banks, H, S, D] or shared [H, S, D]."""
    return bank.new_empty((banks,) + tuple(bank.shape[-3:]))


def varlen_chunks_fake(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """``chunks`` [ceil(T / C) + N, 2] and ``seq_chunks`` [N + 1], int64, for N sequences."""
    slots = (T + chunk_size - 1) // chunk_size + cu_seqlens.shape[0] - 1
    return (
        cu_seqlens.new_empty((slots, 2), dtype=torch.int64),
        cu_seqlens.new_empty((cu_seqlens.shape[0],), dtype=torch.int64),
    )


def chunk_slots(B: int, T: int, C: int, chunks: Tensor | None) -> tuple[int, int]:
    """The leading dimension and the chunk count of [., H, N, C, C] chunk tensors: (B, ceil(T /
    C)), or (1, NC) for a packed batch (its chunk slots, ``reference.varlen_chunks``)."""
    return (B, (T + C - 1) // C) if chunks is None else (1, chunks.shape[0])


def chunk_prepare_fake(
    write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, chunks=None, seq_chunks=None
):
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    C = chunk_size
    lead, N = chunk_slots(B, T, C, chunks)
    wd = weight_dtype(write_w, read_w, decay)
    a = write_w.new_empty((lead, H, N, C, C), dtype=wd)
    e = write_w.new_empty((B, T, H, W), dtype=wd)
    return (
        a,
        a.new_empty(a.shape),
        e,
        write_w.new_empty((B, T, H, R), dtype=wd),
        e.new_empty(e.shape),
        e.new_empty(e.shape),
        write_idx.new_empty((B, T, H, W), dtype=torch.int32),
        write_idx.new_empty((B, T, H, R), dtype=torch.int32),
    )


def recurrence_fwd_fake(
    v,
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
    bank,
    snapshot,
    chunks=None,
    seq_chunks=None,
    write_src=None,
    read_src=None,
    row_slots=None,
):
    B, T, H, D = v.shape
    banks = B if seq_chunks is None else seq_chunks.shape[0] - 1
    # The final state, or the working set's rows ([P, U] of row_slots) without one.
    S = bank.shape[-2] if row_slots is None else row_slots.shape[1]
    E = write_idx.shape[-1] + read_idx.shape[-1]
    wd = weight_dtype(v, bank, gather_w)
    if snapshot == SKIP_SNAPSHOT:
        empty = v.new_empty((0,), dtype=wd)
        return (
            v.new_empty((B, T, H, D)),
            bank.new_empty((banks, H, S, D)),
            bank.new_empty((0,)),
            bank.new_empty((0,), dtype=torch.float32),
            empty,
            empty.new_empty((0,)),
        )
    rows, rows_dtype, scales = snapshot_layout(snapshot, bank, B, T, H, E, D)
    t = v.new_empty((B, T, H, D), dtype=wd)
    return (
        v.new_empty((B, T, H, D)),
        bank.new_empty((banks, H, S, D)),
        bank.new_empty(rows, dtype=rows_dtype),
        bank.new_empty(scales, dtype=torch.float32),
        t,
        t.new_empty(t.shape),
    )


def recurrence_fwd_inplace_fake(
    bank,
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
    chunks=None,
    seq_chunks=None,
):
    return v.new_empty(v.shape)


def decode_step_fake(bank, v, beta, write_idx, write_w, read_idx, read_w, decay=None):
    return v.new_empty(v.shape)


def recurrence_bwd_fake(
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
    bank_rows,
    snap,
    snap_scale,
    snapshot,
    dout,
    dbank_out,
    v_dtype,
    chunks=None,
    seq_chunks=None,
):
    B, T, H, D = res.shape
    banks = B if seq_chunks is None else seq_chunks.shape[0] - 1
    wd = res.dtype
    return (
        res.new_empty((B, T, H, D), dtype=v_dtype),
        res.new_empty((B, T, H), dtype=wd),
        *(
            x.new_empty(x.shape, dtype=wd)
            for x in (gather_w, gather_r, scatter_w, row_decay, X, QX)
        ),
        res.new_empty((banks, H, bank_rows, D), dtype=wd),
    )


def chunk_prepare_backward_fake(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    chunks=None,
    seq_chunks=None,
):
    wd = weight_dtype(write_w, read_w, decay)
    return (
        write_w.new_empty(write_w.shape, dtype=wd),
        read_w.new_empty(read_w.shape, dtype=wd),
        write_w.new_empty(write_w.shape if decay is not None else (0,), dtype=wd),
    )


def sparse_delta_memory_fake(
    v,
    beta,
    write_idx,
    write_w,
    read_idx,
    read_w,
    bank,
    decay=None,
    chunk_size=64,
    snapshot="none",
    cu_seqlens=None,
    output_final_state=False,
    *,
    keep_for_backward=True,
):
    """(out, bank_out, kept): ``kept`` as the operator's body fills it (``ops.KEPT_FOR_BACKWARD``
    and, for a packed batch, the chunk tables), from the fakes of the operators it runs; empty
    without ``keep_for_backward``."""
    B, T = v.shape[:2]
    if not keep_for_backward:
        banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        final = bank_copy_fake(bank, banks) if output_final_state else bank.new_empty(0)
        return v.new_empty(v.shape), final, []
    tables = (None, None) if cu_seqlens is None else varlen_chunks_fake(cu_seqlens, T, chunk_size)
    prep = chunk_prepare_fake(
        write_idx, write_w, read_idx, read_w, decay, bank.shape[-2], chunk_size, *tables
    )
    A = prep[0]
    X, QX = A.new_empty(A.shape), A.new_empty(A.shape)
    out, bank_out, *saved = recurrence_fwd_fake(
        v, beta, write_idx, read_idx, *prep[2:], X, QX, bank, snapshot, *tables
    )
    kept = [*prep, X, QX, *saved]
    if cu_seqlens is not None:
        kept += tables
    if output_final_state:
        return out, bank_out, kept
    return out, bank.new_empty(0), kept + working_rows_fake(write_idx, read_idx, bank, cu_seqlens)


def working_rows_fake(write_idx, read_idx, bank, cu_seqlens):
    """``working_set.working_rows``' outputs: the entries' rows and the rows' slots
    ``[P, U]`` (int64)."""
    B, T, H, W = write_idx.shape
    P = (B if cu_seqlens is None else cu_seqlens.shape[0] - 1) * H
    U = working_set_rows(T, W, read_idx.shape[-1], bank.shape[-2])
    return [
        write_idx.new_empty(write_idx.shape, dtype=torch.int64),
        read_idx.new_empty(read_idx.shape, dtype=torch.int64),
        write_idx.new_empty((P, U), dtype=torch.int64),
    ]


def sparse_delta_memory_inplace_fake(
    v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None, chunk_size=64, cu_seqlens=None
):
    return v.new_empty(v.shape)


def rows_to_bank_fake(grad_rows, row_slots, bank_rows, shared):
    """``[banks, H, S, D]`` from ``grad_rows [banks, H, U, D]``, or ``[H, S, D]`` if shared."""
    banks, H, _, D = grad_rows.shape
    return grad_rows.new_empty((H, bank_rows, D) if shared else (banks, H, bank_rows, D))
