"""What every kernel module shares: when kernels run, and small launch helpers (grids).

Kernels run on CUDA tensors. On CPU tensors the operators run the reference instead, except
inside :func:`kernels_on_cpu` with ``TRITON_INTERPRET=1`` set before triton was imported: then
the Triton kernels themselves run under the interpreter (how CI checks them without a GPU).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import torch
import triton

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


def chunk_grid(B: int, T: int, H: int, C: int, chunks) -> tuple[int, int]:
    """(chunks, streams) of the per-chunk grids: (ceil(T / C), B * H), or for a packed batch
    (its chunk slots, H)."""
    return (triton.cdiv(T, C), B * H) if chunks is None else (chunks.shape[0], H)


# A launch for the few chunks of one kind (phase 1's windowed tier, its dense kernels' heavy
# chunks after the sparse path) runs at most this many chunk programs an SM, each walking every
# G-th chunk.
STRIDED_PROGRAMS_PER_SM = 2
STRIDED_PROGRAMS: int | None = None  # a fixed bound instead (tests bound it to walk)


def strided_grid(N: int, P: int, device: torch.device) -> tuple[int, int]:
    """The chunk grid of a launch for few chunks of N * P: at most STRIDED_PROGRAMS_PER_SM
    programs an SM of ``device`` (a program's chunks do not depend on the grid's width, so
    neither does the result); without SMs (the interpreter) one program a chunk."""
    if STRIDED_PROGRAMS is not None:
        return min(N * P, STRIDED_PROGRAMS), 1
    sms = sm_count(device)
    return (min(N * P, STRIDED_PROGRAMS_PER_SM * sms) if sms else N * P), 1
