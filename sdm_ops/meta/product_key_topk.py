"""Fakes of ``sdm::product_key_topk`` and ``sdm_internal::product_key_topk_backward``, each of
the operator's arguments as one value ``a``."""

import math

import torch
from torch import Tensor


def product_key_topk_fake(a) -> tuple[Tensor, Tensor]:
    """(val in raw's dtype, lin int64), each [..., min(k, prod(factors))]."""
    shape = (*a.raw.shape[:-1], min(a.k, math.prod(a.factors)))
    return a.raw.new_empty(shape), a.raw.new_empty(shape, dtype=torch.int64)


def product_key_topk_backward_fake(a) -> Tensor:
    """grad_raw [..., sum(factors)] in ``dtype``."""
    return a.grad_val.new_empty((*a.lin.shape[:-1], sum(a.factors)), dtype=a.dtype)
