"""The operators sdm_ops registers, and the routes the public functions take to them.

Namespace ``sdm`` (``torch.ops.sdm``) holds the public operators, one for each public
function, which reaches it through ``eager.call`` and the operator's route after checking its
arguments:

* ``sdm::sparse_delta_memory(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None,
  chunk_size=64, snapshot="none", cu_seqlens=None, output_final_state=False, *,
  keep_for_backward=True) -> (out, bank_out, kept)``: the recurrence, functional. ``kept``
  holds what its backward reads (``KEPT_FOR_BACKWARD``, then without the final state the
  working set's layout, ``working_set.WorkingRows``; empty with ``keep_for_backward=False``,
  which keeps no snapshot). ``bank_out`` is the final state with ``output_final_state``, else
  an empty tensor: phase 2 then runs on the working set of touched rows.
* ``sdm::sparse_delta_memory_(v, beta, write_idx, write_w, read_idx, read_w, bank(a!),
  decay=None, chunk_size=64, cu_seqlens=None) -> out``: the recurrence updating ``bank``.
* ``sdm::product_key_topk(raw, factors, k) -> (val, lin)``.
* ``sdm::wy_solve(A, beta, QK) -> (X, QX)``.

Namespace ``sdm_internal`` holds the pieces they run, which take contiguous inputs: the chunk
tables of a packed batch (``varlen_chunks``), the finite inputs of phase 1 (``finite_select``),
phase 1 (``chunk_prepare``), the recurrence's WY solve given phase 1's pair lists
(``wy_solve_pairs``), phase 2
(``recurrence_fwd``; ``recurrence_fwd_`` in place), the bank copy (``bank_copy``), the decode
step (``decode_step_``), the backward operators (``wy_solve_backward``,
``product_key_topk_backward``, ``recurrence_bwd``, ``chunk_prepare_backward``), the working
set's bank gradient (``rows_to_bank``) and the CPU twins ``<op>_reference``.

Each operator is a ``torch.library.triton_op``. The body of an operator with a CPU twin
(``_define.kernel_op``) launches Triton kernels (through the launchers of ``sdm_ops.kernels``,
which use ``wrap_triton``) when ``use_kernels`` says so (CUDA tensors), and otherwise calls
``sdm_internal::<op>_reference``, an opaque ``custom_op`` running the reference of
``sdm_ops.reference``. Every operator has an explicit fake in ``sdm_ops.meta``; the kernel
paths allocate their outputs with those same functions, so fake and real layouts cannot drift
apart. The public operators take inputs of any dense layout (they make them contiguous) and
every operator returns contiguous outputs; none validates arguments beyond what the kernels
need. How eager calls skip the dispatcher: ``eager``.

Modules: ``recurrence`` (the public recurrence operators and their autograd), ``phases`` (the
recurrence's internal operators), ``wy_solve``, ``product_key_topk``, ``eager`` (the path
around the dispatcher), ``_define`` (an operator with a CPU twin, declared once; the package's
source hash in torch.compile's cache keys, ``key_compile_caches``).
"""

from . import eager
from ._define import INTERNAL, PUBLIC, key_compile_caches
from .phases import (
    bank_copy,
    chunk_prepare,
    chunk_prepare_backward,
    decode_step_,
    finite_select,
    recurrence_bwd,
    recurrence_fwd,
    recurrence_fwd_,
    rows_to_bank,
    varlen_chunks,
)
from .product_key_topk import product_key_topk, product_key_topk_backward, product_key_topk_route
from .recurrence import (
    KEPT_FOR_BACKWARD,
    sparse_delta_memory,
    sparse_delta_memory_,
    sparse_delta_memory_inplace_route,
    sparse_delta_memory_route,
)
from .wy_solve import wy_solve, wy_solve_backward, wy_solve_pairs, wy_solve_route

# Graphs torch.compile cached for another version of this package are not reused.
COMPILE_CACHE_TAG = key_compile_caches()

__all__ = [
    "COMPILE_CACHE_TAG",
    "INTERNAL",
    "KEPT_FOR_BACKWARD",
    "PUBLIC",
    # sdm::, with the routes the public functions take (eager.call)
    "sparse_delta_memory",
    "sparse_delta_memory_route",
    "sparse_delta_memory_",
    "sparse_delta_memory_inplace_route",
    "product_key_topk",
    "product_key_topk_route",
    "wy_solve",
    "wy_solve_route",
    # sdm_internal::
    "varlen_chunks",
    "finite_select",
    "chunk_prepare",
    "chunk_prepare_backward",
    "bank_copy",
    "recurrence_fwd",
    "recurrence_fwd_",
    "recurrence_bwd",
    "rows_to_bank",
    "decode_step_",
    "wy_solve_backward",
    "wy_solve_pairs",
    "product_key_topk_backward",
    "eager",
]
