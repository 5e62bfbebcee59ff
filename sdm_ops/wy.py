"""The per-chunk WY solve of the chunked recurrence (docs/design.md, section 2)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import _transforms, ops
from ._checks import check_same_device, check_shape, check_tensor
from .ops import eager


class WYSolution(NamedTuple):
    X: Tensor
    QX: Tensor


def wy_solve(A: Tensor, beta: Tensor, QK: Tensor) -> WYSolution:
    """Per chunk, ``X = (I + tril(diag(beta) A, -1))^-1`` and ``QX = tril(QK) X``.

    Args:
        A: ``[N, C, C]`` float32; only the strict lower triangle is read.
        beta: ``[N, C]`` float32.
        QK: ``[N, C, C]`` float32; only the lower triangle (diagonal included) is read.

    Returns:
        ``WYSolution(X, QX)``, each ``[N, C, C]`` float32 contiguous: ``X`` unit lower
        triangular, both zero above the diagonal. Differentiable in ``A``, ``beta`` and ``QK``
        (the gradients of ``A`` and ``QK`` are zero where they are not read). All dots are full
        float32; the result is bitwise deterministic. The kernels skip the products of 16 x 16
        tiles of ``A``, ``QK`` and ``X`` that hold only zeros and of the blocks of ``X`` that
        are the identity, so an inf or NaN does not reach through those zeros (as in a sparse
        matrix product).

    Example::

        >>> A, QK = torch.randn(2, 3, 16, 16).unbind(0)
        >>> X, QX = sdm_ops.wy_solve(A, torch.rand(3, 16), QK)
        >>> X.shape, bool((X.diagonal(dim1=1, dim2=2) == 1).all())
        (torch.Size([3, 16, 16]), True)
    """
    check_tensor("A", A, ndim=3, dtypes=(torch.float32,))
    _transforms.check("wy_solve", A, beta, QK)
    check_tensor("beta", beta, ndim=2, dtypes=(torch.float32,))
    check_tensor("QK", QK, ndim=3, dtypes=(torch.float32,))
    n, c = A.shape[0], A.shape[1]
    check_shape("A", A, (n, c, c), "[N, C, C]")
    check_shape("beta", beta, (n, c), "[N, C]")
    check_shape("QK", QK, (n, c, c), "[N, C, C]")
    check_same_device({"A": A, "beta": beta, "QK": QK})
    X, QX = eager.call(ops.wy_solve_route, A, beta, QK)
    return WYSolution(X, QX)
