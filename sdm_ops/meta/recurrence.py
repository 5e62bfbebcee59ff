"""Fakes of the recurrence operators: the public ``sdm::sparse_delta_memory`` and
``sdm::sparse_delta_memory_``, and the internal ``sdm_internal::bank_copy``,
``varlen_chunks``, ``finite_select``, ``chunk_prepare``, ``recurrence_fwd``,
``recurrence_fwd_``, ``decode_step_`` and the backwards. Each takes the operator's arguments
as one value ``a`` (the operator's ``Args``, ``ops._define``). Shapes follow the launchers'
allocations (all contiguous).
``chunks`` and ``seq_chunks`` describe a packed batch (None otherwise)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import QUANT_GROUP, SKIP_SNAPSHOT, pair_positions
from ..working_set import numbers_rows, working_set_rows


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


def chunk_slots(B: int, T: int, C: int, chunks: Tensor | None) -> tuple[int, int]:
    """The leading dimension and the chunk count of [., H, N, C, C] chunk tensors: (B, ceil(T /
    C)), or (1, NC) for a packed batch (its chunk slots, ``reference.varlen_chunks``)."""
    return (B, (T + C - 1) // C) if chunks is None else (1, chunks.shape[0])


def bank_copy_fake(a) -> Tensor:
    """[banks, H, S, D] in the bank's dtype, from [banks, H, S, D] or shared [H, S, D]."""
    return _banks(a.bank, a.banks)


def _banks(bank: Tensor, banks: int) -> Tensor:
    return bank.new_empty((banks,) + tuple(bank.shape[-3:]))


def varlen_chunks_fake(a) -> tuple[Tensor, Tensor]:
    """``chunks`` [ceil(T / C) + N, 2] and ``seq_chunks`` [N + 1], int64, for N sequences."""
    return _tables(a.cu_seqlens, a.T, a.chunk_size)


def _tables(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    slots = (T + chunk_size - 1) // chunk_size + cu_seqlens.shape[0] - 1
    return (
        cu_seqlens.new_empty((slots, 2), dtype=torch.int64),
        cu_seqlens.new_empty((cu_seqlens.shape[0],), dtype=torch.int64),
    )


def chunk_prepare_fake(a) -> tuple[Tensor, ...]:
    """The fields of ``layout.Prepared``, then of ``layout.PairLists``."""
    prep = _prepared(a.write_idx, a.write_w, a.read_idx, a.read_w, a.decay, a.chunk_size, a.chunks)
    return prep + _pair_lists(a.write_idx, a.read_idx, a.chunk_size, a.chunks)


def _pair_lists(write_idx, read_idx, C, chunks) -> tuple[Tensor, Tensor]:
    """``layout.PairLists``: count [P, N] and entries [P, N, NP] int32."""
    B, T, H, W = write_idx.shape
    lead, N = chunk_slots(B, T, C, chunks)
    count = write_idx.new_empty((lead * H, N), dtype=torch.int32)
    NP = pair_positions(W, read_idx.shape[-1], C)
    return count, count.new_empty((lead * H, N, NP))


def _prepared(write_idx, write_w, read_idx, read_w, decay, C, chunks) -> tuple[Tensor, ...]:
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    lead, N = chunk_slots(B, T, C, chunks)
    wd = weight_dtype(write_w, read_w, decay)
    A = write_w.new_empty((lead, H, N, C, C), dtype=wd)
    e = write_w.new_empty((B, T, H, W), dtype=wd)
    return (
        A,
        A.new_empty(A.shape),
        e,
        write_w.new_empty((B, T, H, R), dtype=wd),
        e.new_empty(e.shape),
        e.new_empty(e.shape),
        write_idx.new_empty((B, T, H, W), dtype=torch.int32),
        write_idx.new_empty((B, T, H, R), dtype=torch.int32),
    )


def recurrence_fwd_fake(a) -> tuple[Tensor, ...]:
    """(out, bank_out, snap, snap_scale, res, delta); without a snapshot (``SKIP_SNAPSHOT``)
    the last four are empty."""
    S = a.bank.shape[-2] if a.row_slots is None else a.row_slots.shape[1]
    return _phase2(a.v, a.write_idx, a.read_idx, a.gather_w, a.bank, a.snapshot, a.seq_chunks, S)


def _phase2(v, write_idx, read_idx, gather_w, bank, snapshot, seq_chunks, S) -> tuple[Tensor, ...]:
    """``recurrence_fwd``'s outputs; S: the final state's rows, or the working set's."""
    B, T, H, D = v.shape
    banks = B if seq_chunks is None else seq_chunks.shape[0] - 1
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


def recurrence_fwd_inplace_fake(a) -> Tensor:
    """out, in v's dtype (``recurrence_fwd_``; ``decode_step_``; ``sdm::sparse_delta_memory_``)."""
    return a.v.new_empty(a.v.shape)


decode_step_fake = sparse_delta_memory_inplace_fake = recurrence_fwd_inplace_fake


def recurrence_bwd_fake(a) -> tuple[Tensor, ...]:
    """(dv in v_dtype, dbeta, dgather_w, dgather_r, dscatter_w, drow_decay, dA, dQK, dbank)."""
    B, T, H, D = a.res.shape
    banks = B if a.seq_chunks is None else a.seq_chunks.shape[0] - 1
    wd = a.res.dtype
    return (
        a.res.new_empty((B, T, H, D), dtype=a.v_dtype),
        a.res.new_empty((B, T, H), dtype=wd),
        *(
            x.new_empty(x.shape, dtype=wd)
            for x in (a.gather_w, a.gather_r, a.scatter_w, a.row_decay, a.A, a.A)
        ),
        a.res.new_empty((banks, H, a.bank_rows, D), dtype=wd),
    )


def chunk_prepare_backward_fake(a) -> tuple[Tensor, Tensor, Tensor]:
    """(d_write_w, d_read_w, d_decay), d_decay empty without decay."""
    wd = weight_dtype(a.write_w, a.read_w, a.decay)
    return (
        a.write_w.new_empty(a.write_w.shape, dtype=wd),
        a.read_w.new_empty(a.read_w.shape, dtype=wd),
        a.write_w.new_empty(a.write_w.shape if a.decay is not None else (0,), dtype=wd),
    )


def sparse_delta_memory_fake(a) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(out, bank_out, kept): ``kept`` as the operator's body fills it (``ops.KEPT_FOR_BACKWARD``
    and, for a packed batch, the chunk tables), from the fakes of the operators it runs; empty
    without ``keep_for_backward``."""
    v, bank, cu_seqlens = a.v, a.bank, a.cu_seqlens
    B, T = v.shape[:2]
    if not a.keep_for_backward:
        banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        final = _banks(bank, banks) if a.output_final_state else bank.new_empty(0)
        return v.new_empty(v.shape), final, []
    chunks, seq_chunks = (
        (None, None) if cu_seqlens is None else _tables(cu_seqlens, T, a.chunk_size)
    )
    prep = _prepared(a.write_idx, a.write_w, a.read_idx, a.read_w, a.decay, a.chunk_size, chunks)
    A = prep[0]
    X, QX = A.new_empty(A.shape), A.new_empty(A.shape)
    S = bank.shape[-2]
    out, bank_out, *saved = _phase2(
        v, a.write_idx, a.read_idx, prep[2], bank, a.snapshot, seq_chunks, S
    )
    pairs = _pair_lists(a.write_idx, a.read_idx, a.chunk_size, chunks)
    kept = [*prep, *pairs, X, QX, *saved, *_finite_kept(a.beta, a.write_w, a.read_w, a.decay)]
    if cu_seqlens is not None:
        kept += [chunks, seq_chunks]
    if a.output_final_state:
        return out, bank_out, kept
    W, R = a.write_idx.shape[-1], a.read_idx.shape[-1]
    if not numbers_rows(T, W, R, S, a.output_final_state):
        return out, bank.new_empty(0), kept
    return out, bank.new_empty(0), kept + _working_rows(a.write_idx, a.read_idx, bank, cu_seqlens)


def finite_select_fake(a) -> tuple[Tensor, ...]:
    """``_finite.SELECTED``: what the forward keeps of it (``_finite_kept``) with bad_reads,
    bool like read_w, after the five values."""
    kept = _finite_kept(a.beta, a.write_w, a.read_w, a.decay)
    return (*kept[:5], a.read_w.new_empty(a.read_w.shape, dtype=torch.bool), *kept[5:])


def _finite_kept(beta, write_w, read_w, decay) -> list[Tensor]:
    """What the forward keeps of its selection of finite inputs (``_finite.KEPT_FOR_BACKWARD``):
    the clean beta, phase 2's beta, the clean write_w, read_w and decay (empty in beta's dtype
    without decay), each in its input's dtype, then bool masks of beta, write_w, read_w and
    decay (empty without decay)."""
    values = [t.new_empty(t.shape) for t in (beta, beta, write_w, read_w)]
    values.append(beta.new_empty(0) if decay is None else decay.new_empty(decay.shape))
    masks = [t.new_empty(t.shape, dtype=torch.bool) for t in (beta, write_w, read_w)]
    decay = beta.new_empty(0, dtype=torch.bool) if decay is None else decay
    return [*values, *masks, decay.new_empty(decay.shape, dtype=torch.bool)]


def _working_rows(write_idx, read_idx, bank, cu_seqlens) -> list[Tensor]:
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


def rows_to_bank_fake(a) -> Tensor:
    """``[banks, H, S, D]`` from ``grad_rows [banks, H, U, D]``, or ``[H, S, D]`` if shared."""
    banks, H, _, D = a.grad_rows.shape
    S = a.bank_rows
    return a.grad_rows.new_empty((H, S, D) if a.shared else (banks, H, S, D))
