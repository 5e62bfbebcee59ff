"""Packed batches of sequences of different lengths (cu_seqlens): the chunk tables and the
per-sequence references built from the chunked ones."""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import QUANT_GROUP, Prepared
from ._common import compute_dtype
from .chunked import (
    chunk_prepare_backward_reference,
    chunk_prepare_reference,
    recurrence_bwd_reference,
    recurrence_fwd_reference,
    sdm_chunked_reference,
)

# A packed batch is [1, T, H, ...] with sequence n on tokens cu_seqlens[n] : cu_seqlens[n + 1].
# Chunks never straddle sequences, so the chunk axis of A, QK, X, QX ([1, H, NC, C, C]) holds
# "chunk slots": sequence n owns slots seq_chunks[n] : seq_chunks[n + 1], NC = ceil(T / C) + N
# bounds their total from above without reading cu_seqlens, and slots past the total are unused
# (no tokens; phase 1 writes them zero). Every operator takes the two tables below.


def varlen_chunks(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunk tables of a packed batch, computed on cu_seqlens' device without a host sync.

    Returns ``chunks`` [NC, 2] int64, (first token, token count) of each chunk slot ((0, 0) when
    unused), and ``seq_chunks`` [N + 1] int64, the first slot of each sequence and the end.

    Compiled code and CUDA graphs skip the eager checks of ``cu_seqlens``, so the tables are
    made safe for any values: offsets are clamped to [0, T], a decrease counts as an empty
    sequence and slots stop at NC. Every chunk then lies inside the batch's T tokens and every
    slot inside the tables, whatever ``cu_seqlens`` holds (valid offsets are unchanged).
    """
    C = chunk_size
    NC = -(-T // C) + cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64).clamp(0, T)
    N = cu.shape[0] - 1
    lens = (cu[1:] - cu[:-1]).clamp(min=0)
    ends = torch.cumsum((lens + C - 1) // C, 0)
    seq_chunks = torch.cat([ends.new_zeros(1), ends]).clamp(max=NC)
    slot = torch.arange(NC, device=cu.device)
    seq = torch.searchsorted(ends, slot, right=True)  # N for unused slots
    used = seq < N
    seq = seq.clamp(max=N - 1)
    local = (slot - seq_chunks[seq]) * C
    start = torch.where(used, cu[seq] + local, 0)
    count = torch.where(used, (lens[seq] - local).clamp(max=C), 0)
    return torch.stack([start, count], 1), seq_chunks


def varlen_sequences(chunks: Tensor, seq_chunks: Tensor) -> list[tuple[int, int, int, int]]:
    """(first token, length, first chunk slot, chunk count) of each sequence (reads the tables
    on the host: the CPU path and tests only)."""
    table = chunks.tolist()
    bounds = seq_chunks.tolist()
    seqs = []
    for c0, c1 in zip(bounds[:-1], bounds[1:]):
        start = table[c0][0] if c1 > c0 else 0
        length = sum(table[c][1] for c in range(c0, c1))
        seqs.append((start, length, c0, c1 - c0))
    return seqs


def _seq_bank(bank: Tensor, n: int) -> Tensor:
    """Sequence n's bank as [1, H, S, D] (a shared [H, S, D] bank serves every sequence)."""
    return bank[None] if bank.dim() == 3 else bank[n : n + 1]


def _token_slice(prep: Prepared, tok: slice) -> Prepared:
    """The per-entry weights of ``prep`` for tokens ``tok`` (phase 2 does not read A, QK)."""
    return Prepared(None, None, *(None if x is None else x[:, tok] for x in prep[2:]))


def chunk_prepare_varlen_reference(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows: int,
    chunk_size: int,
    chunks: Tensor,
    seq_chunks: Tensor,
) -> Prepared:
    """:func:`chunk_prepare_reference` of a packed batch, sequence by sequence."""
    cd = compute_dtype(write_w, read_w, decay)
    _, T, H, W = write_idx.shape
    R, C, NC = read_idx.shape[-1], chunk_size, chunks.shape[0]
    dev = write_idx.device
    A = torch.zeros(1, H, NC, C, C, dtype=cd, device=dev)
    QK = torch.zeros_like(A)
    per_w = [torch.zeros(1, T, H, W, dtype=cd, device=dev) for _ in range(3)]
    gather_r = torch.zeros(1, T, H, R, dtype=cd, device=dev)
    rank = torch.zeros(1, T, H, W, dtype=torch.int32, device=dev)
    read_rank = torch.zeros(1, T, H, R, dtype=torch.int32, device=dev)
    gather_w, scatter_w, row_decay = per_w
    for t0, n_tok, c0, nc in varlen_sequences(chunks, seq_chunks):
        if n_tok == 0:
            continue
        tok = slice(t0, t0 + n_tok)
        p = chunk_prepare_reference(
            write_idx[:, tok],
            write_w[:, tok],
            read_idx[:, tok],
            read_w[:, tok],
            None if decay is None else decay[:, tok],
            bank_rows,
            C,
        )
        A[:, :, c0 : c0 + nc], QK[:, :, c0 : c0 + nc] = p.A, p.QK
        for dst, src in zip((gather_w, gather_r, scatter_w, row_decay, rank, read_rank), p[2:]):
            dst[:, tok] = src
    return Prepared(A, QK, gather_w, gather_r, scatter_w, row_decay, rank, read_rank)


def recurrence_fwd_varlen_reference(
    v,
    beta,
    write_idx,
    read_idx,
    prep: Prepared,
    X,
    QX,
    bank,
    snapshot: str,
    chunks: Tensor,
    seq_chunks: Tensor,
    *,
    inplace: bool = False,
):
    """:func:`recurrence_fwd_reference` of a packed batch: bank [N, H, S, D] or [H, S, D]; the
    returned bank is [N, H, S, D]; an empty sequence returns its bank unchanged. With
    ``inplace`` (bank [N, H, S, D], contiguous, in the compute dtype) each sequence's bank is
    updated where it is, and ``bank`` itself is returned."""
    seqs = varlen_sequences(chunks, seq_chunks)
    cd = compute_dtype(v, bank, prep.gather_w)
    _, T, H, D = v.shape
    E, S = write_idx.shape[-1] + read_idx.shape[-1], bank.shape[-2]
    out, res, delta = (v.new_zeros(1, T, H, D, dtype=cd) for _ in range(3))
    bank_out = bank if inplace else bank.to(cd).expand(len(seqs), H, S, D).clone()
    snap, snap_scale = None, None
    for n, (t0, n_tok, c0, nc) in enumerate(seqs):
        tok = slice(t0, t0 + n_tok)
        sub = _token_slice(prep, tok)
        r = recurrence_fwd_reference(
            v[:, tok],
            beta[:, tok],
            write_idx[:, tok],
            read_idx[:, tok],
            sub,
            X[:, :, c0 : c0 + nc],
            QX[:, :, c0 : c0 + nc],
            _seq_bank(bank, n),
            snapshot,
            inplace=inplace,
        )
        if snap is None:
            snap = r[2].new_zeros(1, T, *r[2].shape[2:])
            scaled = snapshot in ("fp8", "int4")
            snap_scale = r[3].new_ones(1, T, H, E, D // QUANT_GROUP) if scaled else r[3]
        out[:, tok], snap[:, tok] = r[0], r[2]
        if not inplace:
            bank_out[n] = r[1][0]
        res[:, tok], delta[:, tok] = r[4], r[5]
        if snap_scale.numel():
            snap_scale[:, tok] = r[3]
    return out, bank_out, snap, snap_scale, res, delta


def recurrence_bwd_varlen_reference(
    v,
    beta,
    write_idx,
    read_idx,
    prep: Prepared,
    X,
    QX,
    bank_rows: int,
    snap,
    snap_scale,
    snapshot: str,
    res,
    delta,
    dout,
    dbank_out,
    A,
    solve_beta,
    chunks: Tensor,
    seq_chunks: Tensor,
):
    """:func:`recurrence_bwd_reference` of a packed batch (dbank [N, H, S, D]; dA and dQK as
    A, zero in the unused chunk slots)."""
    cd = compute_dtype(v, X, prep.gather_w)
    _, T, H, D = v.shape
    W, R = write_idx.shape[-1], read_idx.shape[-1]
    dev = v.device
    dv, dA = v.new_zeros(1, T, H, D, dtype=cd), X.new_zeros(X.shape, dtype=cd)
    dbeta = v.new_zeros(1, T, H, dtype=cd)
    dgw, dsw, drd = (v.new_zeros(1, T, H, W, dtype=cd) for _ in range(3))
    dgr, dQK = v.new_zeros(1, T, H, R, dtype=cd), torch.zeros_like(dA)
    banks = seq_chunks.shape[0] - 1
    dbank = (
        torch.zeros(banks, H, bank_rows, D, dtype=cd, device=dev)
        if dbank_out is None
        else dbank_out.to(cd).clone()
    )
    for n, (t0, n_tok, c0, nc) in enumerate(varlen_sequences(chunks, seq_chunks)):
        if n_tok == 0:  # the bank's gradient passes through
            continue
        tok, cs = slice(t0, t0 + n_tok), slice(c0, c0 + nc)
        sub = _token_slice(prep, tok)
        g = recurrence_bwd_reference(
            v[:, tok],
            beta[:, tok],
            write_idx[:, tok],
            read_idx[:, tok],
            sub,
            X[:, :, cs],
            QX[:, :, cs],
            bank_rows,
            snap[:, tok],
            snap_scale[:, tok] if snap_scale.numel() else snap_scale,
            snapshot,
            res[:, tok],
            delta[:, tok],
            None if dout is None else dout[:, tok],
            None if dbank_out is None else dbank_out[n : n + 1],
            A[:, :, cs],
            solve_beta[:, tok],
        )
        dv[:, tok], dbeta[:, tok], dgw[:, tok], dgr[:, tok], dsw[:, tok], drd[:, tok] = g[:6]
        dA[:, :, cs], dQK[:, :, cs], dbank[n] = g[6], g[7], g[8][0]
    return dv, dbeta, dgw, dgr, dsw, drd, dA, dQK, dbank


def chunk_prepare_backward_varlen_reference(
    write_idx,
    write_w,
    read_idx,
    read_w,
    decay,
    bank_rows: int,
    dA,
    dQK,
    d_gather_w,
    d_gather_r,
    d_scatter_w,
    d_row_decay,
    chunks: Tensor,
    seq_chunks: Tensor,
):
    """:func:`chunk_prepare_backward_reference` of a packed batch."""
    cd = compute_dtype(write_w, read_w, decay)
    dww = write_w.new_zeros(write_w.shape, dtype=cd)
    drw = read_w.new_zeros(read_w.shape, dtype=cd)
    ddc = None if decay is None else torch.zeros_like(dww)
    for t0, n_tok, c0, nc in varlen_sequences(chunks, seq_chunks):
        if n_tok == 0:
            continue
        tok, cs = slice(t0, t0 + n_tok), slice(c0, c0 + nc)
        g = chunk_prepare_backward_reference(
            write_idx[:, tok],
            write_w[:, tok],
            read_idx[:, tok],
            read_w[:, tok],
            None if decay is None else decay[:, tok],
            bank_rows,
            dA[:, :, cs],
            dQK[:, :, cs],
            d_gather_w[:, tok],
            d_gather_r[:, tok],
            d_scatter_w[:, tok],
            d_row_decay[:, tok],
        )
        dww[:, tok], drw[:, tok] = g[0], g[1]
        if ddc is not None:
            ddc[:, tok] = g[2]
    return dww, drw, ddc


def sdm_varlen_reference(
    v,
    beta,
    write_idx,
    write_w,
    read_idx,
    read_w,
    bank,
    decay=None,
    *,
    cu_seqlens: Tensor,
    chunk_size: int = 64,
):
    """The oracle of a packed batch: :func:`sdm_chunked_reference` run on each sequence alone.
    Returns (out [1, T, H, D], bank [N, H, S, D]); differentiable."""
    outs, banks = [], []
    cu = cu_seqlens.tolist()
    for n in range(len(cu) - 1):
        tok = slice(cu[n], cu[n + 1])
        o, m = sdm_chunked_reference(
            v[:, tok],
            beta[:, tok],
            write_idx[:, tok],
            write_w[:, tok],
            read_idx[:, tok],
            read_w[:, tok],
            _seq_bank(bank, n),
            None if decay is None else decay[:, tok],
            chunk_size,
        )
        outs.append(o)
        banks.append(m)
    return torch.cat(outs, 1), torch.cat(banks, 0)
