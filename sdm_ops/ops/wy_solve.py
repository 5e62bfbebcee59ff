"""The WY solve: ``sdm::wy_solve`` and its backward ``sdm_internal::wy_solve_backward``
(kernels in ``sdm_ops.kernels.wy_solve``, fakes in ``sdm_ops.meta.wy_solve``)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from ..kernels._common import on_device
from ..meta import wy_solve as meta
from . import eager
from ._define import kernel_op

# ---------------------------------------------------------------------------
# sdm::wy_solve
# ---------------------------------------------------------------------------


@kernel_op("sdm::wy_solve", on="A", contiguous=True, fake=meta.wy_solve_fake)
def _wy_solve(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta A, -1))^-1, QX = tril(QK) X; A, QK [N, C, C], beta [N, C], float32."""


@_wy_solve.kernels
def _wy_solve_kernels(a) -> tuple[Tensor, Tensor]:
    from ..kernels import wy_solve as k

    X, QX = meta.wy_solve_fake(a)
    with on_device(a.A):
        k.wy_solve_fwd(a.A, a.beta, a.QK, X, QX)
    return X, QX


@_wy_solve.reference
def _wy_solve_cpu(a) -> tuple[Tensor, Tensor]:
    X, QX = reference.wy_solve_reference(a.A, a.beta, a.QK)
    return X.contiguous(), QX.contiguous()


wy_solve = _wy_solve.op


# ---------------------------------------------------------------------------
# sdm_internal::wy_solve_pairs: the recurrence's solve, given phase 1's pair lists
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::wy_solve_pairs", on="A", fake=meta.wy_solve_fake)
def _wy_solve_pairs(
    A: Tensor, beta: Tensor, QK: Tensor, pair_count: Tensor, pair_entries: Tensor
) -> tuple[Tensor, Tensor]:
    """``sdm::wy_solve`` of phase 1's chunks (A, QK [N, C, C], beta [N, C], contiguous), given
    their pair lists (``layout.PairLists`` flattened to the chunks: pair_count [N], pair_entries
    [N, NP]): a chunk whose list is one window is solved from it, the others by the diag and
    panel kernels (``kernels/wy_solve.py``, "The pairs solve"). No autograd: the recurrence's
    backward carries the solve's gradient itself."""


@_wy_solve_pairs.kernels
def _wy_solve_pairs_kernels(a) -> tuple[Tensor, Tensor]:
    from ..kernels import wy_solve as k

    X, QX = meta.wy_solve_fake(a)
    with on_device(a.A):
        k.wy_solve_fwd(a.A, a.beta, a.QK, X, QX, (a.pair_count, a.pair_entries))
    return X, QX


# The twin is sdm::wy_solve's: the pair lists choose a kernel, not the result.
_wy_solve_pairs.reference(_wy_solve_cpu)


wy_solve_pairs = _wy_solve_pairs.op


# ---------------------------------------------------------------------------
# sdm_internal::wy_solve_backward
# ---------------------------------------------------------------------------


@kernel_op("sdm_internal::wy_solve_backward", on="A", fake=meta.wy_solve_backward_fake)
def _wy_solve_backward(
    A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor, dQX: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dbeta, dQK) of ``wy_solve`` (strict lower, [N, C], lower triangle)."""


@_wy_solve_backward.kernels
def _wy_solve_backward_kernels(a) -> tuple[Tensor, Tensor, Tensor]:
    from ..kernels import wy_solve as k

    dA, dbeta, dQK = meta.wy_solve_backward_fake(a)
    with on_device(a.A):
        k.wy_solve_bwd(*a, dA, dbeta, dQK)
    return dA, dbeta, dQK


@_wy_solve_backward.reference
def _wy_solve_backward_cpu(a) -> tuple[Tensor, Tensor, Tensor]:
    dA, dbeta, dQK = reference.wy_solve_backward_reference(*a)
    return dA.contiguous(), dbeta.contiguous(), dQK.contiguous()


wy_solve_backward = _wy_solve_backward.op


# ---------------------------------------------------------------------------
# The autograd of sdm::wy_solve
# ---------------------------------------------------------------------------


def _wy_solve_setup(ctx, inputs, output):
    A, beta, QK = inputs
    ctx.save_for_backward(A, beta, QK, output[0])


def _wy_solve_grad(ctx, dX, dQX):
    eager.no_double_backward("wy_solve")
    A, beta, QK, X = ctx.saved_tensors
    dX = torch.zeros_like(X) if dX is None else dX.contiguous()
    dQX = torch.zeros_like(X) if dQX is None else dQX.contiguous()
    solve_backward = eager.in_backward(_wy_solve_backward, eager.eager_backward(X))
    return tuple(solve_backward(A.contiguous(), beta.contiguous(), QK.contiguous(), X, dX, dQX))


wy_solve_route = eager.route(
    "sdm::wy_solve", wy_solve, _wy_solve, setup=_wy_solve_setup, backward=_wy_solve_grad
)
