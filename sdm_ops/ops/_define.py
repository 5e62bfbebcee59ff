"""How an operator with a CPU twin is defined: its signature written once.

``kernel_op`` takes a declaration, a function whose annotated signature is the operator's and
whose docstring states its contract, and derives everything else from that one signature:

* ``Args``, a NamedTuple of the operator's arguments by name (with its defaults), which the
  kernel path and the CPU path take as their one argument ``a``;
* the body: ``kernels(a)`` where ``use_kernels`` says so for the argument named ``on`` (CUDA
  tensors, or CPU tensors inside ``kernels_on_cpu``), otherwise the CPU twin;
* the operator ``<namespace>::<name>``, a ``torch.library.triton_op`` of the body, with its
  fake from ``sdm_ops.meta``;
* the CPU twin ``sdm_internal::<twin>_reference``, an opaque ``custom_op`` of the same schema
  running ``reference(a)``, with the same fake.

The twin is opaque because torch.compile traces a triton_op's body (also on the CPU, even with a
CPU kernel registered, so the device branch belongs inside the body): tracing the reference
itself would unroll its loop over chunks, a recompilation for every chunk count, where an
opaque operator with a fake compiles once for all shapes.
"""

from __future__ import annotations

import collections
import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.library import custom_op, infer_schema, triton_op

from ..kernels._common import use_kernels

PUBLIC = "sdm"
INTERNAL = "sdm_internal"


def kernel_op(
    qualname: str,
    *,
    on: str,
    kernels: Callable[[Any], Any],
    reference: Callable[[Any], Any],
    fake: Callable,
    mutates_args: tuple[str, ...] = (),
    twin: str | None = None,
    contiguous: bool = False,
) -> Callable[[Callable], Callable]:
    """A decorator turning a declaration into the body of the operator ``qualname``
    (``"sdm::name"`` or ``"sdm_internal::name"``), registered with its CPU twin (named
    ``twin`` or the operator's own name, then ``_reference``) as the module docstring says.
    With ``contiguous`` the body makes its tensor arguments contiguous first (the public
    operators take any dense layout). The body keeps the declaration's name, signature and
    docstring; ``body.op`` is the operator and ``body.Args`` the arguments' NamedTuple."""

    def define(declaration: Callable) -> Callable:
        signature = inspect.signature(declaration, eval_str=True)
        params = signature.parameters.values()
        Args = collections.namedtuple(
            f"{declaration.__name__.strip('_')}_args",
            [p.name for p in params],
            defaults=[p.default for p in params if p.default is not p.empty],
        )

        def run_reference(*args, **kwargs):
            return reference(Args(*args, **kwargs))

        name = qualname.split("::")[1]
        reference_op = custom_op(
            f"{INTERNAL}::{twin or name}_reference",
            run_reference,
            mutates_args=mutates_args,
            schema=infer_schema(declaration, mutates_args=mutates_args),
        )
        reference_op.register_fake(fake)

        def body(*args, **kwargs):
            a = Args(*args, **kwargs)
            if contiguous:
                a = Args._make(x.contiguous() if isinstance(x, Tensor) else x for x in a)
            if use_kernels(getattr(a, on)):
                return kernels(a)
            return reference_op(*a)

        functools.update_wrapper(body, declaration)
        body.__signature__ = signature
        body.Args = Args
        body.op = triton_op(qualname, mutates_args=mutates_args)(body)
        body.op.register_fake(fake)
        return body

    return define
