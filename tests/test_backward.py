"""Gradients of the recurrence: every input, against float64 autograd of the token-by-token
oracle (``tests/oracle.py``) and finite differences; the backward kernels natively on CUDA and
under the interpreter on CPU; determinism. ``tests/test_oracle.py`` holds the oracle tests at
every chunk size, in bfloat16 and with quantized snapshots."""

import contextlib

import pytest
import torch

import sdm_ops
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_cuda,
    requires_kernels,
    sdm_positional,
    to_float64,
)
from tests.oracle import FLOATS, oracle_with_grads


def _grads(a, *, kernels: bool, chunk_size=16, snapshot="none", seed=1, loss_on_out=True):
    """Gradients of sum(out * g_out) + sum(bank * g_bank) with respect to every float input;
    without ``loss_on_out`` the loss is sum(bank * g_bank) alone (g_out returned as zeros)."""
    a = {k: (v.detach().clone().requires_grad_() if k in FLOATS else v) for k, v in a.items()}
    names = [n for n in FLOATS if n in a]
    with on_kernels() if kernels else contextlib.nullcontext():
        out, bank = sdm_ops.sparse_delta_memory(
            **a, chunk_size=chunk_size, snapshot=snapshot, output_final_state=True
        )
        g = torch.Generator().manual_seed(seed)
        g_out = torch.randn(out.shape, generator=g).to(out.device)
        g_bank = torch.randn(bank.shape, generator=g).to(bank.device)
        loss = (bank.float() * g_bank).sum()
        if loss_on_out:
            loss = (out.float() * g_out).sum() + loss
        else:
            g_out = torch.zeros_like(g_out)
        grads = torch.autograd.grad(loss, [a[n] for n in names])
    return dict(zip(names, grads)), g_out, g_bank


def _oracle(a, g_out, g_bank):
    """The gradients of the same loss from the float64 token-by-token oracle."""
    return oracle_with_grads(a, g_out, g_bank)[1]


def _check(got, want, rtol, what):
    for n in want:
        assert_close(got[n], want[n], rtol=rtol, name=f"{what}: d{n}")


@pytest.mark.parametrize("case", ["per_stream", "shared", "packed"])
def test_float64_gradcheck_through_the_cpu_operator(case):
    """``sdm::sparse_delta_memory``'s registered backward (phase 2's, the WY solve's with
    beta's share through the chunk layout, phase 1's) against finite differences, in float64
    on the reference path, over three chunks of two streams (a per-stream or a shared bank),
    or packed sequences of 3, 0 and 21 tokens (the last in two chunks); ``fast_mode`` checks
    the Jacobian along random directions, which keeps it cheap at these sizes."""
    if case == "packed":
        a = to_float64(make_packed_sdm_inputs([3, 0, 21], H=1, D=16, S=3, W=2, R=2, seed=21))
    else:
        shared = case == "shared"
        a = to_float64(make_sdm_inputs(B=2, T=37, H=1, D=16, S=3, W=2, R=2, shared=shared, seed=21))
    names = [n for n in FLOATS if n in a]

    def f(*xs):
        kw = dict(a, **dict(zip(names, xs)))
        out, bank, _ = torch.ops.sdm.sparse_delta_memory(
            *sdm_positional(kw),
            chunk_size=16,
            cu_seqlens=kw.get("cu_seqlens"),
            output_final_state=True,
        )
        return out, bank

    xs = [a[n].clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@requires_kernels
def test_kernel_gradients_shared_bank_all_on_one_slot_and_no_decay(phase2_tiles):
    a = make_sdm_inputs(
        T=20, S=2, W=4, R=3, D=32, shared=True, seed=23, zero_decay=0.4, device=KERNEL_DEVICE
    )
    got, g_out, g_bank = _grads(a, kernels=True)
    assert got["bank"].shape == a["bank"].shape
    _check(got, _oracle(a, g_out, g_bank), 1e-5, "shared bank")
    a = make_sdm_inputs(T=19, S=9, W=2, R=2, decay=False, seed=24, device=KERNEL_DEVICE)
    got, g_out, g_bank = _grads(a, kernels=True, chunk_size=32)
    _check(got, _oracle(a, g_out, g_bank), 1e-5, "no decay")


def test_only_the_output_or_only_the_bank_may_carry_gradient():
    a = make_sdm_inputs(T=9, seed=26)
    v = a["v"].clone().requires_grad_()
    out, bank = sdm_ops.sparse_delta_memory(**dict(a, v=v), output_final_state=True)
    (g1,) = torch.autograd.grad(out.sum(), v)
    out, bank = sdm_ops.sparse_delta_memory(**dict(a, v=v), output_final_state=True)
    (g2,) = torch.autograd.grad(bank.sum(), v)
    assert g1.abs().sum() > 0 and g2.abs().sum() > 0


@requires_kernels
def test_kernel_gradients_of_a_loss_on_the_bank_alone_match_reference():
    """No gradient reaches ``out`` (the backward gets None for it): read_w's gradient is exactly
    zero and the others match the float64 reference."""
    a = make_sdm_inputs(T=37, S=7, W=3, R=2, seed=30, device=KERNEL_DEVICE)
    got, g_out, g_bank = _grads(a, kernels=True, loss_on_out=False)
    assert torch.count_nonzero(got["read_w"]) == 0
    _check(got, _oracle(a, g_out, g_bank), 1e-5, "loss on the bank")


def test_backward_of_the_operator_run_without_keep_for_backward_raises_a_clear_error():
    """What the public function passes without autograd (the inference forward) keeps nothing:
    a backward asked of it later says so. With it, the operator's third output holds what the
    backward reads, none of it differentiable."""
    # S = 64 > T (W + R) = 45: without the final state the call numbers a working set.
    a = make_sdm_inputs(T=9, S=64, seed=31)
    v = a["v"].clone().requires_grad_()
    args = sdm_positional(dict(a, v=v))
    _, _, kept = torch.ops.sdm.sparse_delta_memory(*args, output_final_state=True)
    assert len(kept) == len(sdm_ops.ops.KEPT_FOR_BACKWARD)
    # Without the final state it also keeps the working set's layout (working_set.WorkingRows).
    _, _, kept = torch.ops.sdm.sparse_delta_memory(*args)
    assert len(kept) == len(sdm_ops.ops.KEPT_FOR_BACKWARD) + 3
    assert not any(t.requires_grad for t in kept)
    out, _, kept = torch.ops.sdm.sparse_delta_memory(*args, keep_for_backward=False)
    assert kept == [] and out.requires_grad
    with pytest.raises(RuntimeError, match="keep_for_backward=False"):
        out.sum().backward()


def test_double_backward_raises_a_clear_error():
    a = make_sdm_inputs(T=5, seed=27)
    v = a["v"].clone().requires_grad_()
    out, _ = sdm_ops.sparse_delta_memory(**dict(a, v=v), output_final_state=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), v, create_graph=True)


@requires_cuda
def test_gradients_match_reference_at_larger_shapes_on_cuda():
    a = make_sdm_inputs(B=2, T=200, H=2, D=64, S=2048, W=8, R=8, device="cuda", seed=28)
    got, g_out, g_bank = _grads(a, kernels=True, chunk_size=64)
    _check(got, _oracle(a, g_out, g_bank), 1e-5, "cuda")


@requires_cuda
def test_backward_is_bitwise_deterministic_on_cuda():
    a = make_sdm_inputs(B=4, T=700, H=4, D=64, S=256, W=8, R=8, device="cuda", seed=29)
    first, _, _ = _grads(a, kernels=True, chunk_size=64)
    second, _, _ = _grads(a, kernels=True, chunk_size=64)
    for n in first:
        assert torch.equal(first[n], second[n]), f"d{n} differs between two runs"


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the sdm and sdm_internal operators that run (the reference twins included)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("sdm", "sdm_internal"):
            self.ops.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "wanted,skipped",
    [
        (("v",), {"chunk_prepare_backward", "wy_solve_backward"}),
        (("v", "beta", "bank"), {"chunk_prepare_backward", "wy_solve_backward"}),
        (("write_w",), {"wy_solve_backward"}),
    ],
)
def test_gradients_not_asked_for_are_not_computed(wanted, skipped):
    """Phase 1's backward runs only for write_w, read_w or decay; the WY solve's backward never
    runs (phase 2's backward forms dA and dQK from du and delta); the other inputs never reach
    phase 1's."""
    a = make_sdm_inputs(1, 20, 2, 16, 9, 3, 2, seed=30)
    leaves = {k: a[k].detach().clone().requires_grad_(k in wanted) for k in FLOATS}
    out, bank = sdm_ops.sparse_delta_memory(
        **dict(a, **leaves), chunk_size=16, output_final_state=True
    )
    log = _OpLog()
    with log:
        grads = torch.autograd.grad((out.sum() + bank.sum()), [leaves[k] for k in wanted])
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert "recurrence_bwd" in log.ops, log.ops
    assert not (skipped & log.ops), f"ran {skipped & log.ops} though only {wanted} need grads"
    if "write_w" in wanted:
        assert "chunk_prepare_backward" in log.ops, log.ops
