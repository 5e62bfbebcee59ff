"""Plain PyTorch implementations of everything sdm_ops computes.

The functions re-exported here are the CPU path of every ``sdm_internal::`` operator and the
oracle of every kernel test.
They are vectorized over streams (``P = B * H``) and within a chunk, and loop over chunks only
(the token-by-token recurrence loops over tokens). They work in float32 or float64 and are
differentiable with autograd (products of decays are computed with ``prod`` and ``cumprod``,
never by division, so decays of exactly 0 are fine).

Conventions shared with the kernels:

* Streams are ``[P, T, ...]`` after :func:`to_streams`; chunk ``n`` of a stream holds tokens
  ``n * C ... n * C + C - 1``; tokens past ``T`` in the last chunk are padding.
* An index of ``-1`` is padding: its weight and decay are ignored. Callers validate that every
  other index lies in ``[0, S)``; here any index outside ``[0, S)`` is treated as padding too.

Modules: ``token`` (the token-by-token oracle and one decode step), ``chunked`` (phase 1, the
snapshot quantization, the bank walk forward and backward, the chunked oracle), ``varlen``
(packed batches), ``product_key`` (top-k) and ``wy`` (the WY solve). The shared types and
constants live in :mod:`sdm_ops.layout`.
"""

from ..layout import FP8_MAX, INT4_MAX, QUANT_GROUP, SNAPSHOT_MODES, ChunkWeights, Prepared
from ._common import compute_dtype, from_streams, to_streams
from .chunked import (
    chunk_prepare_backward_reference,
    chunk_prepare_reference,
    chunk_weights,
    dequantize_rows,
    quantize_rows,
    recurrence_bwd_reference,
    recurrence_fwd_reference,
    sdm_chunked_reference,
)
from .product_key import (
    product_key_topk_backward_reference,
    product_key_topk_bruteforce,
    product_key_topk_reference,
)
from .token import decode_step_reference, sdm_token_reference
from .varlen import (
    chunk_prepare_backward_varlen_reference,
    chunk_prepare_varlen_reference,
    recurrence_bwd_varlen_reference,
    recurrence_fwd_varlen_reference,
    sdm_varlen_reference,
    varlen_chunks,
    varlen_sequences,
)
from .wy import wy_solve_backward_reference, wy_solve_reference

__all__ = [
    "FP8_MAX",
    "INT4_MAX",
    "QUANT_GROUP",
    "SNAPSHOT_MODES",
    "ChunkWeights",
    "Prepared",
    "compute_dtype",
    "from_streams",
    "to_streams",
    "chunk_prepare_backward_reference",
    "chunk_prepare_reference",
    "chunk_weights",
    "dequantize_rows",
    "quantize_rows",
    "recurrence_bwd_reference",
    "recurrence_fwd_reference",
    "sdm_chunked_reference",
    "product_key_topk_backward_reference",
    "product_key_topk_bruteforce",
    "product_key_topk_reference",
    "decode_step_reference",
    "sdm_token_reference",
    "chunk_prepare_backward_varlen_reference",
    "chunk_prepare_varlen_reference",
    "recurrence_bwd_varlen_reference",
    "recurrence_fwd_varlen_reference",
    "sdm_varlen_reference",
    "varlen_chunks",
    "varlen_sequences",
    "wy_solve_backward_reference",
    "wy_solve_reference",
]
