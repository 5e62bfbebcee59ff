"""The WY solve of a chunk, (I + diag(beta) A)^-1 applied to diag(beta) and QK, and its
backward."""

from __future__ import annotations

import torch
from torch import Tensor


def wy_solve_reference(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta[:, None] * A, -1))^-1 and QX = tril(QK) @ X per chunk.

    A, QK: [N, C, C]; beta: [N, C]. Only the strict lower triangle of A and the lower triangle
    of QK are read. Returns X (unit lower triangular) and QX, [N, C, C], zero above the diagonal.
    """
    n, c, _ = A.shape
    eye = torch.eye(c, dtype=A.dtype, device=A.device).expand(n, c, c)
    m = eye + torch.tril(beta.reshape(n, c, 1) * A, -1)
    X = torch.linalg.solve_triangular(m, eye, upper=False, unitriangular=True)
    QX = torch.tril(QK) @ X
    return X, QX


def wy_solve_backward_reference(
    A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor, dQX: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`wy_solve_reference` given X and the output gradients.

    With M = I + L: dQK = tril(dQX X^T), dM = -X^T (dX + tril(QK)^T dQX) X^T, dA = beta * dM
    and dbeta = rowsum(dM * A), both over the strict lower triangle. Only the lower triangles of
    dX and dQX can reach the result, since X and QX are structurally zero above the diagonal.
    """
    n, c, _ = A.shape
    Xt = X.transpose(1, 2)
    dQK = torch.tril(dQX @ Xt)
    dM = -(Xt @ (dX + torch.tril(QK).transpose(1, 2) @ dQX) @ Xt)
    dL = torch.tril(dM, -1)
    dA = dL * beta.reshape(n, c, 1)
    dbeta = (dL * A).sum(-1)
    return dA, dbeta.reshape(beta.shape), dQK
