"""Test-session setup shared by tests/ and compile_tests/.

Without CUDA, Triton kernels run on CPU tensors under the interpreter, which must be chosen
before triton is imported: this file is loaded before any test module imports sdm_ops.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_state_leaks_out_of_a_test():
    """A test leaves the process as it found it: the operators run their CPU reference on CPU
    tensors (``kernels_on_cpu`` scoped), and wrap_triton dispatches through its operator (the
    eager path disables it only inside a call). A leak would change what later tests run."""
    yield
    from torch._library.triton import is_wrap_triton_enabled

    from sdm_ops.kernels._common import _ON_CPU

    assert not _ON_CPU.get(), "a test left the kernel path on for CPU tensors"
    assert is_wrap_triton_enabled(), "a test left wrap_triton disabled"
