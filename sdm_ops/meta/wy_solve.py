"""Fakes of ``sdm::wy_solve`` and ``sdm_internal::wy_solve_backward``, each of the operator's
arguments as one value ``a``."""

from torch import Tensor


def wy_solve_fake(a) -> tuple[Tensor, Tensor]:
    """(X, QX), as A."""
    return a.A.new_empty(a.A.shape), a.A.new_empty(a.A.shape)


def wy_solve_backward_fake(a) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dbeta, dQK), as A, beta and A."""
    return a.A.new_empty(a.A.shape), a.beta.new_empty(a.beta.shape), a.A.new_empty(a.A.shape)
