"""The inventory: every operator sdm_ops registers, in namespace ``sdm``.

Each operator is a ``torch.library.triton_op``. Its body launches Triton kernels (through the
launchers of ``sdm_ops.kernels``, which use ``wrap_triton``) when ``use_kernels`` says so (CUDA
tensors), and otherwise runs the reference of ``sdm_ops.reference``. Under ``torch.compile`` the
body is traced, so Inductor sees the user-defined Triton kernels themselves. Every operator has
an explicit fake in ``sdm_ops.meta``; differentiable ones register their backward, itself an
``sdm`` operator. Operators take contiguous inputs (the public functions make them so) and
return contiguous outputs; they do not validate arguments beyond what the kernels need.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.library import triton_op

from . import reference
from .kernels._common import use_kernels
from .meta import product_key_topk as product_key_topk_meta
from .meta import recurrence as recurrence_meta
from .meta import wy_solve as wy_solve_meta

# ---------------------------------------------------------------------------
# sdm::wy_solve
# ---------------------------------------------------------------------------


@triton_op("sdm::wy_solve", mutates_args=())
def wy_solve(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta A, -1))^-1, QX = tril(QK) X; A, QK [N, C, C], beta [N, C], float32."""
    if use_kernels(A):
        from .kernels import wy_solve as k
        X, QX = A.new_empty(A.shape), A.new_empty(A.shape)
        k.wy_solve_fwd(A, beta, QK, X, QX)
        return X, QX
    X, QX = reference.wy_solve_reference(A, beta, QK)
    return X.contiguous(), QX.contiguous()


@triton_op("sdm::wy_solve_backward", mutates_args=())
def wy_solve_backward(A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor,
                      dQX: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dbeta, dQK) of ``wy_solve`` (strict lower, [N, C], lower triangle)."""
    if use_kernels(A):
        from .kernels import wy_solve as k
        dA, dbeta, dQK = A.new_empty(A.shape), beta.new_empty(beta.shape), A.new_empty(A.shape)
        k.wy_solve_bwd(A, beta, QK, X, dX, dQX, dA, dbeta, dQK)
        return dA, dbeta, dQK
    dA, dbeta, dQK = reference.wy_solve_backward_reference(A, beta, QK, X, dX, dQX)
    return dA.contiguous(), dbeta.contiguous(), dQK.contiguous()


def _wy_solve_setup(ctx, inputs, output):
    A, beta, QK = inputs
    ctx.save_for_backward(A, beta, QK, output[0])


def _wy_solve_grad(ctx, dX, dQX):
    A, beta, QK, X = ctx.saved_tensors
    dX = torch.zeros_like(X) if dX is None else dX.contiguous()
    dQX = torch.zeros_like(X) if dQX is None else dQX.contiguous()
    return tuple(torch.ops.sdm.wy_solve_backward(A, beta, QK, X, dX, dQX))


wy_solve.register_fake(wy_solve_meta.wy_solve_fake)
wy_solve_backward.register_fake(wy_solve_meta.wy_solve_backward_fake)
wy_solve.register_autograd(_wy_solve_grad, setup_context=_wy_solve_setup)

# ---------------------------------------------------------------------------
# sdm::product_key_topk
# ---------------------------------------------------------------------------


@triton_op("sdm::product_key_topk", mutates_args=())
def product_key_topk(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys: raw [..., sum(factors)] -> (val, lin) [..., kk]."""
    kk = min(k, math.prod(factors))
    shape = (*raw.shape[:-1], kk)
    if use_kernels(raw):
        from .kernels import product_key_topk as kern
        val = raw.new_empty(shape)
        lin = raw.new_empty(shape, dtype=torch.int64)
        kern.product_key_topk_fwd(raw.reshape(-1, raw.shape[-1]), list(factors), k,
                                  val.view(-1, kk), lin.view(-1, kk))
        return val, lin
    val, lin = reference.product_key_topk_reference(raw, tuple(factors), k)
    return val.contiguous(), lin.contiguous()


@triton_op("sdm::product_key_topk_backward", mutates_args=())
def product_key_topk_backward(lin: Tensor, grad_val: Tensor, factors: list[int],
                              dtype: torch.dtype) -> Tensor:
    """grad_raw [..., sum(factors)] of ``product_key_topk``, in ``dtype``."""
    width = sum(factors)
    if use_kernels(lin):
        from .kernels import product_key_topk as kern
        grad = grad_val.new_empty((*lin.shape[:-1], width), dtype=dtype)
        kk = lin.shape[-1]
        kern.product_key_topk_bwd(lin.reshape(-1, kk), grad_val.reshape(-1, kk), list(factors),
                                  grad.view(-1, width))
        return grad
    grad = reference.product_key_topk_backward_reference(lin, grad_val, tuple(factors))
    return grad.to(dtype).contiguous()


def _topk_setup(ctx, inputs, output):
    raw, factors, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.factors = list(factors)
    ctx.dtype = raw.dtype


def _topk_grad(ctx, grad_val, _grad_lin):
    (lin,) = ctx.saved_tensors
    if grad_val is None:
        grad_val = torch.zeros(lin.shape, dtype=ctx.dtype, device=lin.device)
    grad = torch.ops.sdm.product_key_topk_backward(lin, grad_val.contiguous(), ctx.factors, ctx.dtype)
    return grad, None, None


product_key_topk.register_fake(product_key_topk_meta.product_key_topk_fake)
product_key_topk_backward.register_fake(product_key_topk_meta.product_key_topk_backward_fake)
product_key_topk.register_autograd(_topk_grad, setup_context=_topk_setup)

# ---------------------------------------------------------------------------
# The recurrence: sdm::chunk_prepare (phase 1), sdm::wy_solve, sdm::recurrence_fwd (phase 2)
# ---------------------------------------------------------------------------


@triton_op("sdm::chunk_prepare", mutates_args=())
def chunk_prepare(write_idx: Tensor, write_w: Tensor, read_idx: Tensor, read_w: Tensor,
                  decay: Tensor | None, bank_rows: int, chunk_size: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 1: (A, QK, gather_w, gather_r, scatter_w, row_decay, rank, read_rank); see
    ``kernels/chunk_prepare.py`` for the math and layouts."""
    if use_kernels(write_idx):
        from .kernels import chunk_prepare as k
        outs = recurrence_meta.chunk_prepare_fake(write_idx, write_w, read_idx, read_w, decay,
                                                  bank_rows, chunk_size)
        k.chunk_prepare(write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, *outs)
        return outs
    prep = reference.chunk_prepare_reference(write_idx, write_w, read_idx, read_w, decay,
                                             bank_rows, chunk_size)
    return tuple(x.contiguous() for x in prep)


@triton_op("sdm::recurrence_fwd", mutates_args=())
def recurrence_fwd(v: Tensor, beta: Tensor, write_idx: Tensor, read_idx: Tensor,
                   gather_w: Tensor, gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor,
                   rank: Tensor, X: Tensor, QX: Tensor, bank: Tensor, snapshot: str
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 2: (out, bank_out, snap, snap_scale, res, delta) from the initial ``bank``
    ([B, H, S, D] or shared [H, S, D]); see ``kernels/recurrence_fwd.py``."""
    if use_kernels(v):
        from .kernels import recurrence_fwd as k
        out, _, snap, snap_scale, res, delta = recurrence_meta.recurrence_fwd_fake(
            v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank, X, QX,
            bank, snapshot)
        B, H = v.shape[0], v.shape[2]
        bank_out = bank.expand(B, H, *bank.shape[-2:]).clone(memory_format=torch.contiguous_format)
        k.recurrence_fwd(v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay,
                         rank, X, QX, bank_out, out, res, delta, snap, snap_scale, snapshot)
        return out, bank_out, snap, snap_scale, res, delta
    prep = reference.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    res = reference.recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X, QX, bank, snapshot)
    out, bank_out, snap, snap_scale, resid, delta = res
    return (out.to(v.dtype).contiguous(), bank_out.to(bank.dtype).contiguous(), snap.contiguous(),
            snap_scale.contiguous(), resid.contiguous(), delta.contiguous())


@triton_op("sdm::recurrence_fwd_", mutates_args=("bank",))
def recurrence_fwd_(bank: Tensor, v: Tensor, beta: Tensor, write_idx: Tensor, read_idx: Tensor,
                    gather_w: Tensor, gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor,
                    rank: Tensor, X: Tensor, QX: Tensor) -> Tensor:
    """Phase 2 updating ``bank`` [B, H, S, D] in place, keeping nothing for a backward; returns
    out [B, T, H, D] in v's dtype."""
    if use_kernels(v):
        from .kernels import recurrence_fwd as k
        out = v.new_empty(v.shape)
        res = v.new_empty(v.shape, dtype=torch.float32)
        delta = v.new_empty(v.shape, dtype=torch.float32)
        k.recurrence_fwd(v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay,
                         rank, X, QX, bank, out, res, delta, None, None, None)
        return out
    prep = reference.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    out, bank_out = reference.recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X, QX,
                                                       bank)[:2]
    bank.copy_(bank_out)
    return out.to(v.dtype).contiguous()


chunk_prepare.register_fake(recurrence_meta.chunk_prepare_fake)
recurrence_fwd.register_fake(recurrence_meta.recurrence_fwd_fake)
recurrence_fwd_.register_fake(recurrence_meta.recurrence_fwd_inplace_fake)
