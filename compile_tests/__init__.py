"""torch.compile tests of sdm_ops: fullgraph forward and backward equal to eager, dynamic
shapes compiling once, Inductor's output code holding the operators' Triton kernels (CUDA),
CUDA graph capture of decode steps (CUDA).

Shared here: which Triton kernels a launcher starts, read from its source, so the tests follow
the kernel modules as they change; and the ``fresh_dynamo`` fixture.
"""

from __future__ import annotations

import inspect
import re
import types

import pytest
import torch
import triton

import sdm_ops

try:  # what ``triton.jit`` returns under TRITON_INTERPRET=1
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:
    InterpretedFunction = triton.JITFunction
JIT_TYPES = (triton.JITFunction, InterpretedFunction)


CHUNK = 16  # the chunk size of the compiled calls


def run_sdm(**args):
    """``sparse_delta_memory`` of ``args`` (``make_sdm_inputs``' names, ``cu_seqlens`` too) at
    chunk size CHUNK, with the final state: the function the tests compile and call eagerly."""
    return sdm_ops.sparse_delta_memory(**args, chunk_size=CHUNK, output_final_state=True)


def sdm_loss(g_out, g_bank, **args):
    """``<out, g_out> + <bank, g_bank>`` of :func:`run_sdm`: a scalar whose gradient reaches
    every float input."""
    out, new_bank = run_sdm(**args)
    return (out * g_out).sum() + (new_bank * g_bank).sum()


def _jit_function(obj):
    """The ``@triton.jit`` function behind ``obj`` (through autotuners and heuristics)."""
    while obj is not None and not isinstance(obj, JIT_TYPES):
        obj = getattr(obj, "fn", None)
    return obj


def launched_kernels(launcher: types.FunctionType | types.ModuleType) -> list[str]:
    """Names of the ``@triton.jit`` functions that ``launcher`` (a launcher function or a whole
    kernel module) starts through ``wrap_triton(...)``, in source order, without repeats. The
    argument may choose between kernels (``wrap_triton(a if c else b)``): each module-level
    name in it that is a kernel (or an autotuner of one) counts."""
    launches = re.findall(r"wrap_triton\(([^()]*)\)", inspect.getsource(launcher))
    scope = vars(launcher) if isinstance(launcher, types.ModuleType) else launcher.__globals__
    kernels = []
    for launch in launches:
        fns = [_jit_function(scope.get(name)) for name in re.findall(r"\w+", launch)]
        fns = [fn for fn in fns if fn is not None]
        assert fns, f"{launcher.__name__} launches {launch.strip()}, not a @triton.jit function"
        for fn in fns:
            if fn.__name__ not in kernels:
                kernels.append(fn.__name__)
    assert kernels, f"found no wrap_triton launch in {launcher.__name__}"
    return kernels


def kernels_defined_in(kernels, codes: list[str]) -> list[str]:
    """Those of ``kernels`` whose definition Inductor's output code (``run_and_get_code``'s
    strings) holds, sorted: ``def name(`` as Inductor splices a user-defined Triton kernel's
    source in, or ``def name_<n>(`` under TORCHINDUCTOR_UNIQUE_USER_KERNEL_NAMES=1. A name met
    only in a comment or docstring of a spliced kernel does not count."""
    code = "\n".join(codes)
    return sorted(k for k in kernels if re.search(rf"(?<!\w)def {re.escape(k)}(_\d+)?\(", code))


def assert_kernels_in_code(kernels: list[str], codes: list[str], what: str) -> None:
    """Inductor's output code defines each kernel (``kernels_defined_in``)."""
    missing = sorted(set(kernels) - set(kernels_defined_in(kernels, codes)))
    assert not missing, (
        f"{what}: Inductor's output code ({len(codes)} module(s)) lacks the "
        f"Triton kernels {missing}; expected all of {kernels}"
    )


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles and counts its own graphs: Dynamo forgets earlier compilations
    before and after it (autouse in every module that imports it)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
