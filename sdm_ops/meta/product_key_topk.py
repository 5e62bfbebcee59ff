"""Fakes of ``sdm::product_key_topk`` and ``sdm_internal::product_key_topk_backward``."""

import math

import torch
from torch import Tensor


def product_key_topk_fake(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    kk = min(k, math.prod(factors))
    shape = (*raw.shape[:-1], kk)
    return raw.new_empty(shape), raw.new_empty(shape, dtype=torch.int64)


def product_key_topk_backward_fake(
    lin: Tensor, grad_val: Tensor, factors: list[int], dtype: torch.dtype
) -> Tensor:
    return grad_val.new_empty((*lin.shape[:-1], sum(factors)), dtype=dtype)
