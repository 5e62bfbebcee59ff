"""The chunk tables of a packed batch (``cu_seqlens``), in one launch.

Math (``reference.varlen_chunks``, the CPU path and the oracle). N sequences, offsets
``cu_seqlens`` [N + 1] clamped to [0, T]; sequence n has len_n = max(cu[n + 1] - cu[n], 0)
tokens (a decrease counts as an empty sequence) in k_n = ceil(len_n / C) chunks, and its chunks
take the slots first_n .. first_n + k_n - 1, first_n = k_0 + ... + k_{n-1}. Slot s of sequence
n, j = s - first_n, starts at token cu[n] + j C and holds min(len_n - j C, C) tokens; slots no
sequence takes hold (0, 0).

Layout. ``cu_seqlens`` [N + 1] int32 or int64, any stride (read through ``stride_cu``);
``chunks`` [NC, 2] int64, NC = ceil(T / C) + N,
(first token, token count) per slot; ``seq_chunks`` [N + 1] int64, the first slot of each
sequence and the end, clamped to NC (malformed offsets can ask for more slots than NC: the
tables then stop at NC, and every chunk still lies inside the T tokens).

Grid. One program per BS slots, each walking all N sequences in blocks of BN with a running
slot count: a [BS, BN] comparison finds each slot's sequence (at most one matches), so no
program reads what another writes. Program 0 also writes ``seq_chunks``. Integer arithmetic
only: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

_BS = 128  # slots per program
_BN = 64  # sequences per step of the walk


@triton.jit
def _varlen_chunks_kernel(
    cu_seqlens,
    chunks,
    seq_chunks,
    T,
    N,
    NC,
    stride_cu,
    C: tl.constexpr,
    BS: tl.constexpr,
    BN: tl.constexpr,
):
    pid = tl.program_id(0)
    slot = pid * BS + tl.arange(0, BS).to(tl.int64)
    start = tl.zeros([BS], dtype=tl.int64)
    count = tl.zeros([BS], dtype=tl.int64)
    taken = tl.zeros([BN], dtype=tl.int64)  # slots of the sequences walked so far
    for n0 in range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        live = n < N
        lo = tl.load(cu_seqlens + n * stride_cu, mask=live, other=0).to(tl.int64)
        hi = tl.load(cu_seqlens + (n + 1) * stride_cu, mask=live, other=0).to(tl.int64)
        lo = tl.minimum(tl.maximum(lo, 0), T)
        hi = tl.minimum(tl.maximum(hi, 0), T)
        length = tl.where(live, tl.maximum(hi - lo, 0), 0)
        k = (length + C - 1) // C
        end = taken + tl.cumsum(k, 0)  # one past each sequence's last slot
        first = end - k
        if pid == 0:
            tl.store(seq_chunks + 1 + n, tl.minimum(end, NC), mask=live)
        hit = (first[None, :] <= slot[:, None]) & (slot[:, None] < end[None, :])
        local = (slot[:, None] - first[None, :]) * C
        start += tl.sum(tl.where(hit, lo[None, :] + local, 0), 1)
        count += tl.sum(tl.where(hit, tl.minimum(length[None, :] - local, C), 0), 1)
        taken += tl.sum(k, 0)
    inside = slot < NC
    tl.store(chunks + 2 * slot, start, mask=inside)
    tl.store(chunks + 2 * slot + 1, count, mask=inside)
    if pid == 0:
        tl.store(seq_chunks, tl.zeros([], dtype=tl.int64))


def varlen_chunks(
    cu_seqlens: torch.Tensor,
    T: int,
    chunk_size: int,
    chunks: torch.Tensor,
    seq_chunks: torch.Tensor,
) -> None:
    """Fill ``chunks`` [NC, 2] and ``seq_chunks`` [N + 1] (int64) from ``cu_seqlens``."""
    NC, N = chunks.shape[0], cu_seqlens.shape[0] - 1
    wrap_triton(_varlen_chunks_kernel)[(triton.cdiv(NC, _BS),)](
        cu_seqlens,
        chunks,
        seq_chunks,
        T,
        N,
        NC,
        cu_seqlens.stride(0),
        C=chunk_size,
        BS=_BS,
        BN=_BN,
        num_warps=4,
    )
