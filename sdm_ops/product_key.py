"""Exact product-key top-k addressing: ``product_key_topk`` and its factor checks."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from . import _transforms, ops
from ._checks import check_int, check_tensor
from .ops import eager

MAX_FACTORS = 4
MAX_K = 256
MAX_FACTOR_WIDTH = 4096


class TopK(NamedTuple):
    val: Tensor
    lin: Tensor


def check_factors(factors) -> tuple[int, ...]:
    """``factors`` is a sequence of 1 to 4 ints in [1, 4096]; returns them as a tuple."""
    if isinstance(factors, (int, Tensor)) or not isinstance(factors, Sequence):
        raise TypeError(f"factors must be a sequence of ints, got {type(factors).__name__}")
    try:
        dims = tuple(operator.index(f) for f in factors)
    except TypeError:
        raise TypeError(f"factors must hold ints, got {list(factors)}") from None
    if not 1 <= len(dims) <= MAX_FACTORS:
        raise ValueError(f"factors must hold 1 to {MAX_FACTORS} sizes, got {list(dims)}")
    if any(isinstance(f, bool) or not 1 <= f <= MAX_FACTOR_WIDTH for f in factors):
        raise ValueError(f"factors must each be in [1, {MAX_FACTOR_WIDTH}], got {list(dims)}")
    return dims


def product_key_topk(raw: Tensor, factors: Sequence[int], k: int) -> TopK:
    """Exact top-k over every slot of a product key.

    Args:
        raw: ``[..., sum(factors)]`` float32 or bfloat16: F score blocks side by side, block f
            holding ``factors[f]`` columns. Any leading dimensions.
        factors: F sizes, 1 <= F <= 4, each in [1, 4096]. The product space has
            ``prod(factors)`` slots; slot ``(c_0, ..., c_{F-1})`` scores the float32 sum of
            column ``c_f`` of every block f, added in factor order.
        k: 1 <= k <= 256.

    Returns:
        ``TopK(val, lin)``, each ``[..., kk]`` with ``kk = min(k, prod(factors))``. ``lin``
        (int64) holds the row-major slot indices ``(..(c_0 * factors[1] + c_1)..) *
        factors[F-1] + c_{F-1}``, strictly ascending; ``val`` their scores in ``raw.dtype``,
        differentiable with respect to ``raw`` (sparse, deterministic backward).

    Tie rule (deterministic, and the reason the selection is exact): factor 0 ranks its columns
    by value, larger first, equal values to the smaller column. The tuples of factors 0..f rank
    by score, larger first; equal scores go to the better rank of the prefix 0..f-1, then to
    the better rank of factor f's column. Scores compare as numbers with NaN counted as -inf
    and -0 equal to +0. The kk best slots under this order are returned.

    Example::

        >>> raw = torch.randn(4, 10, 32 + 32)
        >>> val, lin = sdm_ops.product_key_topk(raw, (32, 32), k=8)
        >>> val.shape, lin.shape, lin.dtype
        (torch.Size([4, 10, 8]), torch.Size([4, 10, 8]), torch.int64)
    """
    check_tensor("raw", raw, dtypes=(torch.float32, torch.bfloat16))
    _transforms.check("product_key_topk", raw)
    dims = check_factors(factors)
    check_int("k", k, low=1, high=MAX_K)
    if raw.dim() < 1 or raw.shape[-1] != sum(dims):
        raise ValueError(
            f"raw must have sum(factors) = {sum(dims)} columns in its last "
            f"dimension, got shape {list(raw.shape)}"
        )
    val, lin = eager.call(ops.product_key_topk_route, raw, list(dims), k)
    return TopK(val, lin)


def product_space(factors: Sequence[int]) -> int:
    """Number of slots addressed by ``factors``."""
    return math.prod(check_factors(factors))
