"""The working set: the bank rows a sequence touches, numbered per stream.

Without ``output_final_state`` nothing reads the bank after the last token, so the forward and
the backward need only the rows that the sequence's entries address: at most
``min(T * (W + R), S)`` a stream, whatever S is. ``working_rows`` numbers them: per stream
(batch row or packed sequence, and head), the distinct valid slots of its write and read
entries, in ascending slot order, become rows 0, 1, ... of a working set ``[P, U, D]``. Every
entry gets its row (-1 for padding, an index outside [0, S) or a token outside every packed
sequence), and ``row_slots [P, U]`` gives each row's slot (-1 past the stream's last row).

Since the numbering is one to one within a stream, two entries share a row exactly when they
share a slot: phase 1's pairings, ranks and weights do not change, and phase 2 and its backward
run unchanged on the working set with the entries' rows as indices. Phase 2 reads a row from
the initial bank (at the entry's own slot) until its stream first writes it
(``kernels/recurrence_fwd.py``, ``ROWS``); the backward's bank gradient comes out per row,
``[P, U, D]``, and ``rows_to_bank`` places it at the rows' slots.

Plain tensor operations with static shapes (a sort, a scan, searches): no host
synchronization, so the numbering compiles and captures like the operators around it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

_SPARE = 1024  # places the keys that address nothing store into


class WorkingRows(NamedTuple):
    write_rows: Tensor  # [B, T, H, W] int64: each write entry's row, -1 for none
    read_rows: Tensor  # [B, T, H, R] int64: each read entry's row, -1 for none
    row_slots: Tensor  # [P, U] int64: each row's slot in the bank, -1 for unused rows


def working_set_rows(T: int, W: int, R: int, S: int) -> int:
    """U, the rows a stream's working set may need: its entries, or the whole bank if fewer.
    (``torch.sym_min`` / ``sym_max``: a dynamic T adds no guard.)"""
    return torch.sym_max(1, torch.sym_min(T * (W + R), S))


def numbers_rows(T, W: int, R: int, S: int, output_final_state: bool) -> bool:
    """Whether a functional call runs phase 2 on a numbered working set
    (``working_rows``): without the final state, when its streams may touch fewer
    rows than the bank has (``working_set_rows``). When they may touch as many (T (W + R) >=
    S), the slots are the rows: the working set would be as large as the bank, so numbering
    it (a sort of every entry, its scatters, the rows' gradient moved to the slots) buys
    nothing; phase 2 then runs as with the final state, without copying the rows no chunk
    writes, and the memory is the same."""
    return not output_final_state and working_set_rows(T, W, R, S) < S


def working_rows(
    write_idx: Tensor, read_idx: Tensor, S: int, cu_seqlens: Tensor | None = None
) -> WorkingRows:
    """Number the rows each stream touches (see the module docstring). Streams are ``b * H + h``
    for a dense batch, and ``n * H + h`` for sequence n of a packed one (``cu_seqlens``; the
    entries are then ``[1, T, H, .]``)."""
    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    dev = write_idx.device
    P = B * H if cu_seqlens is None else (cu_seqlens.shape[0] - 1) * H
    U = working_set_rows(T, W, R, S)
    # One key per entry: stream * (S + 1) + slot, the slot clamped to [-1, S], where -1 and S
    # address nothing (-1 lands on the previous stream's slot S, or below stream 0); 32-bit
    # where every key fits (a radix sort then makes half the passes).
    span = S + 1
    key_dtype = torch.int32 if (P + 1) * span < 2**31 else torch.int64
    firsts = torch.arange(0, P * span, span, device=dev, dtype=key_dtype)  # each stream's key 0
    if cu_seqlens is None:
        stream_key = firsts.view(B, 1, H, 1)  # stream b * H + h
    else:
        N = cu_seqlens.shape[0] - 1
        # Token t belongs to sequence n when cu[n] <= t < cu[n + 1]; tokens past the last
        # offset belong to none (P, past every stream).
        seq = torch.searchsorted(
            cu_seqlens[1:].contiguous(), torch.arange(T, device=dev), right=True
        )[:, None]
        stream = torch.where(seq < N, seq * H + torch.arange(H, device=dev), P)
        stream_key = (stream.to(key_dtype) * span)[None, :, :, None]
    # The write entries then the read entries of each token, side by side.
    idx = torch.cat([write_idx, read_idx], dim=-1)
    flat = (stream_key + idx.clamp(-1, S).to(key_dtype)).reshape(-1)
    if flat.numel() == 0:
        return WorkingRows(
            write_idx.new_full(write_idx.shape, -1, dtype=torch.int64),
            read_idx.new_full(read_idx.shape, -1, dtype=torch.int64),
            write_idx.new_full((P, U), -1, dtype=torch.int64),
        )
    key, order = torch.sort(flat)
    # The number of distinct keys before each key: a new key wherever the sorted keys change.
    distinct = torch.cumsum(torch.nn.functional.pad(key[1:] != key[:-1], (1, 0)), 0)
    key_stream, key_slot = key // span, key % span
    valid = (key_slot < S) & (key_stream < P)
    # A stream's rows count from its first key: the distinct keys before it are other streams'.
    first = distinct[torch.searchsorted(key, firsts).clamp(max=key.numel() - 1)]
    row = distinct - first[key_stream.clamp(0, max(P - 1, 0))]
    row = torch.where(valid, row, -1)
    rows = torch.empty_like(row).scatter_(0, order, row).view(*idx.shape)
    # Each row's slot: every key of the row stores the same slot there, so no order of the
    # stores changes the result; keys that address nothing store -1 into spare places, spread
    # so that they do not all contend for one address.
    spare = torch.arange(key.numel(), device=dev) % _SPARE
    target = torch.where(valid, key_stream * U + row, P * U + spare)
    row_slots = torch.full((P * U + _SPARE,), -1, dtype=key_dtype, device=dev)
    row_slots.scatter_(0, target, torch.where(valid, key_slot, -1))
    return WorkingRows(
        # Copies: the operator returns them, and no two of its outputs may share memory.
        rows[..., :W].clone(memory_format=torch.contiguous_format),
        rows[..., W:].clone(memory_format=torch.contiguous_format),
        row_slots[: P * U].view(P, U).to(torch.int64, copy=True),
    )


def gather_rows(bank: Tensor, row_slots: Tensor, banks: int, H: int) -> Tensor:
    """The working set's rows at the start, ``[banks, H, U, D]`` in the bank's dtype: row u of
    stream p holds the initial bank's slot ``row_slots[p, u]`` (zeros for unused rows). The
    reference path's way in; the kernels read the initial bank directly instead."""
    S, D = bank.shape[-2:]
    P, U = row_slots.shape
    src = torch.arange(P, device=bank.device) % (H if bank.dim() == 3 else P)
    flat = src[:, None] * S + row_slots.clamp(min=0)
    rows = bank.reshape(-1, D)[flat.reshape(-1)].view(P, U, D)
    rows = torch.where((row_slots >= 0)[..., None], rows, 0)
    return rows.view(banks, H, U, D)


def rows_to_bank_reference(
    grad_rows: Tensor, row_slots: Tensor | None, S: int, shared: bool, banks: int, H: int
) -> Tensor:
    """``grad_rows [banks, H, U, D]`` placed at their rows' slots: ``[banks, H, S, D]``, or with
    ``shared`` ``[H, S, D]`` summed over the banks in order (zeros where no row lands)."""
    D = grad_rows.shape[-1]
    P, U = banks * H, grad_rows.shape[-2]
    if row_slots is None:  # the rows are the slots
        row_slots = torch.arange(U, device=grad_rows.device).expand(P, U)
    out = grad_rows.new_zeros((H if shared else P) * S + 1, D)
    rows = grad_rows.reshape(P, U, D)
    for b in range(banks if shared else 1):
        streams = slice(b * H, (b + 1) * H) if shared else slice(0, P)
        slots = row_slots[streams]
        base = torch.arange(slots.shape[0], device=slots.device)[:, None] * S
        flat = torch.where(slots >= 0, base + slots, out.shape[0] - 1).reshape(-1)
        # Rows of one stream have distinct slots, so within one step no two rows meet; the
        # steps go over the batch in order.
        out.index_put_((flat,), rows[streams].reshape(-1, D), accumulate=True)
    out = out[:-1]
    return out.view(H, S, D) if shared else out.view(banks, H, S, D)
