"""The inventory: every operator sdm_ops registers.

Namespace ``sdm`` (``torch.ops.sdm``) holds the public operators, one for each public function,
which reaches it through ``call`` after checking its arguments:

* ``sdm::sparse_delta_memory(v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None,
  chunk_size=64, snapshot="none", cu_seqlens=None, output_final_state=False, *,
  keep_for_backward=True) -> (out, bank_out, kept)``: the recurrence, functional. ``kept``
  holds what its backward reads (``KEPT_FOR_BACKWARD``, then without the final state the
  working set's layout, ``working_set.WorkingRows``; empty with ``keep_for_backward=False``,
  which keeps no snapshot). ``bank_out`` is the final state with ``output_final_state``, else
  an empty tensor: phase 2 then runs on the working set of touched rows.
* ``sdm::sparse_delta_memory_(v, beta, write_idx, write_w, read_idx, read_w, bank(a!),
  decay=None, chunk_size=64, cu_seqlens=None) -> out``: the recurrence updating ``bank``.
* ``sdm::product_key_topk(raw, factors, k) -> (val, lin)``.
* ``sdm::wy_solve(A, beta, QK) -> (X, QX)``.

Namespace ``sdm_internal`` holds the pieces they run, which take contiguous inputs: the chunk
tables of a packed batch (``varlen_chunks``), phase 1 (``chunk_prepare``), phase 2
(``recurrence_fwd``; ``recurrence_fwd_`` in place), the bank copy (``bank_copy``), the decode
step (``decode_step_``), the backward operators (``wy_solve_backward``,
``product_key_topk_backward``, ``recurrence_bwd``, ``chunk_prepare_backward``), the working
set's bank gradient (``rows_to_bank``) and the CPU twins ``<op>_reference``.

Each operator is a ``torch.library.triton_op`` whose body is a function of this module, named
``_<op>``. The body of an internal operator launches Triton kernels (through the launchers of
``sdm_ops.kernels``, which use ``wrap_triton``) when ``use_kernels`` says so (CUDA tensors),
and otherwise calls ``sdm_internal::<op>_reference``, an opaque ``custom_op`` running the
reference of ``sdm_ops.reference``. Every operator has an explicit fake in ``sdm_ops.meta``;
the kernel branches allocate their outputs with those same functions, so fake and real
layouts cannot drift apart. The public operators take inputs of any dense layout (they make
them contiguous) and every operator returns contiguous outputs; none validates arguments
beyond what the kernels need.

A dispatch costs the host about as much time as a small body, so an eager call dispatches no
custom operator where the dispatcher has nothing else to do:

* the bodies of ``sdm::sparse_delta_memory`` and ``sdm::sparse_delta_memory_`` call the
  internal operators' bodies, not the operators, and the registered backwards do the same when
  eager (``_in_backward``; while traced or under ``create_graph`` they call the operators);
* the public functions reach their operator through ``call``: eagerly, on plain tensors that
  launch kernels and outside tracing and modes, it runs the body itself, through an
  autograd.Function of the operator's registered setup and backward where an input requires
  grad; otherwise (``torch.compile``, ``torch.export``, ``opcheck``, a dispatch mode, the CPU
  reference) it calls the operator.

A traced call sees the same kernels either way: under ``torch.compile`` a triton_op's body is
traced, so Inductor sees the user-defined Triton kernels themselves (and, on CPU, one call of
each reference operator). The internal operators stay registered on their own, each with its
opcheck.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch._library.triton import set_wrap_triton_enabled
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.library import triton_op
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _finite, layout, reference, working_set
from .kernels._common import on_device, sm_count, use_kernels
from .layout import SKIP_SNAPSHOT
from .meta import product_key_topk as product_key_topk_meta
from .meta import recurrence as recurrence_meta
from .meta import wy_solve as wy_solve_meta

PUBLIC = "sdm"
INTERNAL = "sdm_internal"


def _reference_op(name: str, fn, fake, mutates_args=()):
    """Register ``fn`` (the reference) as the opaque custom op ``sdm_internal::<name>_reference``.

    The CPU branch of a triton_op body calls it: torch.compile traces triton_op bodies, and
    tracing the reference itself would unroll its loop over chunks (a recompilation for every
    chunk count); an opaque op with a fake compiles once for all shapes."""
    op = torch.library.custom_op(f"{INTERNAL}::{name}_reference", fn, mutates_args=mutates_args)
    op.register_fake(fake)
    return op


def _traced(t: Tensor) -> bool:
    """Whether an operator body runs traced (torch.compile, torch.export, opcheck's checks: fake
    or functional tensors) rather than eagerly on ``t`` itself."""
    return torch.compiler.is_compiling() or isinstance(t, (FakeTensor, FunctionalTensor))


def _eager_backward(t: Tensor) -> bool:
    """Whether a registered backward (on tensors like ``t``) runs the internal operators'
    bodies (``_in_backward``): eagerly, but not while traced, under a dispatch mode (which
    should see the operators) or with grad mode on (``create_graph``: an operator, which has
    no autograd, refuses a double backward where its body would drop a term)."""
    return not (torch.is_grad_enabled() or _traced(t) or _get_current_dispatch_mode() is not None)


def _in_backward(op, body, eager: bool):
    """What a registered backward calls for the internal operator ``op``: with ``eager``
    (``_eager_backward``) its body ``body`` with the kernels launched directly, as the
    operator's own eager call launches them, since each dispatch is host time that every
    backward pays; otherwise the operator itself."""
    if not eager:
        return op

    def run(*args, **kwargs):
        with set_wrap_triton_enabled(False):
            return body(*args, **kwargs)

    return run


_PLAIN = (Tensor, torch.nn.Parameter)


def _eager_plain(tensors: list[Tensor]) -> bool:
    """Whether an eager call of a public operator on ``tensors`` leaves the dispatcher nothing
    to do but call the body and record autograd: plain tensors that launch kernels
    (``use_kernels``), outside tracing (``torch.compile``, ``torch.export``,
    ``torch.jit.trace``), dispatch modes, torch function modes and functorch transforms."""
    if (
        torch.compiler.is_compiling()
        or torch._C._is_tracing()
        or _get_current_dispatch_mode() is not None
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
    ):
        return False
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    return use_kernels(tensors[0])


def call(op, *args, **kwargs):
    """``op(*args, **kwargs)`` for a public function, which passes the operator's arguments
    positionally and its keyword-only ones by keyword. Eagerly, where the dispatcher would
    only call the body and record autograd (``_eager_plain``), the body itself, with its
    kernels launched directly as the operator's own eager call launches them, and where an
    input requires grad, through an autograd.Function made of the operator's registered
    setup and backward (``_autograd``): each dispatch costs the host about as much time as a
    small body, and the same kernels run on the same tensors. An argument the operator
    mutates gets its version bumped, as the dispatcher bumps it, and under the profiler the
    call is a range named after the operator. Otherwise (traced, a mode, the CPU reference)
    the operator."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    if not _eager_plain(tensors):
        return op(*args, **kwargs)
    direct = _DIRECT[op]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if direct.autograd is None:
            return op(*args, **kwargs)
        run = lambda: direct.autograd(*args, *kwargs.values())
    else:
        run = lambda: direct.body(*args, **kwargs)
    with set_wrap_triton_enabled(False):
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(direct.name):
                out = run()
        else:
            out = run()
    for i in direct.mutated:
        torch.autograd.graph.increment_version(args[i])
    return out


def _autograd(body, setup, backward, kw_only: tuple[str, ...] = (), listed: int | None = None):
    """A function running an operator's ``body`` under autograd with its registered ``setup``
    and ``backward`` (an autograd.Function): what the operator's autograd runs, without the
    dispatches around it. It takes the operator's arguments positionally, the keyword-only
    ones (``kw_only``) last, and returns what the operator returns. An autograd.Function
    returns tensors only, so an operator whose outputs end in a list after ``listed`` tensors
    has that list flattened in between; the list's tensors get no gradient."""
    k = len(kw_only)

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            inputs, kw = (args[:-k], dict(zip(kw_only, args[-k:]))) if k else (args, {})
            output = body(*inputs, **kw)
            if k:
                setup(ctx, inputs, kw, output)
            else:
                setup(ctx, inputs, output)
            ctx.arguments = len(args)
            return tuple(output) if listed is None else (*output[:listed], *output[listed])

        @staticmethod
        def backward(ctx, *grads):
            if listed is not None:
                grads = (*grads[:listed], None)
            got = tuple(backward(ctx, *grads))
            return (got + (None,) * ctx.arguments)[: ctx.arguments]

    def apply(*args):
        output = Function.apply(*args)
        return output if listed is None else (*output[:listed], list(output[listed:]))

    return apply


def _no_double_backward(name: str) -> None:
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"sdm_ops: {name} does not support double backward (its backward "
            "is not differentiable); do not pass create_graph=True"
        )


# ---------------------------------------------------------------------------
# sdm::wy_solve, sdm_internal::wy_solve_backward
# ---------------------------------------------------------------------------


def _wy_solve_cpu(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm::wy_solve``: the reference."""
    X, QX = reference.wy_solve_reference(A, beta, QK)
    return X.contiguous(), QX.contiguous()


_wy_solve_reference = _reference_op("wy_solve", _wy_solve_cpu, wy_solve_meta.wy_solve_fake, ())


def _wy_solve(A: Tensor, beta: Tensor, QK: Tensor) -> tuple[Tensor, Tensor]:
    """X = (I + tril(beta A, -1))^-1, QX = tril(QK) X; A, QK [N, C, C], beta [N, C], float32."""
    A, beta, QK = A.contiguous(), beta.contiguous(), QK.contiguous()
    if use_kernels(A):
        from .kernels import wy_solve as k

        X, QX = A.new_empty(A.shape), A.new_empty(A.shape)
        with on_device(A):
            k.wy_solve_fwd(A, beta, QK, X, QX)
        return X, QX
    return _wy_solve_reference(A, beta, QK)


wy_solve = triton_op("sdm::wy_solve", mutates_args=())(_wy_solve)


def _wy_solve_backward_cpu(
    A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor, dQX: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm_internal::wy_solve_backward``: the reference."""
    dA, dbeta, dQK = reference.wy_solve_backward_reference(A, beta, QK, X, dX, dQX)
    return dA.contiguous(), dbeta.contiguous(), dQK.contiguous()


_wy_solve_backward_reference = _reference_op(
    "wy_solve_backward", _wy_solve_backward_cpu, wy_solve_meta.wy_solve_backward_fake, ()
)


def _wy_solve_backward(
    A: Tensor, beta: Tensor, QK: Tensor, X: Tensor, dX: Tensor, dQX: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(dA, dbeta, dQK) of ``wy_solve`` (strict lower, [N, C], lower triangle)."""
    if use_kernels(A):
        from .kernels import wy_solve as k

        dA, dbeta, dQK = A.new_empty(A.shape), beta.new_empty(beta.shape), A.new_empty(A.shape)
        with on_device(A):
            k.wy_solve_bwd(A=A, beta=beta, QK=QK, X=X, dX=dX, dQX=dQX, dA=dA, dbeta=dbeta, dQK=dQK)
        return dA, dbeta, dQK
    return _wy_solve_backward_reference(A, beta, QK, X, dX, dQX)


wy_solve_backward = triton_op("sdm_internal::wy_solve_backward", mutates_args=())(
    _wy_solve_backward
)


def _wy_solve_setup(ctx, inputs, output):
    A, beta, QK = inputs
    ctx.save_for_backward(A, beta, QK, output[0])


def _wy_solve_grad(ctx, dX, dQX):
    _no_double_backward("wy_solve")
    A, beta, QK, X = ctx.saved_tensors
    dX = torch.zeros_like(X) if dX is None else dX.contiguous()
    dQX = torch.zeros_like(X) if dQX is None else dQX.contiguous()
    solve_backward = _in_backward(wy_solve_backward, _wy_solve_backward, _eager_backward(X))
    return tuple(solve_backward(A.contiguous(), beta.contiguous(), QK.contiguous(), X, dX, dQX))


wy_solve.register_fake(wy_solve_meta.wy_solve_fake)
wy_solve_backward.register_fake(wy_solve_meta.wy_solve_backward_fake)
wy_solve.register_autograd(_wy_solve_grad, setup_context=_wy_solve_setup)

# ---------------------------------------------------------------------------
# sdm::product_key_topk, sdm_internal::product_key_topk_backward
# ---------------------------------------------------------------------------


def _product_key_topk_cpu(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm::product_key_topk``: the reference."""
    val, lin = reference.product_key_topk_reference(raw, tuple(factors), k)
    return val.contiguous(), lin.contiguous()


_product_key_topk_reference = _reference_op(
    "product_key_topk", _product_key_topk_cpu, product_key_topk_meta.product_key_topk_fake, ()
)


def _product_key_topk(raw: Tensor, factors: list[int], k: int) -> tuple[Tensor, Tensor]:
    """Exact top-k over product keys: raw [..., sum(factors)] -> (val, lin) [..., kk]."""
    raw = raw.contiguous()
    kk = min(k, math.prod(factors))
    shape = (*raw.shape[:-1], kk)
    if use_kernels(raw):
        from .kernels import product_key_topk as kern

        val = raw.new_empty(shape)
        lin = raw.new_empty(shape, dtype=torch.int64)
        with on_device(raw):
            kern.product_key_topk_fwd(
                raw.reshape(-1, raw.shape[-1]), list(factors), k, val.view(-1, kk), lin.view(-1, kk)
            )
        return val, lin
    return _product_key_topk_reference(raw, factors, k)


product_key_topk = triton_op("sdm::product_key_topk", mutates_args=())(_product_key_topk)


def _product_key_topk_backward_cpu(
    lin: Tensor, grad_val: Tensor, factors: list[int], dtype: torch.dtype
) -> Tensor:
    """The CPU path of ``sdm_internal::product_key_topk_backward``: the reference."""
    grad = reference.product_key_topk_backward_reference(lin, grad_val, tuple(factors))
    return grad.to(dtype).contiguous()


_product_key_topk_backward_reference = _reference_op(
    "product_key_topk_backward",
    _product_key_topk_backward_cpu,
    product_key_topk_meta.product_key_topk_backward_fake,
    (),
)


def _product_key_topk_backward(
    lin: Tensor, grad_val: Tensor, factors: list[int], dtype: torch.dtype
) -> Tensor:
    """grad_raw [..., sum(factors)] of ``product_key_topk``, in ``dtype``."""
    width = sum(factors)
    if use_kernels(lin):
        from .kernels import product_key_topk as kern

        grad = grad_val.new_empty((*lin.shape[:-1], width), dtype=dtype)
        kk = lin.shape[-1]
        with on_device(lin):
            kern.product_key_topk_bwd(
                lin.reshape(-1, kk), grad_val.reshape(-1, kk), list(factors), grad.view(-1, width)
            )
        return grad
    return _product_key_topk_backward_reference(lin, grad_val, factors, dtype)


product_key_topk_backward = triton_op("sdm_internal::product_key_topk_backward", mutates_args=())(
    _product_key_topk_backward
)


def _topk_setup(ctx, inputs, output):
    raw, factors, _ = inputs
    ctx.save_for_backward(output[1])
    ctx.factors = list(factors)
    ctx.dtype = raw.dtype


def _topk_grad(ctx, grad_val, _grad_lin):
    _no_double_backward("product_key_topk")
    (lin,) = ctx.saved_tensors
    if grad_val is None:
        grad_val = torch.zeros(lin.shape, dtype=ctx.dtype, device=lin.device)
    backward = _in_backward(
        product_key_topk_backward, _product_key_topk_backward, _eager_backward(lin)
    )
    grad = backward(lin, grad_val.contiguous(), ctx.factors, ctx.dtype)
    return grad, None, None


product_key_topk.register_fake(product_key_topk_meta.product_key_topk_fake)
product_key_topk_backward.register_fake(product_key_topk_meta.product_key_topk_backward_fake)
product_key_topk.register_autograd(_topk_grad, setup_context=_topk_setup)

# ---------------------------------------------------------------------------
# sdm::sparse_delta_memory, sdm::sparse_delta_memory_: phase 1 (sdm_internal::chunk_prepare),
# the WY solve (sdm::wy_solve) and phase 2 (sdm_internal::recurrence_fwd / recurrence_fwd_), or
# one decode step (sdm_internal::decode_step_), with no host synchronization
# ---------------------------------------------------------------------------

# What the functional forward keeps for its backward, in the order of its ``kept`` output:
# phase 1's outputs, the WY solve's, phase 2's saved tensors and, for a packed batch, its chunk
# tables (chunks, seq_chunks).
KEPT_FOR_BACKWARD = (
    "A",
    "QK",
    "gather_w",
    "gather_r",
    "scatter_w",
    "row_decay",
    "rank",
    "read_rank",
    "X",
    "QX",
    "snap",
    "snap_scale",
    "res",
    "delta",
)


def _chunk_betas(beta: Tensor, chunk_size: int, chunks: Tensor | None = None) -> Tensor:
    """beta [B, T, H] -> [B * H * N, C] float32 (float64 for float64 beta), zero past T (the WY
    solve's layout); for a packed batch [H * NC, C] over its chunk slots, zero past each chunk's
    tokens."""
    B, T, H = beta.shape
    C = chunk_size
    wd = torch.promote_types(beta.dtype, torch.float32)
    if chunks is None:
        N = -(-T // C)
        x = beta.to(wd).transpose(1, 2)
        x = torch.nn.functional.pad(x, (0, N * C - T))
        return x.reshape(B * H * N, C)
    NC = chunks.shape[0]
    if T == 0:
        return beta.new_zeros(H * NC, C, dtype=wd)
    i = torch.arange(C, device=beta.device)
    tok = (chunks[:, :1] + i).clamp(max=T - 1)  # [NC, C]
    x = torch.where((i < chunks[:, 1:])[..., None], beta[0].to(wd)[tok], 0.0)
    return x.permute(2, 0, 1).reshape(H * NC, C)


def _chunk_betas_backward(
    dbetas: Tensor, beta: Tensor, chunk_size: int, chunks: Tensor | None = None
) -> Tensor | None:
    """The gradient of ``beta`` through ``_chunk_betas``, in ``dbetas``' dtype (the caller adds
    phase 2's share before rounding to beta's), from ``dbetas`` (its output's): what autograd
    computes through it (the same copies; for a packed batch the same
    accumulation, where each token receives its one value and zeros). None when beta does not
    reach the output (an empty packed batch)."""
    B, T, H = beta.shape
    C = chunk_size
    if chunks is None:
        N = -(-T // C)
        return dbetas.view(B, H, N * C)[..., :T].transpose(1, 2)
    NC = chunks.shape[0]
    if T == 0:
        return None
    i = torch.arange(C, device=beta.device)
    tok = (chunks[:, :1] + i).clamp(max=T - 1)  # [NC, C]
    g = torch.where((i < chunks[:, 1:])[..., None], dbetas.view(H, NC, C).permute(1, 2, 0), 0.0)
    return g.new_zeros(T, H).index_put_((tok,), g, accumulate=True)[None]


def _wide(idx: Tensor) -> Tensor:
    """``idx`` as int64. Phase 2's walks over several chunks take int64 indices only: with int32
    ones, compiled for the H200 by Triton 3.6, results went wrong from the third chunk of a
    stream on (the interpreter's were right); the widened copy costs 4 bytes an entry."""
    return idx if idx.dtype == torch.int64 else idx.to(torch.int64)


def _phase1(v, beta, write_idx, write_w, read_idx, read_w, decay, S, C, cu_seqlens):
    """Phase 1 and the WY solve on finite inputs (``_finite.clean``): (chunk_prepare's
    outputs, the read gather weights NaN where a token's read weights are not finite, X, QX as
    [lead, H, N, C, C], (chunks, seq_chunks), the beta phase 2 takes: NaN where a token's
    write side is not finite); the chunk tables are None without ``cu_seqlens``."""
    chunks, seq_chunks = (
        (None, None) if cu_seqlens is None else _varlen_chunks(cu_seqlens, v.shape[1], C)
    )
    clean = _finite.clean(beta, write_idx, write_w, read_idx, read_w, decay, S)
    prep = _chunk_prepare(
        write_idx,
        clean.write_w,
        read_idx,
        clean.read_w,
        clean.decay,
        bank_rows=S,
        chunk_size=C,
        chunks=chunks,
        seq_chunks=seq_chunks,
    )
    prep = [*prep[:3], _finite.poison_reads(prep[3], clean.bad_reads), *prep[4:]]
    A, QK = prep[0], prep[1]
    X, QX = _wy_solve(A.view(-1, C, C), _chunk_betas(clean.beta, C, chunks), QK.view(-1, C, C))
    return prep, X.view(A.shape), QX.view(A.shape), (chunks, seq_chunks), clean.beta_walk


# The inference forward's bank copy beside phase 1 (``_copy_beside``) takes one
# program for every _COPY_SM_SHARE SMs, which copies at about 60% of a whole-GPU copy's speed;
# so it runs beside phase 1 only while the bank holds at most _COPY_BESIDE_BYTES a chunk of
# phase 1 (the reference workload: 256 KiB; S = 2^20 with one batch row: 16 MiB, in order).
_COPY_SM_SHARE = 4
_COPY_BESIDE_BYTES = 512 * 1024
_side_streams: dict[int, torch.cuda.Stream] = {}


def _copy_beside(bank: Tensor, banks: int, chunks: int) -> tuple[Tensor, torch.cuda.Stream | None]:
    """``(bank_out, side)``: the inference forward's copy of the bank, issued on a second
    stream ``side`` so that it runs beside phase 1 and the WY solve (over ``chunks`` chunks),
    latency-bound kernels that leave most of the memory bandwidth idle; the caller makes its
    stream wait for ``side`` before phase 2. The copy runs as one program for every
    ``_COPY_SM_SHARE`` SMs (at least one a bank), so that the other stream's programs find
    whole SMs free. Eager calls and CUDA-graph captures (where the fork becomes two branches of
    the graph) take it; on the CPU, while traced (Inductor schedules one stream) and for a
    bank of more than ``_COPY_BESIDE_BYTES`` a chunk, the copy runs in order, ``side`` None."""
    if (
        not bank.is_cuda
        or _traced(bank)
        or banks * bank.shape[-3:].numel() * bank.element_size()
        > _COPY_BESIDE_BYTES * max(chunks, 1)
    ):
        return _bank_copy(bank, banks), None
    dev = bank.device
    side = _side_streams.get(dev.index)
    if side is None:
        side = _side_streams[dev.index] = torch.cuda.Stream(dev)
    here = torch.cuda.current_stream(dev)
    programs = max(1, sm_count(dev) // (_COPY_SM_SHARE * banks))
    side.wait_stream(here)
    with torch.cuda.stream(side):
        bank_out = _bank_copy(bank, banks, programs)
    bank_out.record_stream(here)  # allocated on side, used and freed on here
    return bank_out, side


def _sparse_delta_memory(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    chunk_size: int = 64,
    snapshot: str = "none",
    cu_seqlens: Tensor | None = None,
    output_final_state: bool = False,
    *,
    keep_for_backward: bool = True,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The recurrence of ``sdm_ops.sparse_delta_memory``: (out, bank_out, kept). With
    ``keep_for_backward`` phase 2 keeps the snapshots (``snapshot``) and ``kept`` holds what the
    backward reads (``KEPT_FOR_BACKWARD``); without it (what the public function passes when no
    input requires grad) nothing is kept, ``kept`` is empty and phase 2 runs in place on a copy
    of the bank, made on a second stream beside phase 1 and the WY solve on the GPU."""
    v, beta, write_idx, write_w, read_idx, read_w, bank = (
        t.contiguous() for t in (v, beta, write_idx, write_w, read_idx, read_w, bank)
    )
    write_idx, read_idx = _wide(write_idx), _wide(read_idx)
    decay = None if decay is None else decay.contiguous()
    B, T, H, _ = v.shape
    S, C = bank.shape[-2], chunk_size
    in_place = not keep_for_backward and output_final_state
    if in_place:
        banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        bank_out, side = _copy_beside(bank, banks, B * H * -(-T // C))
    prep, X, QX, (chunks, seq_chunks), beta = _phase1(
        v, beta, write_idx, write_w, read_idx, read_w, decay, S, C, cu_seqlens
    )
    _, _, gather_w, gather_r, scatter_w, row_decay, rank, read_rank = prep
    if in_place:
        if side is not None:
            torch.cuda.current_stream(bank.device).wait_stream(side)
        out = _recurrence_fwd_(
            bank_out,
            v,
            beta,
            write_idx,
            read_idx,
            gather_w=gather_w,
            gather_r=gather_r,
            scatter_w=scatter_w,
            row_decay=row_decay,
            rank=rank,
            X=X,
            QX=QX,
            chunks=chunks,
            seq_chunks=seq_chunks,
        )
        return out, bank_out, []
    # Without the final state, phase 2 runs on the working set: the rows the sequence touches.
    rows = (
        None if output_final_state else working_set.working_rows(write_idx, read_idx, S, cu_seqlens)
    )
    out, bank_out, *saved = _recurrence_fwd(
        v,
        beta,
        write_idx if rows is None else rows.write_rows,
        read_idx if rows is None else rows.read_rows,
        gather_w=gather_w,
        gather_r=gather_r,
        scatter_w=scatter_w,
        row_decay=row_decay,
        rank=rank,
        read_rank=read_rank,
        X=X,
        QX=QX,
        bank=bank,
        snapshot=snapshot if keep_for_backward else SKIP_SNAPSHOT,
        chunks=chunks,
        seq_chunks=seq_chunks,
        write_src=None if rows is None else write_idx,
        read_src=None if rows is None else read_idx,
        row_slots=None if rows is None else rows.row_slots,
    )
    if not keep_for_backward:
        return out, bank.new_empty(0), []
    kept = [*prep, X, QX, *saved]
    if cu_seqlens is not None:
        kept += [chunks, seq_chunks]
    if rows is not None:
        kept += list(rows)
    return out, bank_out if output_final_state else bank.new_empty(0), kept


sparse_delta_memory = triton_op("sdm::sparse_delta_memory", mutates_args=())(_sparse_delta_memory)


def _sparse_delta_memory_setup(ctx, inputs, keyword_only_inputs, output):
    v, beta, write_idx, write_w, read_idx, read_w, bank, decay, chunk_size, snapshot = inputs[:10]
    kept = output[2]
    ctx.mark_non_differentiable(*kept)
    # out or the bank may get no gradient: no zero tensors are made for them (None reaches the
    # backward).
    ctx.set_materialize_grads(False)
    ctx.keep_for_backward = keyword_only_inputs["keep_for_backward"]
    ctx.working_set = not inputs[11]  # output_final_state
    ctx.chunk_size, ctx.snapshot, ctx.bank_rows = chunk_size, snapshot, bank.shape[-2]
    ctx.v_dtype, ctx.bank_meta = v.dtype, (bank.dim(), bank.dtype)
    if ctx.keep_for_backward:
        ctx.save_for_backward(beta, write_idx, write_w, read_idx, read_w, decay, *kept)


def _sparse_delta_memory_grad(ctx, dout, dbank_out, _kept):
    """Phase 2's backward (``recurrence_bwd``), then, for the inputs that need them, the WY
    solve's (``wy_solve_backward``; beta's share through ``_chunk_betas``) and phase 1's
    (``chunk_prepare_backward``): the kernels, and the order of their float operations, of the
    autograd graph of the operators composed one by one."""
    _no_double_backward("sparse_delta_memory")
    if not ctx.keep_for_backward:
        raise RuntimeError(
            "sdm::sparse_delta_memory ran with keep_for_backward=False, which keeps nothing for "
            "a backward; call it with keep_for_backward=True to differentiate it "
            "(sdm_ops.sparse_delta_memory does so whenever an input requires grad)"
        )
    (
        beta,
        write_idx,
        write_w,
        read_idx,
        read_w,
        decay,
        A,
        QK,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        read_rank,
        X,
        QX,
        snap,
        snap_scale,
        res,
        delta,
        *tables,
    ) = ctx.saved_tensors
    rows = None
    if ctx.working_set:  # the entries' rows, and the rows' slots: the working set's layout
        rows = working_set.WorkingRows(*tables[-3:])
        tables = tables[:-3]
    chunks, seq_chunks = tables or (None, None)
    if dbank_out is not None and dbank_out.numel() == 0:  # no final state was returned
        dbank_out = None
    beta, write_idx, write_w, read_idx, read_w = (
        t.contiguous() for t in (beta, write_idx, write_w, read_idx, read_w)
    )
    write_idx, read_idx = _wide(write_idx), _wide(read_idx)
    decay = None if decay is None else decay.contiguous()
    # What the forward ran on (``_finite``): inputs selected away get no gradient.
    clean = _finite.clean(beta, write_idx, write_w, read_idx, read_w, decay, ctx.bank_rows)
    beta_in, write_w_in, read_w_in, decay_in = beta, write_w, read_w, decay
    beta, write_w, read_w, decay = clean.beta, clean.write_w, clean.read_w, clean.decay
    # Which of (v, beta, write_idx, write_w, read_idx, read_w, bank, decay) need a gradient (the
    # dispatcher passes no argument left at its default, so the tuple may be shorter).
    needs = (tuple(ctx.needs_input_grad[:8]) + (False,) * 8)[:8]
    # The internal operators' bodies, eagerly (``_in_backward``).
    eager = _eager_backward(beta)
    phase2_backward = _in_backward(recurrence_bwd, _recurrence_bwd, eager)
    solve_backward = _in_backward(wy_solve_backward, _wy_solve_backward, eager)
    phase1_backward = _in_backward(chunk_prepare_backward, _chunk_prepare_backward, eager)
    to_bank = _in_backward(rows_to_bank, _rows_to_bank, eager)
    dv, dbeta, dgw, dgr, dsw, drd, dX, dQX, dbank = phase2_backward(
        clean.beta_walk,
        write_idx if rows is None else rows.write_rows,
        read_idx if rows is None else rows.read_rows,
        gather_w=gather_w,
        gather_r=gather_r,
        scatter_w=scatter_w,
        row_decay=row_decay,
        rank=rank,
        read_rank=read_rank,
        X=X,
        QX=QX,
        res=res,
        delta=delta,
        bank_rows=ctx.bank_rows if rows is None else rows.row_slots.shape[1],
        snap=snap,
        snap_scale=snap_scale,
        snapshot=ctx.snapshot,
        dout=None if dout is None else dout.contiguous(),
        dbank_out=None if dbank_out is None else dbank_out.contiguous(),
        v_dtype=ctx.v_dtype,
        chunks=chunks,
        seq_chunks=seq_chunks,
    )
    bank_dim, bank_dtype = ctx.bank_meta
    if rows is not None:
        if needs[6]:
            dbank = to_bank(dbank, rows.row_slots, ctx.bank_rows, bank_dim == 3)
    elif bank_dim == 3:
        dbank = dbank.sum(0)
    dww = drw = ddc = None
    if needs[1] or needs[3] or needs[5] or needs[7]:
        C = ctx.chunk_size
        dA, dbetas, dQK = solve_backward(
            A.view(-1, C, C),
            _chunk_betas(beta, C, chunks),
            QK.view(-1, C, C),
            X.view(-1, C, C),
            dX.view(-1, C, C),
            dQX.view(-1, C, C),
        )
        through_chunks = _chunk_betas_backward(dbetas, beta, C, chunks) if needs[1] else None
        if through_chunks is not None:
            # Both shares in float32, one rounding to beta's dtype at the end: rounded apart,
            # a bfloat16 beta's gradient would carry each share's rounding, not the sum's.
            dbeta = dbeta + through_chunks.to(dbeta.dtype)
        if needs[3] or needs[5] or needs[7]:
            wd = recurrence_meta.weight_dtype(write_w, read_w, decay)
            dww, drw, ddc = phase1_backward(
                write_idx,
                write_w,
                read_idx,
                read_w,
                decay,
                bank_rows=ctx.bank_rows,
                dA=dA.view(A.shape).to(wd),
                dQK=dQK.view(A.shape).to(wd),
                d_gather_w=dgw.to(wd),
                d_gather_r=dgr.to(wd),
                d_scatter_w=dsw.to(wd),
                d_row_decay=drd.to(wd),
                chunks=chunks,
                seq_chunks=seq_chunks,
            )
    kept = _finite.kept(
        beta_in, write_idx, write_w_in, read_idx, read_w_in, decay_in, ctx.bank_rows
    )
    grads = (
        dv if needs[0] else None,
        kept.keep_beta(dbeta.to(beta.dtype)) if needs[1] else None,
        None,
        kept.keep_write_w(dww.to(write_w.dtype)) if needs[3] else None,
        None,
        kept.keep_read_w(drw.to(read_w.dtype)) if needs[5] else None,
        dbank.to(bank_dtype) if needs[6] else None,
        kept.keep_decay(ddc.to(decay.dtype)) if needs[7] else None,
    )
    # One gradient for each argument the dispatcher passed (chunk_size and the others get None).
    return (grads + (None,) * 4)[: len(ctx.needs_input_grad)]


sparse_delta_memory.register_fake(recurrence_meta.sparse_delta_memory_fake)
sparse_delta_memory.register_autograd(
    _sparse_delta_memory_grad, setup_context=_sparse_delta_memory_setup
)


def _inplace_chunk_size(T, chunk_size: int):
    """``chunk_size`` (16, 32, 64 or 128), or for a sequence shorter than it the smallest of
    those sizes that holds it: a short prefill runs in one small chunk."""
    C = chunk_size
    while C > 16 and C // 2 >= T:
        C //= 2
    return C


def _sparse_delta_memory_(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    bank: Tensor,
    decay: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The recurrence of ``sdm_ops.sparse_delta_memory_``, updating ``bank`` [B, H, S, D] in
    place and keeping nothing for a backward; returns out. One token per stream (T = 1, no
    ``cu_seqlens``) is one decode step (``decode_step_``); a sequence shorter than
    ``chunk_size`` runs in chunks of the smallest size that holds it (``_inplace_chunk_size``)."""
    v, beta, write_idx, write_w, read_idx, read_w = (
        t.contiguous() for t in (v, beta, write_idx, write_w, read_idx, read_w)
    )
    if v.shape[1] != 1 or cu_seqlens is not None:
        write_idx, read_idx = _wide(write_idx), _wide(read_idx)
    decay = None if decay is None else decay.contiguous()
    state = bank.contiguous()
    T = v.shape[1]
    if T == 1 and cu_seqlens is None:  # a decode step: one kernel, no chunk machinery
        # The step's body, not its operator: a second dispatch would double the host cost of
        # an eager step, and a traced graph sees the same kernel either way.
        out = _decode_step(state, v, beta, write_idx, write_w, read_idx, read_w, decay)
    else:
        prep, X, QX, (chunks, seq_chunks), beta = _phase1(
            v,
            beta,
            write_idx,
            write_w,
            read_idx,
            read_w,
            decay,
            bank.shape[-2],
            _inplace_chunk_size(T, chunk_size),
            cu_seqlens,
        )
        _, _, gather_w, gather_r, scatter_w, row_decay, rank, _ = prep
        out = _recurrence_fwd_(
            state,
            v,
            beta,
            write_idx,
            read_idx,
            gather_w=gather_w,
            gather_r=gather_r,
            scatter_w=scatter_w,
            row_decay=row_decay,
            rank=rank,
            X=X,
            QX=QX,
            chunks=chunks,
            seq_chunks=seq_chunks,
        )
    if state is not bank:  # a bank of another dense layout: updated through a copy
        bank.copy_(state)
    return out


sparse_delta_memory_ = triton_op("sdm::sparse_delta_memory_", mutates_args=("bank",))(
    _sparse_delta_memory_
)


sparse_delta_memory_.register_fake(recurrence_meta.sparse_delta_memory_inplace_fake)

# ---------------------------------------------------------------------------
# sdm_internal: the recurrence's pieces: varlen_chunks (a packed batch's chunk tables),
# chunk_prepare (phase 1), recurrence_fwd and recurrence_fwd_ (phase 2), decode_step_ (one token)
# ---------------------------------------------------------------------------


def _varlen_chunks_cpu(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The CPU path of ``sdm_internal::varlen_chunks``: the reference."""
    chunks, seq_chunks = reference.varlen_chunks(cu_seqlens, T, chunk_size)
    return chunks.contiguous(), seq_chunks.contiguous()


_varlen_chunks_reference = _reference_op(
    "varlen_chunks", _varlen_chunks_cpu, recurrence_meta.varlen_chunks_fake, ()
)


def _varlen_chunks(cu_seqlens: Tensor, T: int, chunk_size: int) -> tuple[Tensor, Tensor]:
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


varlen_chunks = triton_op("sdm_internal::varlen_chunks", mutates_args=())(_varlen_chunks)


varlen_chunks.register_fake(recurrence_meta.varlen_chunks_fake)


def _chunk_prepare_cpu(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    chunk_size: int,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm_internal::chunk_prepare``: the reference."""
    if chunks is not None:
        prep = reference.chunk_prepare_varlen_reference(
            write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, chunks, seq_chunks
        )
    else:
        prep = reference.chunk_prepare_reference(
            write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size
        )
    return tuple(x.contiguous() for x in prep)


_chunk_prepare_reference = _reference_op(
    "chunk_prepare", _chunk_prepare_cpu, recurrence_meta.chunk_prepare_fake, ()
)


def _chunk_prepare(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    chunk_size: int,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 1: (A, QK, gather_w, gather_r, scatter_w, row_decay, rank, read_rank); see
    ``kernels/chunk_prepare.py`` for the math and layouts. ``chunks`` and ``seq_chunks``
    (``reference.varlen_chunks``) describe a packed batch, None otherwise (every operator of
    the recurrence takes them)."""
    if use_kernels(write_idx):
        from .kernels import chunk_prepare as k

        outs = recurrence_meta.chunk_prepare_fake(
            write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, chunks, seq_chunks
        )
        with on_device(write_idx):
            k.chunk_prepare(
                write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, chunks, *outs
            )
        return outs
    return _chunk_prepare_reference(
        write_idx, write_w, read_idx, read_w, decay, bank_rows, chunk_size, chunks, seq_chunks
    )


chunk_prepare = triton_op("sdm_internal::chunk_prepare", mutates_args=())(_chunk_prepare)


# ---------------------------------------------------------------------------
# sdm_internal::bank_copy
# ---------------------------------------------------------------------------


def _bank_copy_cpu(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
    """The CPU path of ``sdm_internal::bank_copy``."""
    return bank.expand(banks, *bank.shape[-3:]).clone(memory_format=torch.contiguous_format)


_bank_copy_reference = _reference_op("bank_copy", _bank_copy_cpu, recurrence_meta.bank_copy_fake)


def _bank_copy(bank: Tensor, banks: int, programs: int = 0) -> Tensor:
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


bank_copy = triton_op("sdm_internal::bank_copy", mutates_args=())(_bank_copy)


bank_copy.register_fake(recurrence_meta.bank_copy_fake)


def _recurrence_fwd_cpu(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    bank: Tensor,
    snapshot: str,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
    write_src: Tensor | None = None,
    read_src: Tensor | None = None,
    row_slots: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm_internal::recurrence_fwd``: the reference (on the working set's
    rows, gathered from the bank, when given ``row_slots``)."""
    prep = layout.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    if row_slots is not None:
        banks = v.shape[0] if seq_chunks is None else seq_chunks.shape[0] - 1
        bank = working_set.gather_rows(bank, row_slots, banks, v.shape[2])
    mode = "none" if snapshot == SKIP_SNAPSHOT else snapshot
    if chunks is not None:
        res = reference.recurrence_fwd_varlen_reference(
            v, beta, write_idx, read_idx, prep, X, QX, bank, mode, chunks, seq_chunks
        )
    else:
        res = reference.recurrence_fwd_reference(
            v, beta, write_idx, read_idx, prep, X, QX, bank, mode
        )
    out, bank_out, snap, snap_scale, resid, delta = res
    if snapshot == SKIP_SNAPSHOT:
        snap, snap_scale, resid, delta = (x.new_empty(0) for x in (snap, snap_scale, resid, delta))
    return (
        out.to(v.dtype).contiguous(),
        bank_out.to(bank.dtype).contiguous(),
        snap.contiguous(),
        snap_scale.contiguous(),
        resid.contiguous(),
        delta.contiguous(),
    )


_recurrence_fwd_reference = _reference_op(
    "recurrence_fwd", _recurrence_fwd_cpu, recurrence_meta.recurrence_fwd_fake, ()
)


def _recurrence_fwd(
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    bank: Tensor,
    snapshot: str,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
    write_src: Tensor | None = None,
    read_src: Tensor | None = None,
    row_slots: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Phase 2: (out, bank_out, snap, snap_scale, res, delta) from the initial ``bank``
    ([B, H, S, D] or shared [H, S, D]); see ``kernels/recurrence_fwd.py``. ``read_rank`` is
    not read here: it is an input so that the backward has it. The kernels copy into bank_out
    only the rows that no chunk writes; phase 2 reads the others from ``bank`` until their
    first write (``kernels/bank_copy.py``).

    With ``row_slots`` (``working_set.working_rows``) ``write_idx`` and ``read_idx`` hold the
    entries' rows in a working set and ``write_src`` and ``read_src`` their slots in ``bank``:
    bank_out is the working set at the end, ``[banks, H, U, D]``, of which only the written
    rows are defined, and nothing is copied. ``snapshot`` may also be ``SKIP_SNAPSHOT``: no
    snapshot, and snap, snap_scale, res and delta are empty (a forward without backward)."""
    args = (
        v,
        beta,
        write_idx,
        read_idx,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        read_rank,
        X,
        QX,
        bank,
        snapshot,
        chunks,
        seq_chunks,
        write_src,
        read_src,
        row_slots,
    )
    if use_kernels(v):
        from .kernels import bank_copy as kc
        from .kernels import recurrence_fwd as k

        out, bank_out, snap, snap_scale, res, delta = recurrence_meta.recurrence_fwd_fake(*args)
        # Each row's first writing chunk: [streams, S], or row_slots' [P, U] on a working set.
        first = write_idx.new_empty(
            bank_out.shape[:2].numel(), bank_out.shape[2], dtype=torch.int32
        )
        keep = snapshot != SKIP_SNAPSHOT
        with on_device(v):
            kc.first_writes(write_idx, X.shape[-1], chunks, seq_chunks, first)
            if row_slots is None:
                # Phase 2 reads each row from the input bank until its stream first writes it, so
                # only the rows that no chunk writes are copied.
                kc.bank_copy_unwritten(bank, bank_out, first)
            k.recurrence_fwd(
                v=v,
                beta=beta,
                write_idx=write_idx,
                read_idx=read_idx,
                gather_w=gather_w,
                gather_r=gather_r,
                scatter_w=scatter_w,
                row_decay=row_decay,
                rank=rank,
                X=X,
                QX=QX,
                bank=bank_out,
                out=out,
                res=res if keep else None,
                delta=delta if keep else None,
                snap=snap,
                snap_scale=snap_scale,
                snapshot=snapshot if keep else None,
                chunks=chunks,
                seq_chunks=seq_chunks,
                source=bank,
                first=first,
                write_src=write_src,
                read_src=read_src,
            )
        return out, bank_out, snap, snap_scale, res, delta
    return _recurrence_fwd_reference(*args)


recurrence_fwd = triton_op("sdm_internal::recurrence_fwd", mutates_args=())(_recurrence_fwd)


def _recurrence_fwd_inplace_cpu(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    X: Tensor,
    QX: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> Tensor:
    """The CPU path of ``sdm_internal::recurrence_fwd_``: the reference."""
    prep = layout.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, None)
    # A contiguous bank in the compute dtype is walked where it is: no copy of it is made.
    inplace = bank.is_contiguous() and bank.dtype == reference.compute_dtype(v, bank, gather_w)
    if chunks is not None:
        out, bank_out = reference.recurrence_fwd_varlen_reference(
            v,
            beta,
            write_idx,
            read_idx,
            prep,
            X,
            QX,
            bank,
            "none",
            chunks,
            seq_chunks,
            inplace=inplace,
        )[:2]
    else:
        out, bank_out = reference.recurrence_fwd_reference(
            v, beta, write_idx, read_idx, prep, X, QX, bank, inplace=inplace
        )[:2]
    if not inplace:
        bank.copy_(bank_out)
    return out.to(v.dtype).contiguous()


_recurrence_fwd_inplace_reference = _reference_op(
    "recurrence_fwd_inplace",
    _recurrence_fwd_inplace_cpu,
    recurrence_meta.recurrence_fwd_inplace_fake,
    ("bank",),
)


def _recurrence_fwd_(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    X: Tensor,
    QX: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> Tensor:
    """Phase 2 updating ``bank`` [B, H, S, D] in place, keeping nothing for a backward; returns
    out [B, T, H, D] in v's dtype."""
    if use_kernels(v):
        from .kernels import recurrence_fwd as k

        out = v.new_empty(v.shape)
        with on_device(v):
            k.recurrence_fwd(
                v=v,
                beta=beta,
                write_idx=write_idx,
                read_idx=read_idx,
                gather_w=gather_w,
                gather_r=gather_r,
                scatter_w=scatter_w,
                row_decay=row_decay,
                rank=rank,
                X=X,
                QX=QX,
                bank=bank,
                out=out,
                res=None,
                delta=None,
                snap=None,
                snap_scale=None,
                snapshot=None,
                chunks=chunks,
                seq_chunks=seq_chunks,
            )
        return out
    return _recurrence_fwd_inplace_reference(
        bank,
        v,
        beta,
        write_idx,
        read_idx,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        X,
        QX,
        chunks,
        seq_chunks,
    )


recurrence_fwd_ = triton_op("sdm_internal::recurrence_fwd_", mutates_args=("bank",))(
    _recurrence_fwd_
)


def _decode_step_cpu(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None = None,
) -> Tensor:
    """The CPU path of ``sdm_internal::decode_step_``: the reference, stored into ``bank``."""
    out, new, slot = reference.decode_step_reference(
        bank, v, beta, write_idx, write_w, read_idx, read_w, decay
    )
    B, H, S, D = bank.shape
    slot = slot.reshape(B * H, -1)
    keep = slot >= 0
    stream = torch.arange(B * H, device=bank.device)[:, None].expand_as(slot)
    # Entries on one slot carry the same new row, so the order of the stores does not matter.
    rows = new.reshape(B * H, -1, D)[keep].to(bank.dtype)
    bank.view(B * H, S, D)[stream[keep], slot[keep]] = rows
    return out.to(v.dtype).contiguous()


_decode_step_reference = _reference_op(
    "decode_step_inplace", _decode_step_cpu, recurrence_meta.decode_step_fake, ("bank",)
)


def _decode_step(
    bank: Tensor,
    v: Tensor,
    beta: Tensor,
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None = None,
) -> Tensor:
    """One token (T = 1) of the recurrence on every stream of ``bank`` [B, H, S, D], in place
    and in one launch; returns out [B, 1, H, D] in v's dtype. See ``kernels/decode_step.py``."""
    if use_kernels(v):
        from .kernels import decode_step as k

        out = v.new_empty(v.shape)
        with on_device(v):
            k.decode_step(
                bank=bank,
                v=v,
                beta=beta,
                write_idx=write_idx,
                write_w=write_w,
                read_idx=read_idx,
                read_w=read_w,
                decay=decay,
                out=out,
            )
        return out
    return _decode_step_reference(bank, v, beta, write_idx, write_w, read_idx, read_w, decay)


decode_step_ = triton_op("sdm_internal::decode_step_", mutates_args=("bank",))(_decode_step)


chunk_prepare.register_fake(recurrence_meta.chunk_prepare_fake)
recurrence_fwd.register_fake(recurrence_meta.recurrence_fwd_fake)
recurrence_fwd_.register_fake(recurrence_meta.recurrence_fwd_inplace_fake)
decode_step_.register_fake(recurrence_meta.decode_step_fake)

# ---------------------------------------------------------------------------
# sdm_internal: the recurrence's backward: recurrence_bwd (phase 2), chunk_prepare_backward
# (phase 1)
# ---------------------------------------------------------------------------


def _recurrence_bwd_cpu(
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    res: Tensor,
    delta: Tensor,
    bank_rows: int,
    snap: Tensor,
    snap_scale: Tensor,
    snapshot: str,
    dout: Tensor | None,
    dbank_out: Tensor | None,
    v_dtype: torch.dtype,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm_internal::recurrence_bwd``: the reference."""
    prep = layout.Prepared(None, None, gather_w, gather_r, scatter_w, row_decay, rank, read_rank)
    B, T, H, D = res.shape
    v_like = res.new_empty((B, T, H, D))
    args = (
        v_like,
        beta,
        write_idx,
        read_idx,
        prep,
        X,
        QX,
        bank_rows,
        snap,
        snap_scale,
        snapshot,
        res,
        delta,
        dout,
        dbank_out,
    )
    if chunks is not None:
        grads = reference.recurrence_bwd_varlen_reference(*args, chunks, seq_chunks)
    else:
        grads = reference.recurrence_bwd_reference(*args)
    dv, rest = grads[0].to(v_dtype), grads[1:]
    return (dv.contiguous(),) + tuple(g.contiguous() for g in rest)


_recurrence_bwd_reference = _reference_op(
    "recurrence_bwd", _recurrence_bwd_cpu, recurrence_meta.recurrence_bwd_fake, ()
)


def _recurrence_bwd(
    beta: Tensor,
    write_idx: Tensor,
    read_idx: Tensor,
    gather_w: Tensor,
    gather_r: Tensor,
    scatter_w: Tensor,
    row_decay: Tensor,
    rank: Tensor,
    read_rank: Tensor,
    X: Tensor,
    QX: Tensor,
    res: Tensor,
    delta: Tensor,
    bank_rows: int,
    snap: Tensor,
    snap_scale: Tensor,
    snapshot: str,
    dout: Tensor | None,
    dbank_out: Tensor | None,
    v_dtype: torch.dtype,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``sdm_internal::recurrence_fwd`` from its saved tensors (the bank itself is not
    needed: ``snap`` holds every row the backward reads; ``bank_rows`` is S): (dv, dbeta,
    dgather_w, dgather_r, dscatter_w, drow_decay, dX, dQX, dbank [B, H, S, D] float32); see
    ``kernels/recurrence_bwd.py``."""
    args = (
        beta,
        write_idx,
        read_idx,
        gather_w,
        gather_r,
        scatter_w,
        row_decay,
        rank,
        read_rank,
        X,
        QX,
        res,
        delta,
        bank_rows,
        snap,
        snap_scale,
        snapshot,
        dout,
        dbank_out,
        v_dtype,
        chunks,
        seq_chunks,
    )
    if use_kernels(res):
        from .kernels import bank_copy as kc
        from .kernels import recurrence_bwd as k

        dv, dbeta, _, _, _, _, dX, dQX, dbank = recurrence_meta.recurrence_bwd_fake(*args)
        with on_device(res):
            if dbank_out is None:
                dbank.zero_()
            else:
                kc.bank_copy(dbank_out, dbank)
            dgw, dgr, dsw, drd = k.recurrence_bwd(
                beta=beta,
                write_idx=write_idx,
                read_idx=read_idx,
                gather_w=gather_w,
                gather_r=gather_r,
                scatter_w=scatter_w,
                row_decay=row_decay,
                rank=rank,
                read_rank=read_rank,
                X=X,
                QX=QX,
                res=res,
                delta=delta,
                snap=snap,
                snap_scale=snap_scale,
                snapshot=snapshot,
                dout=dout,
                dbank=dbank,
                dv=dv,
                dX=dX,
                dQX=dQX,
                dbeta=dbeta,
                chunks=chunks,
                seq_chunks=seq_chunks,
            )
        return dv, dbeta, dgw, dgr, dsw, drd, dX, dQX, dbank
    return _recurrence_bwd_reference(*args)


recurrence_bwd = triton_op("sdm_internal::recurrence_bwd", mutates_args=())(_recurrence_bwd)


recurrence_bwd.register_fake(recurrence_meta.recurrence_bwd_fake)


def _rows_to_bank_cpu(grad_rows: Tensor, row_slots: Tensor, bank_rows: int, shared: bool) -> Tensor:
    """The CPU path of ``sdm_internal::rows_to_bank``: the reference."""
    banks, H = grad_rows.shape[:2]
    return working_set.rows_to_bank_reference(grad_rows, row_slots, bank_rows, shared, banks, H)


_rows_to_bank_reference = _reference_op(
    "rows_to_bank", _rows_to_bank_cpu, recurrence_meta.rows_to_bank_fake, ()
)


def _rows_to_bank(grad_rows: Tensor, row_slots: Tensor, bank_rows: int, shared: bool) -> Tensor:
    """The bank's gradient from the working set's: ``grad_rows [banks, H, U, D]`` (its rows'
    slots ``row_slots [banks * H, U]``) placed at their slots of a zeroed ``[banks, H, S, D]``
    (S = ``bank_rows``), or with ``shared`` summed over the banks, in order, into
    ``[H, S, D]``; see ``kernels/working_set.py``."""
    if use_kernels(grad_rows):
        from .kernels import working_set as k

        dst = recurrence_meta.rows_to_bank_fake(grad_rows, row_slots, bank_rows, shared)
        with on_device(grad_rows):
            dst.zero_()
            k.rows_to_bank(grad_rows, row_slots, dst)
        return dst
    return _rows_to_bank_reference(grad_rows, row_slots, bank_rows, shared)


rows_to_bank = triton_op("sdm_internal::rows_to_bank", mutates_args=())(_rows_to_bank)


rows_to_bank.register_fake(recurrence_meta.rows_to_bank_fake)


def _chunk_prepare_backward_cpu(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    dA: Tensor,
    dQK: Tensor,
    d_gather_w: Tensor,
    d_gather_r: Tensor,
    d_scatter_w: Tensor,
    d_row_decay: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The CPU path of ``sdm_internal::chunk_prepare_backward``: the reference."""
    args = (
        write_idx,
        write_w,
        read_idx,
        read_w,
        decay,
        bank_rows,
        dA,
        dQK,
        d_gather_w,
        d_gather_r,
        d_scatter_w,
        d_row_decay,
    )
    if chunks is not None:
        dww, drw, ddc = reference.chunk_prepare_backward_varlen_reference(*args, chunks, seq_chunks)
    else:
        dww, drw, ddc = reference.chunk_prepare_backward_reference(*args)
    ddc = write_w.new_empty(0, dtype=dww.dtype) if ddc is None else ddc
    return dww.contiguous(), drw.contiguous(), ddc.contiguous()


_chunk_prepare_backward_reference = _reference_op(
    "chunk_prepare_backward",
    _chunk_prepare_backward_cpu,
    recurrence_meta.chunk_prepare_backward_fake,
    (),
)


def _chunk_prepare_backward(
    write_idx: Tensor,
    write_w: Tensor,
    read_idx: Tensor,
    read_w: Tensor,
    decay: Tensor | None,
    bank_rows: int,
    dA: Tensor,
    dQK: Tensor,
    d_gather_w: Tensor,
    d_gather_r: Tensor,
    d_scatter_w: Tensor,
    d_row_decay: Tensor,
    chunks: Tensor | None = None,
    seq_chunks: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``sdm_internal::chunk_prepare``: (d_write_w, d_read_w, d_decay), d_decay empty
    without decay; see ``kernels/chunk_prepare.py``."""
    if use_kernels(dA):
        from .kernels import chunk_prepare as k

        dww, drw, ddc = recurrence_meta.chunk_prepare_backward_fake(
            write_idx,
            write_w,
            read_idx,
            read_w,
            decay,
            bank_rows,
            dA,
            dQK,
            d_gather_w,
            d_gather_r,
            d_scatter_w,
            d_row_decay,
            chunks,
            seq_chunks,
        )
        with on_device(dA):
            k.chunk_prepare_bwd(
                write_idx=write_idx,
                write_w=write_w,
                read_idx=read_idx,
                read_w=read_w,
                decay=decay,
                bank_rows=bank_rows,
                dA=dA,
                dQK=dQK,
                d_gather_w=d_gather_w,
                d_gather_r=d_gather_r,
                d_scatter_w=d_scatter_w,
                d_row_decay=d_row_decay,
                d_write_w=dww,
                d_decay=None if decay is None else ddc,
                d_read_w=drw,
                chunks=chunks,
            )
        return dww, drw, ddc
    return _chunk_prepare_backward_reference(
        write_idx,
        write_w,
        read_idx,
        read_w,
        decay,
        bank_rows,
        dA,
        dQK,
        d_gather_w,
        d_gather_r,
        d_scatter_w,
        d_row_decay,
        chunks,
        seq_chunks,
    )


chunk_prepare_backward = triton_op("sdm_internal::chunk_prepare_backward", mutates_args=())(
    _chunk_prepare_backward
)


chunk_prepare_backward.register_fake(recurrence_meta.chunk_prepare_backward_fake)


class _Direct(NamedTuple):
    """What ``call`` runs for a public operator: its body (and ``autograd`` where an input
    requires grad; None for an operator without autograd), its name for the profiler and the
    positions of the arguments it mutates."""

    name: str
    body: Callable
    autograd: Callable | None
    mutated: tuple[int, ...] = ()


_DIRECT = {
    product_key_topk: _Direct(
        "sdm::product_key_topk",
        _product_key_topk,
        _autograd(_product_key_topk, _topk_setup, _topk_grad),
    ),
    wy_solve: _Direct(
        "sdm::wy_solve", _wy_solve, _autograd(_wy_solve, _wy_solve_setup, _wy_solve_grad)
    ),
    sparse_delta_memory: _Direct(
        "sdm::sparse_delta_memory",
        _sparse_delta_memory,
        _autograd(
            _sparse_delta_memory,
            _sparse_delta_memory_setup,
            _sparse_delta_memory_grad,
            kw_only=("keep_for_backward",),
            listed=2,
        ),
    ),
    sparse_delta_memory_: _Direct(
        "sdm::sparse_delta_memory_", _sparse_delta_memory_, None, mutated=(6,)
    ),
}
