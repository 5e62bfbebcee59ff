"""What every kernel module shares: when kernels run, and small launch helpers.

Kernels run on CUDA tensors. On CPU tensors the operators run the reference instead, except
inside :func:`kernels_on_cpu` with ``TRITON_INTERPRET=1`` set before triton was imported: then
the Triton kernels themselves run under the interpreter (how CI checks them without a GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch

_ON_CPU = contextvars.ContextVar("sdm_ops_kernels_on_cpu", default=False)


def interpreting() -> bool:
    """Triton runs kernels under its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def kernels_on_cpu():
    """Run the operators' Triton kernels on CPU tensors (requires ``TRITON_INTERPRET=1``)."""
    if not interpreting():
        raise RuntimeError("kernels_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
    token = _ON_CPU.set(True)
    try:
        yield
    finally:
        _ON_CPU.reset(token)


def use_kernels(t: torch.Tensor) -> bool:
    """Whether an operator on ``t`` launches its Triton kernels (else it runs the reference)."""
    return t.is_cuda or (_ON_CPU.get() and t.device.type == "cpu")


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device``: 0 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def on_device(t: torch.Tensor):
    """A context that makes ``t``'s CUDA device the current one while an operator launches its
    kernels. Triton launches on the current device and PyTorch's Python dispatch adds no device
    guard, so tensors on another GPU would otherwise reach kernels launched on the wrong one.
    A no-op when that device is already current, on the CPU, and while compiling (Inductor's
    generated code sets the device itself)."""
    if (
        not torch.compiler.is_compiling()
        and t.is_cuda
        and t.device.index != torch.cuda.current_device()
    ):
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
