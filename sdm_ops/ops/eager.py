"""The eager path around the dispatcher.

A custom operator's dispatch costs the host about as much time as a small body, so an eager
call dispatches no custom operator where the dispatcher has nothing else to do:

* each public function reaches its operator through ``call(route, ...)``, ``route`` naming the
  operator, its body and the autograd.Function made of its registered setup and backward
  (``route``). Eagerly, on plain tensors that launch kernels and outside tracing and modes
  (``eager_plain``), ``call`` runs the body itself, through that autograd.Function where an
  input requires grad; otherwise (``torch.compile``, ``torch.export``, ``torch.jit.trace``,
  ``opcheck``, a dispatch mode, the CPU reference) it calls the operator;
* the public operators' bodies call the internal operators' bodies, and their registered
  backwards do the same when eager (``in_backward``; while traced or under ``create_graph``
  they call the operators).

A traced call sees the same kernels either way: under torch.compile a triton_op's body is
traced into its kernels.

The path rests on private PyTorch calls (``PRIVATE``), looked up once at import. Where this
PyTorch lacks one of them, ``PRIVATE`` is None and every call goes through the dispatcher: the
same kernels on the same tensors, at the dispatcher's host cost.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .. import _transforms
from ..kernels._common import use_kernels


class Private(NamedTuple):
    """The private PyTorch calls the path around the dispatcher needs."""

    is_tracing: Callable[[], bool]  # torch.jit.trace is recording
    torch_function_mode: Callable[[], bool]  # a torch function mode is active
    functorch_layer: Callable[[], Any]  # the innermost functorch transform, or None
    dispatch_mode: Callable[[], Any]  # the innermost dispatch mode, or None
    # A context in which wrap_triton launches kernels directly (no higher-order operator).
    wrap_triton_enabled: Callable[[bool], AbstractContextManager]
    profiling: Callable[[], bool]  # the autograd profiler is on


def find_private() -> Private | None:
    """The private calls of this PyTorch, or None where one is missing."""
    try:
        from torch._library.triton import set_wrap_triton_enabled
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        return Private(
            is_tracing=torch._C._is_tracing,
            torch_function_mode=torch._C._is_torch_function_mode_enabled,
            functorch_layer=torch._C._functorch.peek_interpreter_stack,
            dispatch_mode=_get_current_dispatch_mode,
            wrap_triton_enabled=set_wrap_triton_enabled,
            profiling=torch._C._autograd._profiler_enabled,
        )
    except (ImportError, AttributeError):
        return None


PRIVATE = find_private()
# Set while functorch runs a registered backward (``_functorch``).
_FUNCTORCH: contextvars.ContextVar[bool] = contextvars.ContextVar("sdm_functorch", default=False)


def traced(t: Tensor) -> bool:
    """Whether an operator body runs traced (torch.compile, torch.export, opcheck's checks: fake
    or functional tensors) rather than eagerly on ``t`` itself."""
    return torch.compiler.is_compiling() or isinstance(t, (FakeTensor, FunctionalTensor))


def eager_backward(t: Tensor) -> bool:
    """Whether a registered backward (on tensors like ``t``) runs the internal operators'
    bodies (``in_backward``): eagerly, but not while traced, under a dispatch mode (which
    should see the operators) or with grad mode on (``create_graph``: an operator, which has
    no autograd, refuses a double backward where its body would drop a term) or in a
    backward functorch runs (``_functorch``: its tensors are wrappers that only the operators'
    dispatch unwraps)."""
    return PRIVATE is not None and not (
        torch.is_grad_enabled()
        or traced(t)
        or PRIVATE.dispatch_mode() is not None
        or _FUNCTORCH.get()
    )


def in_backward(body: Callable, eager: bool) -> Callable:
    """What a registered backward calls for the operator whose body is ``body``
    (``_define.kernel_op``): with ``eager`` (``eager_backward``) the body with its kernels
    launched directly, as the operator's own eager call launches them, since each dispatch is
    host time that every backward pays; otherwise the operator itself."""
    if not eager:
        return body.op

    def run(*args, **kwargs):
        with PRIVATE.wrap_triton_enabled(False):
            return body(*args, **kwargs)

    return run


_PLAIN = (Tensor, torch.nn.Parameter)


def eager_plain(tensors: list[Tensor]) -> bool:
    """Whether an eager call of a public operator on ``tensors`` leaves the dispatcher nothing
    to do but call the body and record autograd: plain tensors that launch kernels
    (``use_kernels``), outside tracing (``torch.compile``, ``torch.export``,
    ``torch.jit.trace``), dispatch modes, torch function modes and functorch transforms; and
    this PyTorch has the calls that tell (``PRIVATE``)."""
    if (
        PRIVATE is None
        or torch.compiler.is_compiling()
        or PRIVATE.is_tracing()
        or PRIVATE.dispatch_mode() is not None
        or PRIVATE.torch_function_mode()
        or PRIVATE.functorch_layer() is not None
    ):
        return False
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    return use_kernels(tensors[0])


class Route(NamedTuple):
    """How ``call`` reaches a public operator: the operator ``op`` (named ``name``), its body,
    and ``autograd``, the body under the operator's registered autograd (None for an operator
    without autograd, which an input that requires grad then dispatches); ``mutated``: the
    positions of the arguments the operator mutates; ``functorch``: the operator under its
    registered autograd as an autograd.Function that ``torch.func.grad`` and ``vjp`` accept."""

    name: str
    op: Callable
    body: Callable
    autograd: Callable | None = None
    mutated: tuple[int, ...] = ()
    functorch: Callable | None = None


def route(
    name: str,
    op: Callable,
    body: Callable,
    *,
    setup: Callable | None = None,
    backward: Callable | None = None,
    kw_only: tuple[str, ...] = (),
    listed: int | None = None,
    mutated: tuple[int, ...] = (),
) -> Route:
    """The route of the public operator ``op`` (named ``name``) whose body is ``body``. With
    ``backward``, registers the operator's autograd (``setup`` its setup context) and makes the
    same an autograd.Function for ``call`` (``_autograd``: ``kw_only`` and ``listed`` as
    there)."""
    if backward is None:
        return Route(name, op, body, None, mutated)
    op.register_autograd(backward, setup_context=setup)
    return Route(
        name,
        op,
        body,
        _autograd(body, setup, backward, kw_only, listed),
        mutated,
        _functorch(name, op, setup, backward, kw_only, listed),
    )


def call(route: Route, *args, **kwargs):
    """``route.op(*args, **kwargs)`` for a public function, which passes the operator's
    arguments positionally and its keyword-only ones by keyword. Eagerly, where the dispatcher
    would only call the body and record autograd (``eager_plain``), the body itself, with its
    kernels launched directly as the operator's own eager call launches them, and where an
    input requires grad, through ``route.autograd``: each dispatch costs the host about as
    much time as a small body, and the same kernels run on the same tensors. An argument the
    operator mutates gets its version bumped, as the dispatcher bumps it, and under the
    profiler the call is a range named after the operator. Otherwise (traced, a mode, the CPU
    reference) the operator."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    if (
        route.functorch is not None
        and not torch.compiler.is_compiling()
        and "Grad" in _transforms.transform_names()
    ):
        return route.functorch(tensors, *args, *kwargs.values())
    if not eager_plain(tensors):
        return route.op(*args, **kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        if route.autograd is None:
            return route.op(*args, **kwargs)
        run = lambda: route.autograd(*args, *kwargs.values())
    else:
        run = lambda: route.body(*args, **kwargs)
    with PRIVATE.wrap_triton_enabled(False):
        if PRIVATE.profiling():
            with torch.profiler.record_function(route.name):
                out = run()
        else:
            out = run()
    for i in route.mutated:
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


def public_name(qualname: str) -> str:
    """``sdm::wy_solve`` -> ``wy_solve``: the name of the public function."""
    return qualname.split("::")[-1]


def no_double_backward(name: str) -> None:
    """Refuse a backward that would itself be differentiated (``create_graph=True``): the
    registered backwards run the kernels with no autograd of their own, and a silently missing
    second-order term would be a wrong answer."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"sdm_ops: {name} does not support double backward (its backward "
            "is not differentiable); do not pass create_graph=True"
        )


def _base(t: Tensor) -> Tensor:
    """The tensor under functorch's wrappers."""
    while _transforms.wrapped(t):
        t = _transforms.unwrapped(t)
    return t


def _functorch(name, op, setup, backward, kw_only=(), listed=None):
    """A function running the operator ``op`` under its registered ``setup`` and ``backward``
    inside functorch's ``grad`` or ``vjp`` (an autograd.Function with ``setup_context``,
    which functorch requires): the same kernels and the same gradients as ``torch.autograd``.
    It takes ``(tensors, *arguments)`` as ``_autograd`` takes the arguments. Under two
    gradient transforms (a second derivative), or with an input that also requires grad
    outside the transform, it refuses: the backward is not differentiable."""
    k = len(kw_only)
    public = public_name(name)

    def split(args):
        return (args[:-k], dict(zip(kw_only, args[-k:]))) if k else (args, {})

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            inputs, kw = split(args)
            output = op(*inputs, **kw)
            return tuple(output) if listed is None else (*output[:listed], *output[listed])

        @staticmethod
        def setup_context(ctx, args, output):
            inputs, kw = split(args)
            if listed is not None:
                output = (*output[:listed], list(output[listed:]))
            if k:
                setup(ctx, inputs, kw, output)
            else:
                setup(ctx, inputs, output)
            ctx.arguments = len(args)

        @staticmethod
        def backward(ctx, *grads):
            if "Vmap" in _transforms.transform_names():
                raise NotImplementedError(
                    f"sdm_ops.{public} does not support torch.func.vmap (nor jacrev, which "
                    "maps its backward over the rows of the Jacobian)"
                )
            if listed is not None:
                grads = (*grads[:listed], None)
            # functorch differentiates with create_graph=True; one level of it (checked
            # when the operator ran) needs no graph of the backward itself.
            token = _FUNCTORCH.set(True)
            try:
                with torch.no_grad():
                    got = tuple(backward(ctx, *grads))
            finally:
                _FUNCTORCH.reset(token)
            return (got + (None,) * ctx.arguments)[: ctx.arguments]

    def apply(tensors, *args):
        names = _transforms.transform_names()
        outside = torch.is_grad_enabled() and any(_base(t).requires_grad for t in tensors)
        if names.count("Grad") > 1 or outside:
            raise RuntimeError(
                f"sdm_ops: {public} does not support double backward: under torch.func.grad "
                "or vjp, give it inputs that need no gradient outside the transform (detach "
                "them), and nest no second gradient transform over it"
            )
        output = Function.apply(*args)
        return output if listed is None else (*output[:listed], list(output[listed:]))

    return apply
