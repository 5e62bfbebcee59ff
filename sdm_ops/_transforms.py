"""PyTorch's transforms over the public functions: what works, and a clear error for the rest.

The operators are custom operators with registered reverse-mode autograd. PyTorch gives such
an operator no forward-mode derivative: a dual input (``torch.autograd.forward_ad``) comes back
with its tangent silently dropped, and ``torch.func.jvp`` returns zeros. functorch's ``vmap``
runs the kernels on batched tensors they cannot read. So the public functions refuse both,
naming themselves and the transform, before anything runs:

- forward-mode AD (a dual input at the current forward-AD level, or ``torch.func.jvp`` /
  ``jacfwd`` / ``hessian`` on the functorch stack): ``NotImplementedError``;
- ``torch.func.vmap`` (and ``jacrev``, which maps a vector-Jacobian product over the rows):
  ``NotImplementedError``.

``torch.func.grad`` and ``vjp`` are handled by the operators' eager path (``ops/eager.py``):
they give the same gradients as ``torch.autograd``.

The checks read PyTorch's transform state through private calls, looked up once; where one is
missing (another PyTorch release) that check is skipped, as PyTorch itself would then decide.
"""

from __future__ import annotations

import torch
from torch import Tensor

_functorch = getattr(torch._C, "_functorch", None)
_stack = getattr(_functorch, "get_interpreter_stack", None)
_is_wrapped = getattr(_functorch, "is_functorch_wrapped_tensor", None)
_unwrap = getattr(_functorch, "get_unwrapped", None)
_forward_ad = getattr(torch.autograd, "forward_ad", None)


_FORWARD = (
    "sdm_ops.{name} has no forward-mode derivative: forward-mode AD "
    "(torch.autograd.forward_ad, torch.func.jvp, jacfwd, hessian) is not supported; "
    "use reverse mode (torch.autograd.grad, backward(), torch.func.grad or vjp)"
)


def transform_names() -> list[str]:
    """The names of the functorch transforms active now, outermost first ("Grad", "Vmap",
    "Jvp", "Functionalize"); empty outside them (or where this PyTorch cannot tell)."""
    if _stack is None:
        return []
    return [str(i.key()).rsplit(".", 1)[-1] for i in (_stack() or [])]


def wrapped(t: Tensor) -> bool:
    """Whether ``t`` is a functorch wrapper (of a transform's level)."""
    return _is_wrapped is not None and _is_wrapped(t)


def unwrapped(t: Tensor) -> Tensor:
    """The tensor a functorch wrapper holds, one level down."""
    return _unwrap(t)


def _dual(t: Tensor) -> bool:
    """Whether ``t`` carries a forward-mode tangent at the current forward-AD level."""
    if _forward_ad is None or getattr(_forward_ad, "_current_level", -1) < 0:
        return False
    return _forward_ad.unpack_dual(t).tangent is not None


def check(name: str, *tensors: Tensor | None) -> None:
    """Raise ``NotImplementedError`` naming ``sdm_ops.<name>`` if it is called under forward-
    mode AD or a functorch transform it does not support (the module docstring)."""
    if torch.compiler.is_compiling():
        # Traced code cannot see a fake tensor's tangent, and a compiled graph drops every
        # tangent (PyTorch's own behaviour for any function): inside a forward-AD level at
        # all, refuse.
        if _forward_ad is not None and getattr(_forward_ad, "_current_level", -1) >= 0:
            raise NotImplementedError(_FORWARD.format(name=name))
        return
    names = transform_names()
    if "Jvp" in names or any(t is not None and _dual(t) for t in tensors):
        raise NotImplementedError(_FORWARD.format(name=name))
    if "Vmap" in names:
        raise NotImplementedError(
            f"sdm_ops.{name} does not support torch.func.vmap (nor jacrev, which maps over "
            "the rows of the Jacobian): batch the inputs along their batch dimension instead"
        )
