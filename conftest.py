"""Test-session setup shared by tests/ and compile_tests/.

Without CUDA, Triton kernels run on CPU tensors under the interpreter, which must be chosen
before triton is imported: this file is loaded before any test module imports sdm_ops.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
