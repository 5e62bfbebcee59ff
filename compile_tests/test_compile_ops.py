"""``torch.compile(fullgraph=True)`` of code using ``sdm_ops.wy_solve`` and
``sdm_ops.product_key_topk``: forward and backward equal to eager, dynamic leading sizes
compiling once, and (CUDA) the operators' Triton kernels in Inductor's output code."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import sdm_ops
from compile_tests import (
    assert_kernels_in_code,
    fresh_dynamo,  # noqa: F401  (an autouse fixture)
    kernels_defined_in,
    launched_kernels,
)
from tests.helpers import assert_close, make_raw, make_wy_inputs, requires_cuda

RTOL = 1e-5  # compiled against eager: float32 rounding
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
FACTORS, K = (8, 6), 5


def wy_and_topk(A, beta, QK, raw, dX, dQX, dval):
    """Both operators and a scalar loss through every differentiable output."""
    X, QX = sdm_ops.wy_solve(A, beta, QK)
    val, lin = sdm_ops.product_key_topk(raw, FACTORS, K)
    loss = (X * dX).sum() + (QX * dQX).sum() + (val * dval).sum()
    return X, QX, val, lin, loss


def make_inputs(n: int, rows: int, device: str, seed: int = 0):
    """(leaf inputs, output weights) for ``wy_and_topk``: n chunks of 16, raw [rows, 2, 14]."""
    A, beta, QK = make_wy_inputs(n, 16, seed=seed, device=device)
    raw = make_raw((rows, 2), FACTORS, seed=seed + 1, device=device)
    g = torch.Generator().manual_seed(seed + 2)
    weights = (
        torch.randn(n, 16, 16, generator=g),
        torch.randn(n, 16, 16, generator=g),
        torch.randn(rows, 2, K, generator=g),
    )
    return (A, beta, QK, raw), tuple(w.to(device) for w in weights)


def run_with_grads(fn, leaves, weights):
    """Outputs of ``fn`` and the gradients of its loss for fresh copies of ``leaves``."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    *outs, loss = fn(*leaves, *weights)
    loss.backward()
    return outs, [t.grad for t in leaves]


def assert_same_results(got, want, what: str):
    (outs, grads), (r_outs, r_grads) = got, want
    for name, a, b in zip(("X", "QX", "val"), outs, r_outs):
        assert_close(a, b, rtol=RTOL, name=f"{what}: {name}")
    assert torch.equal(outs[3], r_outs[3]), f"{what}: lin differs"
    for name, a, b in zip(("dA", "dbeta", "dQK", "draw"), grads, r_grads):
        assert_close(a, b, rtol=RTOL, name=f"{what}: {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_forward_and_backward_equal_eager(device):
    leaves, weights = make_inputs(3, 4, device)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(wy_and_topk, backend=counter, fullgraph=True)
    got = run_with_grads(compiled, leaves, weights)
    assert_same_results(got, run_with_grads(wy_and_topk, leaves, weights), "compiled vs eager")
    assert counter.frame_count == 1


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_leading_sizes_compile_once(device):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(wy_and_topk, backend=counter, fullgraph=True, dynamic=True)
    # Sizes distinct from each other and from the fixed sizes (2, K, C, sum(FACTORS)), so that
    # duck sizing ties no two dimensions together.
    for n, rows in ((3, 4), (6, 7), (9, 10)):
        leaves, weights = make_inputs(n, rows, device, seed=n)
        got = run_with_grads(compiled, leaves, weights)
        assert_same_results(
            got, run_with_grads(wy_and_topk, leaves, weights), f"N={n}, rows={rows}"
        )
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times over three "
        f"leading sizes; dynamic shapes should compile once"
    )


@requires_cuda
def test_inductor_code_holds_the_operators_triton_kernels():
    from sdm_ops.kernels import product_key_topk as topk_kernels
    from sdm_ops.kernels import wy_solve as wy_kernels

    kernels = (
        launched_kernels(wy_kernels.wy_solve_fwd)
        + launched_kernels(wy_kernels.wy_solve_bwd)
        + launched_kernels(topk_kernels.product_key_topk_fwd)
        + launched_kernels(topk_kernels.product_key_topk_bwd)
    )
    leaves, weights = make_inputs(3, 4, "cuda")
    compiled = torch.compile(wy_and_topk, fullgraph=True)
    _, codes = run_and_get_code(run_with_grads, compiled, leaves, weights)
    assert_kernels_in_code(kernels, codes, "wy_solve and product_key_topk, forward and backward")


def test_kernel_lookup_counts_definitions_not_mentions():
    """What the CUDA tests take for a kernel in Inductor's code: its spliced definition, under
    its own name or TORCHINDUCTOR_UNIQUE_USER_KERNEL_NAMES's; a comment naming it is not one."""
    code = (
        "@triton.jit\ndef _walk_kernel(x):\n    # out is left to _out_kernel\n"
        "    pass\n@triton.jit\ndef _sort_kernel_3(x):\n    pass\n"
    )
    names = ["_out_kernel", "_walk_kernel", "_sort_kernel", "_walk"]
    assert kernels_defined_in(names, [code]) == ["_sort_kernel", "_walk_kernel"]
    with pytest.raises(AssertionError, match="_out_kernel"):
        assert_kernels_in_code(["_walk_kernel", "_out_kernel"], [code], "example")


def test_kernel_discovery_finds_forward_and_backward_kernels():
    """The names the CUDA test looks for exist (checked here too, without a GPU)."""
    from sdm_ops.kernels import product_key_topk as topk_kernels
    from sdm_ops.kernels import wy_solve as wy_kernels

    for launcher in (
        wy_kernels.wy_solve_fwd,
        wy_kernels.wy_solve_bwd,
        topk_kernels.product_key_topk_fwd,
        topk_kernels.product_key_topk_bwd,
    ):
        assert launched_kernels(launcher)
    assert set(launched_kernels(wy_kernels)) == set(
        launched_kernels(wy_kernels.wy_solve_fwd) + launched_kernels(wy_kernels.wy_solve_bwd)
    )
