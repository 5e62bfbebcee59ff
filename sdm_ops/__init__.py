"""sdm_ops: compile-native PyTorch operators for the sparse delta memory recurrence."""

import sys

__all__ = [
    "SDMOutput",
    "TopK",
    "WYSolution",
    "product_key_topk",
    "set_strict_checks",
    "sparse_delta_memory",
    "sparse_delta_memory_",
    "strict_checks",
    "strict_checks_enabled",
    "wy_solve",
]
__version__ = "0.1.0"

# `python -m sdm_ops.<command> --help` prints at once: while Python locates a command given to
# -m it imports this package with sys.argv[0] set to "-m" (the documented behaviour of -m), and
# a command prints its help before it imports torch. Any other import loads everything.
_argv = getattr(sys, "argv", [])
if _argv[:1] != ["-m"] or {"-h", "--help"}.isdisjoint(_argv[1:]):
    from . import nn  # noqa: F401  (sdm_ops.nn.SparseDeltaMemory)
    from . import ops as _ops  # noqa: F401  (registers the sdm:: and sdm_internal:: operators)
    from ._checks import set_strict_checks, strict_checks, strict_checks_enabled
    from .product_key import TopK, product_key_topk
    from .recurrence import SDMOutput, sparse_delta_memory, sparse_delta_memory_
    from .wy import WYSolution, wy_solve
