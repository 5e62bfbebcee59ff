"""How an operator is declared: its signature written once.

An operator's body is declared by a function whose annotated signature is the operator's and
whose docstring states its contract. ``arguments`` makes from that signature ``Args``, a
NamedTuple of the operator's arguments by name (with its defaults); the fake of
``sdm_ops.meta``, and the kernel and CPU paths below, take the arguments as that one value
``a``, so none of them writes the signature again (``register_fake``).

``define_op`` registers an operator whose body calls other operators' bodies (the public
recurrence operators); ``kernel_op`` declares an operator with a CPU twin:

    @kernel_op("sdm_internal::name", on="x", fake=meta.name_fake)
    def _name(x: Tensor, ...) -> Tensor:
        '''The contract.'''

    @_name.kernels
    def _name_kernels(a): ...      # launches the Triton kernels

    @_name.reference
    def _name_cpu(a): ...          # the reference of sdm_ops.reference

The declaration becomes the body of the operator ``name`` (``_name.op``, a
``torch.library.triton_op``): ``kernels(a)`` where ``use_kernels`` says so for the argument
``on`` (CUDA tensors, or CPU tensors inside ``kernels_on_cpu``), otherwise the CPU twin
``sdm_internal::<name>_reference``, an opaque ``custom_op`` of the same schema running
``reference(a)``. The twin is opaque because torch.compile traces a triton_op's body (also on
the CPU, even with a CPU kernel registered, so the device branch belongs inside the body):
tracing the reference itself would unroll its loop over chunks, a recompilation for every chunk
count, where an opaque operator with a fake compiles once for all shapes.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.library import custom_op, infer_schema, triton_op

from ..kernels._common import use_kernels

PUBLIC = "sdm"
INTERNAL = "sdm_internal"


def arguments(declaration: Callable) -> tuple[inspect.Signature, type]:
    """(signature, Args) of ``declaration``: its signature with the annotations evaluated, and
    a NamedTuple of its parameters, in order, with their defaults."""
    signature = inspect.signature(declaration, eval_str=True)
    params = signature.parameters.values()
    Args = collections.namedtuple(
        f"{declaration.__name__.strip('_')}_args",
        [p.name for p in params],
        defaults=[p.default for p in params if p.default is not p.empty],
    )
    return signature, Args


def register_fake(op, fake: Callable[[Any], Any], Args: type) -> None:
    """Register ``fake``, a function of the arguments as one ``Args``, as ``op``'s fake."""
    op.register_fake(lambda *args, **kwargs: fake(Args(*args, **kwargs)))


def define_op(
    qualname: str, body: Callable, *, fake: Callable[[Any], Any], mutates_args: tuple[str, ...] = ()
):
    """The operator ``qualname`` (a ``torch.library.triton_op``) whose body is ``body``, with
    ``fake``, a function of the arguments as one value (``register_fake``)."""
    op = triton_op(qualname, mutates_args=mutates_args)(body)
    register_fake(op, fake, arguments(body)[1])
    return op


def kernel_op(
    qualname: str,
    *,
    on: str,
    fake: Callable[[Any], Any],
    mutates_args: tuple[str, ...] = (),
    twin: str | None = None,
    contiguous: bool = False,
) -> Callable[[Callable], Callable]:
    """A decorator turning a declaration into the body of the operator ``qualname``
    (``"sdm::name"`` or ``"sdm_internal::name"``) with a CPU twin named ``twin`` (default: the
    operator's name), then ``_reference``, as the module docstring shows. With ``contiguous``
    the body makes its tensor arguments contiguous first (the public operators take any dense
    layout). The body keeps the declaration's name, signature and docstring; ``body.op`` is the
    operator, ``body.Args`` the arguments' NamedTuple, ``body.kernels`` and ``body.reference``
    the decorators that give it its two paths."""
    name = qualname.split("::")[1]

    def define(declaration: Callable) -> Callable:
        signature, Args = arguments(declaration)
        paths: dict[str, Callable] = {}

        def body(*args, **kwargs):
            a = Args(*args, **kwargs)
            if contiguous:
                a = Args._make([x.contiguous() if isinstance(x, Tensor) else x for x in a])
            if use_kernels(getattr(a, on)):
                return paths["kernels"](a)
            return paths["twin"](*a)

        def kernels(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            paths["kernels"] = fn
            return fn

        def reference(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
            paths["twin"] = twin_op = custom_op(
                f"{INTERNAL}::{twin or name}_reference",
                lambda *args, **kwargs: fn(Args(*args, **kwargs)),
                mutates_args=mutates_args,
                schema=infer_schema(declaration, mutates_args=mutates_args),
            )
            register_fake(twin_op, fake, Args)
            return fn

        functools.update_wrapper(body, declaration)
        body.__signature__ = signature
        body.Args, body.kernels, body.reference = Args, kernels, reference
        body.op = define_op(qualname, body, fake=fake, mutates_args=mutates_args)
        return body

    return define


def source_tag(root: Path) -> str:
    """``sdm_ops-`` and a hash of every Python file under ``root`` (names and bytes)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return "sdm_ops-" + digest.hexdigest()[:16]


def key_compile_caches() -> str:
    """Add the package's ``source_tag`` to ``torch.compiler.config.cache_key_tag`` and return it.

    torch.compile's caches (AOTAutograd's and Inductor's, on disk across processes) key a
    compiled graph on the graph Dynamo captured, in which an operator is only its name: the
    Python behind it (an autograd formula, the operators a body calls) is not in the key. After
    sdm_ops changes, a graph cached before would run the old code, or fail where an internal
    operator's arguments changed. With the tag in the key it is compiled again. A tag the user
    set (``TORCH_COMPILE_CACHE_KEY_TAG``) is kept in front of it."""
    tag = source_tag(Path(__file__).resolve().parents[1])
    config = torch.compiler.config
    if tag not in config.cache_key_tag.split("+"):
        config.cache_key_tag = "+".join(t for t in (config.cache_key_tag, tag) if t)
    return tag
