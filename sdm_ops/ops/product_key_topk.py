"""Product-key top-k: ``sdm::product_key_topk`` and its backward
``sdm_internal::product_key_topk_backward`` (kernels in ``sdm_ops.kernels.product_key_topk``,
fakes in ``sdm_ops.meta.product_key_topk``)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import reference
from ..kernels._common import on_device
from ..meta import product_key_topk as meta
from . import eager
from ._define import kernel_op

# ---------------------------------------------------------------------------
# sdm::product_key_topk
# ---------------------------------------------------------------------------


@kernel_op("sdm::product_key_topk", on="raw", contiguous=True, fake=meta.product_key_topk_fake)
def _product_key_topk(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys: raw [..., sum(factors)] -> (val, lin) [..., kk]."""


@_product_key_topk.kernels
def _product_key_topk_kernels(a) -> tuple[Tensor, Tensor]:
    from ..kernels import product_key_topk as k

    val, lin = meta.product_key_topk_fake(a)
    kk = val.shape[-1]
    with on_device(a.raw):
        k.product_key_topk_fwd(
            a.raw.reshape(-1, a.raw.shape[-1]),
            list(a.factors),
            a.k,
            val.view(-1, kk),
            lin.view(-1, kk),
        )
    return val, lin


@_product_key_topk.reference
def _product_key_topk_cpu(a) -> tuple[Tensor, Tensor]:
    val, lin = reference.product_key_topk_reference(a.raw, tuple(a.factors), a.k)
    return val.contiguous(), lin.contiguous()


product_key_topk = _product_key_topk.op


# ---------------------------------------------------------------------------
# sdm_internal::product_key_topk_backward
# ---------------------------------------------------------------------------


@kernel_op(
    "sdm_internal::product_key_topk_backward", on="lin", fake=meta.product_key_topk_backward_fake
)
def _product_key_topk_backward(
    lin: Tensor, grad_val: Tensor, factors: list[int], dtype: torch.dtype
) -> Tensor:
    """grad_raw [..., sum(factors)] of ``product_key_topk``, in ``dtype``."""


@_product_key_topk_backward.kernels
def _product_key_topk_backward_kernels(a) -> Tensor:
    from ..kernels import product_key_topk as k

    grad = meta.product_key_topk_backward_fake(a)
    kk, width = a.lin.shape[-1], grad.shape[-1]
    with on_device(a.lin):
        k.product_key_topk_bwd(
            a.lin.reshape(-1, kk), a.grad_val.reshape(-1, kk), list(a.factors), grad.view(-1, width)
        )
    return grad


@_product_key_topk_backward.reference
def _product_key_topk_backward_cpu(a) -> Tensor:
    grad = reference.product_key_topk_backward_reference(a.lin, a.grad_val, tuple(a.factors))
    return grad.to(a.dtype).contiguous()


product_key_topk_backward = _product_key_topk_backward.op


# ---------------------------------------------------------------------------
# The autograd of sdm::product_key_topk
# ---------------------------------------------------------------------------


def _topk_setup(ctx, inputs, output):
    raw, factors, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.factors = list(factors)
    ctx.dtype = raw.dtype


def _topk_grad(ctx, grad_val, _grad_lin):
    eager.no_double_backward("product_key_topk")
    (lin,) = ctx.saved_tensors
    if grad_val is None:
        grad_val = torch.zeros(lin.shape, dtype=ctx.dtype, device=lin.device)
    backward = eager.in_backward(_product_key_topk_backward, eager.eager_backward(lin))
    grad = backward(lin, grad_val.contiguous(), ctx.factors, ctx.dtype)
    return grad, None, None


product_key_topk_route = eager.route(
    "sdm::product_key_topk",
    product_key_topk,
    _product_key_topk,
    setup=_topk_setup,
    backward=_topk_grad,
)
