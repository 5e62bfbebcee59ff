"""Fakes of ``sdm::wy_solve`` and ``sdm_internal::wy_solve_backward``."""

from torch import Tensor


def wy_solve_fake(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    return A.new_empty(A.shape), A.new_empty(A.shape)


def wy_solve_backward_fake(
    A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor, dQX: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return A.new_empty(A.shape), beta.new_empty(beta.shape), A.new_empty(A.shape)
