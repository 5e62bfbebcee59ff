"""Plain PyTorch implementations of everything sdm_ops computes (see :mod:`.chunked`)."""

from .chunked import *  # noqa: F403
from .chunked import (_chunked, chunk_prepare_backward_reference,  # noqa: F401
                      chunk_prepare_backward_varlen_reference, chunk_prepare_reference,
                      chunk_prepare_varlen_reference, decode_step_reference, dequantize_rows,
                      Prepared, quantize_rows, recurrence_bwd_reference,
                      recurrence_bwd_varlen_reference, recurrence_fwd_reference,
                      recurrence_fwd_varlen_reference, sdm_varlen_reference, to_streams,
                      varlen_chunks, varlen_sequences)
