"""Triton kernels and their launchers, one module per phase of the recurrence.

Launchers take contiguous operands and preallocated outputs, check nothing the public
functions already checked, and launch through ``torch.library.wrap_triton`` so that Inductor
sees the kernels. They are reached only through the ``sdm_internal::`` operators of ``sdm_ops.ops``.
"""
