"""Triton kernels and their launchers, one module per algorithm with its backward; modules named
``_...`` hold what several share (launch helpers, tile loaders, the snapshot's storage, top-k
keys) and launch nothing.

Launchers take contiguous operands and preallocated outputs, check nothing the public
functions already checked, and launch through ``torch.library.wrap_triton`` so that Inductor
sees the kernels. They are reached only through the operators of ``sdm_ops.ops``.
"""
