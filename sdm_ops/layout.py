"""Types and constants shared by the operators, the reference, the kernels and the fakes.

``Prepared`` and ``PairLists`` are the ``sdm_internal::chunk_prepare`` operator's output
contract and ``ChunkWeights`` the per-chunk form the reference builds ``Prepared`` from; the
snapshot constants fix the storage of the chunk-start bank rows that the forward keeps for the
backward. The module imports no torch, so that the commands' argument parsers can name the
supported sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "CHUNK_SIZES",
    "FP8_MAX",
    "HEAD_DIMS",
    "INT4_MAX",
    "MAX_ENTRIES",
    "PAIR_POSITIONS_MAX",
    "QUANT_GROUP",
    "SKIP_SNAPSHOT",
    "SNAPSHOT_MODES",
    "ChunkWeights",
    "PairLists",
    "Prepared",
    "pair_positions",
]

CHUNK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (16, 32, 64, 128, 256)  # D, a bank row's width
MAX_ENTRIES = 64  # W and R, the write and read entries of a token
SNAPSHOT_MODES = ("none", "bf16", "fp8", "int4")
# The internal phase 2's mode for a forward that nothing differentiates: no snapshot at all.
SKIP_SNAPSHOT = "skip"
QUANT_GROUP = 16  # columns sharing one scale in the fp8 and int4 snapshots
FP8_MAX = 448.0  # largest float8_e4m3fn
INT4_MAX = 7.0  # int4 codes are round(x / scale) in [-7, 7], stored + 8
# Phase 1's sparse path runs when a chunk has at most this many entry positions.
PAIR_POSITIONS_MAX = 2048


def pair_positions(W: int, R: int, C: int) -> int:
    """Entry positions a chunk has on phase 1's sparse path, 2 EM C with EM the next power of
    2 of max(W, R) (a token's write entries, then its read entries), or 0 where there are more
    than ``PAIR_POSITIONS_MAX`` (no sparse path): the last dimension of the pair lists that
    ``sdm_internal::chunk_prepare`` returns for its backward."""
    em = 1 << (max(W, R, 1) - 1).bit_length()
    n = 2 * em * C
    return n if n <= PAIR_POSITIONS_MAX else 0


class Prepared(NamedTuple):
    """Phase-1 outputs for every chunk (the ``sdm_internal::chunk_prepare`` operator's contract).

    A, QK: [B, H, N, C, C] (N = ceil(T / C) chunks); gather_w, scatter_w, row_decay: [B, T, H, W];
    gather_r: [B, T, H, R]; all float (compute dtype). rank [B, T, H, W] and read_rank
    [B, T, H, R]: int32 (see ChunkWeights). Padding entries have weight 0, decay 1 and rank 0.
    """

    A: Tensor
    QK: Tensor
    gather_w: Tensor
    gather_r: Tensor
    scatter_w: Tensor
    row_decay: Tensor
    rank: Tensor
    read_rank: Tensor


class PairLists(NamedTuple):
    """What phase 1's sparse path sorted, for its backward, which then does not sort again
    (``sdm_internal::chunk_prepare``'s last two outputs; P streams, N chunks or chunk slots).

    count: [P, N] int32, the chunk's entries that share a hash bucket with another (the pairs
    kernels' compact list), or -1 where the dense kernels take the chunk: a bucket of more
    entries than the pairs kernels' window, or no sparse path. The backward is right for any
    chunk marked -1, so all -1 is a valid table (the CPU twin's).
    entries: [P, N, pair_positions(W, R, C)] int32, the chunk's entry positions, the compact
    list first (in hash-bucket order), then the others.
    """

    count: Tensor
    entries: Tensor


class ChunkWeights(NamedTuple):
    """Everything the bank-free first phase derives from one chunk of every stream.

    Shapes use P streams, C tokens, W write and R read entries per token.
    A, QK: [P, C, C] (strict lower / lower triangle, zero elsewhere);
    gather_w: [P, C, W], write weight times the decay from the chunk start through its token;
    gather_r: [P, C, R], the same for read entries (decays of the write entries);
    scatter_w: [P, C, W], write weight times the decay after its token to the chunk end;
    row_decay: [P, C, W], the whole chunk's decay product on the entry's slot;
    rank: [P, C, W] int64, how many earlier (token-major) entries of the chunk share the slot;
    read_rank: [P, C, R] int64, the same among the read entries;
    slot / rslot: [P, C, W] / [P, C, R] int64 slots, -1 for padding.
    """

    A: Tensor
    QK: Tensor
    gather_w: Tensor
    gather_r: Tensor
    scatter_w: Tensor
    row_decay: Tensor
    rank: Tensor
    read_rank: Tensor
    slot: Tensor
    rslot: Tensor
