"""The inventory: every operator sdm_ops registers, in namespace ``sdm``.

Each operator is a ``torch.library.triton_op``. Its body launches Triton kernels (through the
launchers of ``sdm_ops.kernels``, which use ``wrap_triton``) when ``use_kernels`` says so (CUDA
tensors), and otherwise calls ``sdm::<op>_reference``, an opaque ``custom_op`` running the
reference of ``sdm_ops.reference``. Under ``torch.compile`` the body is traced, so Inductor sees
the user-defined Triton kernels themselves (and, on CPU, one call of the reference operator).
Every operator has an explicit fake in ``sdm_ops.meta``; the kernel branches allocate their
outputs with those same functions, so fake and real layouts cannot drift apart. Differentiable
operators register their backward, itself an ``sdm`` operator. Operators take contiguous inputs
(the public functions make them so) and return contiguous outputs; they do not validate
arguments beyond what the kernels need.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.library import triton_op

from . import reference
from .kernels._common import on_device, use_kernels
from .meta import product_key_topk as product_key_topk_meta
from .meta import recurrence as recurrence_meta
from .meta import wy_solve as wy_solve_meta


def _reference_op(name: str, fn, fake, mutates_args=()):
    """Register ``fn`` (the reference) as the opaque custom op ``sdm::<name>_reference``.

    The CPU branch of a triton_op body calls it: torch.compile traces triton_op bodies, and
    tracing the reference itself would unroll its loop over chunks (a recompilation for every
    chunk count); an opaque op with a fake compiles once for all shapes."""
    op = torch.library.custom_op(f"sdm::{name}_reference", fn, mutates_args=mutates_args)
    op.register_fake(fake)
    return op


# ---------------------------------------------------------------------------
# sdm::wy_solve
# ---------------------------------------------------------------------------


def _wy_solve_cpu(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm::wy_solve``: the reference."""
    X, QX = reference.wy_solve_reference(A, beta, QK)
    return X.contiguous(), QX.contiguous()


_wy_solve_reference = _reference_op("wy_solve", _wy_solve_cpu, wy_solve_meta.wy_solve_fake, ())


@triton_op("sdm::wy_solve", mutates_args=())
def wy_solve(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta A, -1))^-1, QX = tril(QK) X; A, QK [N, C, C], beta [N, C], float32."""
    if use_kernels(A):
        from .kernels import wy_solve as k
        X, QX = A.new_empty(A.shape), A.new_empty(A.shape)
        with on_device(A):
            k.wy_solve_fwd(A, beta, QK, X, QX)
        return X, QX
    return _wy_solve_reference(A, beta, QK)


def _wy_solve_backward_cpu(A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor,
                           dQX: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm::wy_solve_backward``: the reference."""
    dA, dbeta, dQK = reference.wy_solve_backward_reference(A, beta, QK, X, dX, dQX)
    return dA.contiguous(), dbeta.contiguous(), dQK.contiguous()


_wy_solve_backward_reference = _reference_op(
    "wy_solve_backward", _wy_solve_backward_cpu, wy_solve_meta.wy_solve_backward_fake, ())


@triton_op("sdm::wy_solve_backward", mutates_args=())
def wy_solve_backward(A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor,
                      dQX: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dbeta, dQK) of ``wy_solve`` (strict lower, [N, C], lower triangle)."""
    if use_kernels(A):
        from .kernels import wy_solve as k
        dA, dbeta, dQK = A.new_empty(A.shape), beta.new_empty(beta.shape), A.new_empty(A.shape)
        with on_device(A):
            k.wy_solve_bwd(A, beta, QK, X, dX, dQX, dA, dbeta, dQK)
        return dA, dbeta, dQK
    return _wy_solve_backward_reference(A, beta, QK, X, dX, dQX)


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


def _product_key_topk_cpu(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm::product_key_topk``: the reference."""
    val, lin = reference.product_key_topk_reference(raw, tuple(factors), k)
    return val.contiguous(), lin.contiguous()


_product_key_topk_reference = _reference_op(
    "product_key_topk", _product_key_topk_cpu, product_key_topk_meta.product_key_topk_fake, ())


@triton_op("sdm::product_key_topk", mutates_args=())
def product_key_topk(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys: raw [..., sum(factors)] -> (val, lin) [..., kk]."""
    kk = min(k, math.prod(factors))
    shape = (*raw.shape[:-1], kk)
    if use_kernels(raw):
        from .kernels import product_key_topk as kern
        val = raw.new_empty(shape)
        lin = raw.new_empty(shape, dtype=torch.int64)
        with on_device(raw):
            kern.product_key_topk_fwd(raw.reshape(-1, raw.shape[-1]), list(factors), k,
                                      val.view(-1, kk), lin.view(-1, kk))
        return val, lin
    return _product_key_topk_reference(raw, factors, k)


def _product_key_topk_backward_cpu(lin: Tensor, grad_val: Tensor, factors: list[int],
                                   dtype: torch.dtype) -> Tensor:
    """The CPU path of ``sdm::product_key_topk_backward``: the reference."""
    grad = reference.product_key_topk_backward_reference(lin, grad_val, tuple(factors))
    return grad.to(dtype).contiguous()


_product_key_topk_backward_reference = _reference_op(
    "product_key_topk_backward", _product_key_topk_backward_cpu,
    product_key_topk_meta.product_key_topk_backward_fake, ())


@triton_op("sdm::product_key_topk_backward", mutates_args=())
def product_key_topk_backward(lin: Tensor, grad_val: Tensor, factors: list[int],
                              dtype: torch.dtype) -> Tensor:
    """grad_raw [..., sum(factors)] of ``product_key_topk``, in ``dtype``."""
    width = sum(factors)
    if use_kernels(lin):
        from .kernels import product_key_topk as kern
        grad = grad_val.new_empty((*lin.shape[:-1], width), dtype=dtype)
        kk = lin.shape[-1]
        with on_device(lin):
            kern.product_key_topk_bwd(lin.reshape(-1, kk), grad_val.reshape(-1, kk), list(factors),
                                      grad.view(-1, width))
        return grad
    return _product_key_topk_backward_reference(lin, grad_val, factors, dtype)


def _topk_setup(ctx, inputs, output):
    raw, factors, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.factors = list(factors)
    ctx.dtype = raw.dtype


def _topk_grad(ctx, grad_val, _grad_lin):
    (lin,) = ctx.saved_tensors
    if grad_val is None:
        grad_val = torch.zeros(lin.shape, dtype=ctx.dtype, device=lin.device)
    grad = torch.ops.sdm.product_key_topk_backward(lin, grad_val.contiguous(), ctx.factors,
                                                   ctx.dtype)
    return grad, None, None


product_key_topk.register_fake(product_key_topk_meta.product_key_topk_fake)
product_key_topk_backward.register_fake(product_key_topk_meta.product_key_topk_backward_fake)
product_key_topk.register_autograd(_topk_grad, setup_context=_topk_setup)

# ---------------------------------------------------------------------------
# The recurrence: sdm::varlen_chunks (a packed batch's chunk tables), sdm::chunk_prepare
# (phase 1), sdm::wy_solve, sdm::recurrence_fwd (phase 2), sdm::decode_step_ (one token)
# ---------------------------------------------------------------------------


def _varlen_chunks_cpu(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm::varlen_chunks``: the reference."""
    chunks, seq_chunks = reference.varlen_chunks(cu_seqlens, T, chunk_size)
    return chunks.contiguous(), seq_chunks.contiguous()


_varlen_chunks_reference = _reference_op(
    "varlen_chunks", _varlen_chunks_cpu, recurrence_meta.varlen_chunks_fake, ())


@triton_op("sdm::varlen_chunks", mutates_args=())
def varlen_chunks(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The chunk tables of a packed batch, (chunks [NC, 2], seq_chunks [N + 1]) int64, which
    every operator of the recurrence takes; see ``reference.varlen_chunks`` (any offsets give
    tables inside the batch, so compiled code needs no check of ``cu_seqlens``)."""
    if use_kernels(cu_seqlens):
        from .kernels import varlen as k
        chunks, seq_chunks = recurrence_meta.varlen_chunks_fake(cu_seqlens, T, chunk_size)
        with on_device(cu_seqlens):
            k.varlen_chunks(cu_seqlens, T, chunk_size, chunks, seq_chunks)
        return chunks, seq_chunks
    return _varlen_chunks_reference(cu_seqlens, T, chunk_size)


varlen_chunks.register_fake(recurrence_meta.varlen_chunks_fake)


def _chunk_prepare_cpu(write_idx: Tensor, write_w: Tensor, read_idx: Tensor, read_w: Tensor,
                       decay: Tensor | None, bank_rows: int, chunk_size: int,
                       chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm::chunk_prepare``: the reference."""
    if chunks is not None:
        prep = reference.chunk_prepare_varlen_reference(write_idx, write_w, read_idx, read_w,
                                                        decay, bank_rows, chunk_size, chunks,
                                                        seq_chunks)
    else:
        prep = reference.chunk_prepare_reference(write_idx, write_w, read_idx, read_w, decay,
                                                 bank_rows, chunk_size)
    return tuple(x.contiguous() for x in prep)


_chunk_prepare_reference = _reference_op(
    "chunk_prepare", _chunk_prepare_cpu, recurrence_meta.chunk_prepare_fake, ())


@triton_op("sdm::chunk_prepare", mutates_args=())
def chunk_prepare(write_idx: Tensor, write_w: Tensor, read_idx: Tensor, read_w: Tensor,
                  decay: Tensor | None, bank_rows: int, chunk_size: int,
                  chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 1: (A, QK, gather_w, gather_r, scatter_w, row_decay, rank, read_rank); see
    ``kernels/chunk_prepare.py`` for the math and layouts. ``chunks`` and ``seq_chunks``
    (``reference.varlen_chunks``) describe a packed batch, None otherwise (every operator of
    the recurrence takes them)."""
    if use_kernels(write_idx):
        from .kernels import chunk_prepare as k
        outs = recurrence_meta.chunk_prepare_fake(write_idx, write_w, read_idx, read_w, decay,
                                                  bank_rows, chunk_size, chunks, seq_chunks)
        with on_device(write_idx):
            k.chunk_prepare(write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size,
                            chunks, *outs)
        return outs
    return _chunk_prepare_reference(write_idx, write_w, read_idx, read_w, decay, bank_rows,
                                    chunk_size, chunks, seq_chunks)


# ---------------------------------------------------------------------------
# sdm::bank_copy
# ---------------------------------------------------------------------------


def _bank_copy_cpu(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
    """The CPU path of ``sdm::bank_copy``."""
    return bank.expand(banks, *bank.shape[-3:]).clone(memory_format=torch.contiguous_format)


_bank_copy_reference = _reference_op("bank_copy", _bank_copy_cpu, recurrence_meta.bank_copy_fake)


@triton_op("sdm::bank_copy", mutates_args=())
def bank_copy(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
    """The per-stream copy [banks, H, S, D] (contiguous) of an initial bank, [banks, H, S, D]
    or shared [H, S, D]: the state phase 2 updates in place and returns. A kernel rather than
    a memcpy (see ``kernels/bank_copy.py``); not differentiable (the inference forward's).
    ``programs`` > 0 bounds the kernel's programs a bank, for a copy run beside other kernels
    (the same result)."""
    if use_kernels(bank):
        from .kernels import bank_copy as k
        bank_out = recurrence_meta.bank_copy_fake(bank, banks, programs)
        with on_device(bank):
            k.bank_copy(bank, bank_out, programs)
        return bank_out
    return _bank_copy_reference(bank, banks, programs)


bank_copy.register_fake(recurrence_meta.bank_copy_fake)


def _recurrence_fwd_cpu(v: Tensor, beta: Tensor, write_idx: Tensor, read_idx: Tensor,
                        gather_w: Tensor, gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor,
                        rank: Tensor, read_rank: Tensor, X: Tensor, QX: Tensor, bank: Tensor,
                        snapshot: str, chunks: Tensor | None = None,
                        seq_chunks: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm::recurrence_fwd``: the reference."""
    prep = reference.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    if chunks is not None:
        res = reference.recurrence_fwd_varlen_reference(v, beta, write_idx, read_idx, prep, X, QX,
                                                        bank, snapshot, chunks, seq_chunks)
    else:
        res = reference.recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X, QX, bank,
                                                 snapshot)
    out, bank_out, snap, snap_scale, resid, delta = res
    return (out.to(v.dtype).contiguous(), bank_out.to(bank.dtype).contiguous(), snap.contiguous(),
            snap_scale.contiguous(), resid.contiguous(), delta.contiguous())


_recurrence_fwd_reference = _reference_op(
    "recurrence_fwd", _recurrence_fwd_cpu, recurrence_meta.recurrence_fwd_fake, ())


@triton_op("sdm::recurrence_fwd", mutates_args=())
def recurrence_fwd(v: Tensor, beta: Tensor, write_idx: Tensor, read_idx: Tensor,
                   gather_w: Tensor, gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor,
                   rank: Tensor, read_rank: Tensor, X: Tensor, QX: Tensor, bank: Tensor,
                   snapshot: str, chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 2: (out, bank_out, snap, snap_scale, res, delta) from the initial ``bank``
    ([B, H, S, D] or shared [H, S, D]); see ``kernels/recurrence_fwd.py``. ``read_rank`` is
    not read here: it is an input so that the backward has it. The kernels copy into bank_out
    only the rows that no chunk writes; phase 2 reads the others from ``bank`` until their
    first write (``kernels/bank_copy.py``)."""
    if use_kernels(v):
        from .kernels import bank_copy as kc
        from .kernels import recurrence_fwd as k
        out, bank_out, snap, snap_scale, res, delta = recurrence_meta.recurrence_fwd_fake(
            v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank,
            read_rank, X, QX, bank, snapshot, chunks, seq_chunks)
        first = write_idx.new_empty(bank_out.shape[:2].numel(), bank_out.shape[2],
                                    dtype=torch.int32)
        with on_device(v):
            # Phase 2 reads each row from the input bank until its stream first writes it, so
            # only the rows that no chunk writes are copied (PERF_NOTES 32).
            kc.first_writes(write_idx, X.shape[-1], chunks, seq_chunks, first)
            kc.bank_copy_unwritten(bank, bank_out, first)
            k.recurrence_fwd(v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay,
                             rank, X, QX, bank_out, out, res, delta, snap, snap_scale, snapshot,
                             chunks, seq_chunks, bank, first)
        return out, bank_out, snap, snap_scale, res, delta
    return _recurrence_fwd_reference(v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w,
                                     row_decay, rank, read_rank, X, QX, bank, snapshot, chunks,
                                     seq_chunks)


def _recurrence_fwd_inplace_cpu(bank: Tensor, v: Tensor, beta: Tensor, write_idx: Tensor,
                                read_idx: Tensor, gather_w: Tensor, gather_r: Tensor,
                                scatter_w: Tensor, row_decay: Tensor, rank: Tensor, X: Tensor,
                                QX: Tensor, chunks: Tensor | None = None,
                                seq_chunks: Tensor | None = None) -> Tensor:
    """The CPU path of ``sdm::recurrence_fwd_``: the reference."""
    prep = reference.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    if chunks is not None:
        out, bank_out = reference.recurrence_fwd_varlen_reference(
            v, beta, write_idx, read_idx, prep, X, QX, bank, "none", chunks, seq_chunks)[:2]
    else:
        out, bank_out = reference.recurrence_fwd_reference(v, beta, write_idx, read_idx, prep, X,
                                                           QX, bank)[:2]
    bank.copy_(bank_out)
    return out.to(v.dtype).contiguous()


_recurrence_fwd_inplace_reference = _reference_op(
    "recurrence_fwd_inplace", _recurrence_fwd_inplace_cpu,
    recurrence_meta.recurrence_fwd_inplace_fake, ("bank",))


@triton_op("sdm::recurrence_fwd_", mutates_args=("bank",))
def recurrence_fwd_(bank: Tensor, v: Tensor, beta: Tensor, write_idx: Tensor, read_idx: Tensor,
                    gather_w: Tensor, gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor,
                    rank: Tensor, X: Tensor, QX: Tensor, chunks: Tensor | None = None,
                    seq_chunks: Tensor | None = None) -> Tensor:
    """Phase 2 updating ``bank`` [B, H, S, D] in place, keeping nothing for a backward; returns
    out [B, T, H, D] in v's dtype."""
    if use_kernels(v):
        from .kernels import recurrence_fwd as k
        out = v.new_empty(v.shape)
        with on_device(v):
            k.recurrence_fwd(v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay,
                             rank, X, QX, bank, out, None, None, None, None, None, chunks,
                             seq_chunks)
        return out
    return _recurrence_fwd_inplace_reference(bank, v, beta, write_idx, read_idx, gather_w,
                                             gather_r, scatter_w, row_decay, rank, X, QX, chunks,
                                             seq_chunks)


def _decode_step_cpu(bank: Tensor, v: Tensor, beta: Tensor, write_idx: Tensor, write_w: Tensor,
                     read_idx: Tensor, read_w: Tensor, decay: Tensor | None = None) -> Tensor:
    """The CPU path of ``sdm::decode_step_``: the reference, stored into ``bank``."""
    out, new, slot = reference.decode_step_reference(bank, v, beta, write_idx, write_w, read_idx,
                                                     read_w, decay)
    B, H, S, D = bank.shape
    slot = slot.reshape(B * H, -1)
    keep = slot >= 0
    stream = torch.arange(B * H, device=bank.device)[:, None].expand_as(slot)
    # Entries on one slot carry the same new row, so the order of the stores does not matter.
    rows = new.reshape(B * H, -1, D)[keep].to(bank.dtype)
    bank.view(B * H, S, D)[stream[keep], slot[keep]] = rows
    return out.to(v.dtype).contiguous()


_decode_step_reference = _reference_op(
    "decode_step_inplace", _decode_step_cpu, recurrence_meta.decode_step_fake, ("bank",))


@triton_op("sdm::decode_step_", mutates_args=("bank",))
def decode_step_(bank: Tensor, v: Tensor, beta: Tensor, write_idx: Tensor, write_w: Tensor,
                 read_idx: Tensor, read_w: Tensor, decay: Tensor | None = None) -> Tensor:
    """One token (T = 1) of the recurrence on every stream of ``bank`` [B, H, S, D], in place
    and in one launch; returns out [B, 1, H, D] in v's dtype. See ``kernels/decode_step.py``."""
    if use_kernels(v):
        from .kernels import decode_step as k
        out = v.new_empty(v.shape)
        with on_device(v):
            k.decode_step(bank, v, beta, write_idx, write_w, read_idx, read_w, decay, out)
        return out
    return _decode_step_reference(bank, v, beta, write_idx, write_w, read_idx, read_w, decay)


chunk_prepare.register_fake(recurrence_meta.chunk_prepare_fake)
recurrence_fwd.register_fake(recurrence_meta.recurrence_fwd_fake)
recurrence_fwd_.register_fake(recurrence_meta.recurrence_fwd_inplace_fake)
decode_step_.register_fake(recurrence_meta.decode_step_fake)

# ---------------------------------------------------------------------------
# The recurrence's backward: sdm::recurrence_bwd (phase 2), sdm::chunk_prepare_backward
# ---------------------------------------------------------------------------


def _no_double_backward(name: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(f"sdm_ops: {name} does not support double backward (its backward "
                           "is not differentiable); do not pass create_graph=True")


def _recurrence_bwd_cpu(beta: Tensor, write_idx: Tensor, read_idx: Tensor, gather_w: Tensor,
                        gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor, rank: Tensor,
                        read_rank: Tensor, X: Tensor, QX: Tensor, res: Tensor, delta: Tensor,
                        bank_rows: int, snap: Tensor, snap_scale: Tensor, snapshot: str,
                        dout: Tensor | None, dbank_out: Tensor | None, v_dtype: torch.dtype,
                        chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                   Tensor]:
    """The CPU path of ``sdm::recurrence_bwd``: the reference."""
    prep = reference.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, read_rank)
    B, T, H, D = res.shape
    v_like = res.new_empty((B, T, H, D))
    args = (v_like, beta, write_idx, read_idx, prep, X, QX, bank_rows, snap, snap_scale, snapshot,
            res, delta, dout, dbank_out)
    if chunks is not None:
        grads = reference.recurrence_bwd_varlen_reference(*args, chunks, seq_chunks)
    else:
        grads = reference.recurrence_bwd_reference(*args)
    dv, rest = grads[0].to(v_dtype), grads[1:]
    return (dv.contiguous(),) + tuple(g.contiguous() for g in rest)


_recurrence_bwd_reference = _reference_op(
    "recurrence_bwd", _recurrence_bwd_cpu, recurrence_meta.recurrence_bwd_fake, ())


@triton_op("sdm::recurrence_bwd", mutates_args=())
def recurrence_bwd(beta: Tensor, write_idx: Tensor, read_idx: Tensor, gather_w: Tensor,
                   gather_r: Tensor, scatter_w: Tensor, row_decay: Tensor, rank: Tensor,
                   read_rank: Tensor, X: Tensor, QX: Tensor, res: Tensor, delta: Tensor,
                   bank_rows: int, snap: Tensor, snap_scale: Tensor, snapshot: str,
                   dout: Tensor | None, dbank_out: Tensor | None, v_dtype: torch.dtype,
                   chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                              Tensor]:
    """Backward of ``sdm::recurrence_fwd`` from its saved tensors (the bank itself is not
    needed: ``snap`` holds every row the backward reads; ``bank_rows`` is S): (dv, dbeta,
    dgather_w, dgather_r, dscatter_w, drow_decay, dX, dQX, dbank [B, H, S, D] float32); see
    ``kernels/recurrence_bwd.py``."""
    if use_kernels(res):
        from .kernels import bank_copy as kc
        from .kernels import recurrence_bwd as k
        dv, dbeta, _, _, _, _, dX, dQX, dbank = recurrence_meta.recurrence_bwd_fake(
            beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank, read_rank,
            X, QX, res, delta, bank_rows, snap, snap_scale, snapshot, dout, dbank_out, v_dtype,
            chunks, seq_chunks)
        with on_device(res):
            if dbank_out is None:
                dbank.zero_()
            else:
                kc.bank_copy(dbank_out, dbank)
            dgw, dgr, dsw, drd = k.recurrence_bwd(
                beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank,
                read_rank, X, QX, res, delta, snap, snap_scale, snapshot, dout, dbank, dv, dX,
                dQX, dbeta, chunks, seq_chunks)
        return dv, dbeta, dgw, dgr, dsw, drd, dX, dQX, dbank
    return _recurrence_bwd_reference(beta, write_idx, read_idx, gather_w, gather_r, scatter_w,
                                     row_decay, rank, read_rank, X, QX, res, delta, bank_rows, snap,
                                     snap_scale, snapshot, dout, dbank_out, v_dtype, chunks,
                                     seq_chunks)


def _recurrence_fwd_setup(ctx, inputs, output):
    (v, beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay, rank, read_rank,
     X, QX, bank, snapshot, chunks, seq_chunks) = inputs
    _, bank_out, snap, snap_scale, res, delta = output
    ctx.save_for_backward(beta, write_idx, read_idx, gather_w, gather_r, scatter_w, row_decay,
                          rank, read_rank, X, QX, res, delta, snap, snap_scale, chunks, seq_chunks)
    ctx.bank_rows = bank.shape[-2]
    ctx.snapshot = snapshot
    # The saved-for-backward outputs (snap, snap_scale, res, delta) never get a gradient, and
    # out or the bank may not either: no zero tensors are made for them (None reaches the grad).
    ctx.set_materialize_grads(False)
    ctx.v_dtype = v.dtype
    ctx.bank_meta = (bank.dim(), bank.dtype)


def _recurrence_fwd_grad(ctx, dout, dbank_out, *_):
    _no_double_backward("sparse_delta_memory")
    saved = ctx.saved_tensors
    beta = saved[0]
    g = torch.ops.sdm.recurrence_bwd(*saved[:13], ctx.bank_rows, *saved[13:15], ctx.snapshot,
                                     None if dout is None else dout.contiguous(),
                                     None if dbank_out is None else dbank_out.contiguous(),
                                     ctx.v_dtype, *saved[15:])
    dv, dbeta, dgw, dgr, dsw, drd, dX, dQX, dbank = g
    dim, dtype = ctx.bank_meta
    if dim == 3:
        dbank = dbank.sum(0)
    return (dv, dbeta.to(beta.dtype), None, None, dgw, dgr, dsw, drd, None, None, dX, dQX,
            dbank.to(dtype), None, None, None)


recurrence_bwd.register_fake(recurrence_meta.recurrence_bwd_fake)
recurrence_fwd.register_autograd(_recurrence_fwd_grad, setup_context=_recurrence_fwd_setup)


def _chunk_prepare_backward_cpu(write_idx: Tensor, write_w: Tensor, read_idx: Tensor,
                                read_w: Tensor, decay: Tensor | None, bank_rows: int, dA: Tensor,
                                dQK: Tensor, d_gather_w: Tensor, d_gather_r: Tensor,
                                d_scatter_w: Tensor, d_row_decay: Tensor,
                                chunks: Tensor | None = None, seq_chunks: Tensor | None = None
                                ) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm::chunk_prepare_backward``: the reference."""
    args = (write_idx, write_w, read_idx, read_w, decay, bank_rows, dA, dQK, d_gather_w,
            d_gather_r, d_scatter_w, d_row_decay)
    if chunks is not None:
        dww, drw, ddc = reference.chunk_prepare_backward_varlen_reference(*args, chunks, seq_chunks)
    else:
        dww, drw, ddc = reference.chunk_prepare_backward_reference(*args)
    ddc = write_w.new_empty(0, dtype=dww.dtype) if ddc is None else ddc
    return dww.contiguous(), drw.contiguous(), ddc.contiguous()


_chunk_prepare_backward_reference = _reference_op(
    "chunk_prepare_backward", _chunk_prepare_backward_cpu,
    recurrence_meta.chunk_prepare_backward_fake, ())


@triton_op("sdm::chunk_prepare_backward", mutates_args=())
def chunk_prepare_backward(write_idx: Tensor, write_w: Tensor, read_idx: Tensor, read_w: Tensor,
                           decay: Tensor | None, bank_rows: int, dA: Tensor, dQK: Tensor,
                           d_gather_w: Tensor, d_gather_r: Tensor, d_scatter_w: Tensor,
                           d_row_decay: Tensor, chunks: Tensor | None = None,
                           seq_chunks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``sdm::chunk_prepare``: (d_write_w, d_read_w, d_decay), d_decay empty
    without decay; see ``kernels/chunk_prepare.py``."""
    if use_kernels(dA):
        from .kernels import chunk_prepare as k
        dww, drw, ddc = recurrence_meta.chunk_prepare_backward_fake(
            write_idx, write_w, read_idx, read_w, decay, bank_rows, dA, dQK, d_gather_w,
            d_gather_r, d_scatter_w, d_row_decay, chunks, seq_chunks)
        with on_device(dA):
            k.chunk_prepare_bwd(write_idx, write_w, read_idx, read_w, decay, bank_rows, dA, dQK,
                                d_gather_w, d_gather_r, d_scatter_w, d_row_decay, dww,
                                None if decay is None else ddc, drw, chunks)
        return dww, drw, ddc
    return _chunk_prepare_backward_reference(write_idx, write_w, read_idx, read_w, decay,
                                             bank_rows, dA, dQK, d_gather_w, d_gather_r,
                                             d_scatter_w, d_row_decay, chunks, seq_chunks)


def _chunk_prepare_setup(ctx, inputs, output):
    write_idx, write_w, read_idx, read_w, decay, bank_rows, _, chunks, seq_chunks = inputs
    ctx.save_for_backward(write_idx, write_w, read_idx, read_w, decay, chunks, seq_chunks)
    ctx.bank_rows = bank_rows


def _chunk_prepare_grad(ctx, dA, dQK, dgw, dgr, dsw, drd, *_):
    _no_double_backward("sparse_delta_memory")
    write_idx, write_w, read_idx, read_w, decay, chunks, seq_chunks = ctx.saved_tensors
    wd = recurrence_meta.weight_dtype(write_w, read_w, decay)

    def grad(g, like):
        if g is None:
            return torch.zeros(like, dtype=wd, device=write_w.device)
        return g.contiguous().to(wd)

    B, T, H, W = write_idx.shape
    R = read_idx.shape[-1]
    chunk_grad = dA if dA is not None else dQK
    shape = chunk_grad.shape
    dww, drw, ddc = torch.ops.sdm.chunk_prepare_backward(
        write_idx, write_w, read_idx, read_w, decay, ctx.bank_rows, grad(dA, shape),
        grad(dQK, shape), grad(dgw, (B, T, H, W)), grad(dgr, (B, T, H, R)),
        grad(dsw, (B, T, H, W)), grad(drd, (B, T, H, W)), chunks, seq_chunks)
    return (None, dww.to(write_w.dtype), None, drw.to(read_w.dtype),
            None if decay is None else ddc.to(decay.dtype), None, None, None, None)


chunk_prepare_backward.register_fake(recurrence_meta.chunk_prepare_backward_fake)
chunk_prepare.register_autograd(_chunk_prepare_grad, setup_context=_chunk_prepare_setup)
