"""PyTorch's transforms and modes over the public functions: forward-mode AD and functorch's
jvp and vmap refuse with an error naming the function (no tangent is dropped silently), a
double backward names the public function, and the in-place form refuses a bank it may not
update before writing anything; on the CPU it updates the bank without a copy of it."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.autograd import forward_ad as fwAD

import sdm_ops
from sdm_ops.nn import SparseDeltaMemory
from tests.helpers import (
    KERNEL_DEVICE,
    make_raw,
    make_sdm_inputs,
    make_wy_inputs,
    on_kernels,
    requires_kernels,
)

BACKENDS = [
    pytest.param(False, id="cpu_operators"),
    pytest.param(True, id="kernels", marks=requires_kernels),
]
ORDER = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "bank", "decay")


def _backend(kernels: bool):
    return on_kernels() if kernels else contextlib.nullcontext()


def _calls(device: str) -> dict:
    """Each public function as a callable of one float tensor (the one a tangent rides on),
    with that tensor's value."""
    a = make_sdm_inputs(B=1, T=20, H=2, D=16, S=9, W=3, R=2, seed=1, device=device)
    rest = {k: x for k, x in a.items() if k != "v"}
    raw = make_raw((3, 4), (8, 6), seed=2, device=device)
    A, beta, QK = make_wy_inputs(2, 16, seed=3, device=device)

    def inplace(v):
        bank = a["bank"].clone()
        return sdm_ops.sparse_delta_memory_(
            v, **{k: x for k, x in rest.items() if k != "bank"}, bank=bank
        )

    return {
        "sparse_delta_memory": (
            lambda v: sdm_ops.sparse_delta_memory(v, **rest, chunk_size=16).out,
            a["v"],
        ),
        "sparse_delta_memory_": (inplace, a["v"]),
        "product_key_topk": (lambda r: sdm_ops.product_key_topk(r, (8, 6), 4).val, raw),
        "wy_solve": (lambda x: sdm_ops.wy_solve(x, beta, QK).X, A),
    }


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize(
    "name", ["sparse_delta_memory", "sparse_delta_memory_", "product_key_topk", "wy_solve"]
)
def test_forward_mode_ad_raises_naming_the_function_on_a_dual_input(kernels, name):
    fn, x = _calls(KERNEL_DEVICE if kernels else "cpu")[name]
    match = f"sdm_ops.{name} has no forward-mode derivative"
    with _backend(kernels):
        with fwAD.dual_level():
            dual = fwAD.make_dual(x, torch.randn_like(x))
            with pytest.raises(NotImplementedError, match=match):
                fn(dual)
        with pytest.raises(NotImplementedError, match=match):
            torch.func.jvp(fn, (x,), (torch.randn_like(x),))
        with pytest.raises(NotImplementedError, match=f"sdm_ops.{name} does not support .*vmap"):
            torch.func.vmap(fn)(x[None].expand(2, *x.shape).clone())


def test_forward_mode_ad_through_the_layer_raises():
    layer = SparseDeltaMemory(32, 2, 16, (8, 8), 4, 4)
    x = torch.randn(2, 20, 32)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.randn_like(x))
        with pytest.raises(NotImplementedError, match="has no forward-mode derivative"):
            layer(dual)


def test_compiled_code_inside_a_forward_ad_level_refuses():
    """torch.compile drops the tangents of any compiled function (PyTorch's own behaviour), so
    a compiled call of an operator inside a forward-AD level refuses; with fullgraph=True the
    refusal comes as dynamo's error holding the message."""
    A, beta, QK = make_wy_inputs(2, 16, seed=4)
    f = torch.compile(lambda x: sdm_ops.wy_solve(x, beta, QK).X, fullgraph=True, backend="eager")
    with fwAD.dual_level():
        dual = fwAD.make_dual(A, torch.randn_like(A))
        with pytest.raises(Exception, match="no forward-mode derivative"):
            f(dual)


@pytest.mark.parametrize("kernels", BACKENDS)
def test_double_backward_names_the_public_function(kernels):
    dev = KERNEL_DEVICE if kernels else "cpu"
    calls = _calls(dev)
    with _backend(kernels):
        for name in ("sparse_delta_memory", "product_key_topk", "wy_solve"):
            fn, x = calls[name]
            x = x.detach().clone().requires_grad_()
            with pytest.raises(RuntimeError, match=f"sdm_ops: {name} does not support double"):
                torch.autograd.grad(fn(x).sum(), x, create_graph=True)


# ---------------------------------------------------------------------------
# The in-place form: refusals before any write, and no copy of the bank on the CPU
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("T", [1, 20], ids=["decode", "prefill"])
def test_in_place_refuses_an_inference_bank_outside_inference_mode_before_writing(kernels, T):
    dev = KERNEL_DEVICE if kernels else "cpu"
    a = make_sdm_inputs(B=1, T=T, H=2, D=16, S=9, W=3, R=2, seed=5, device=dev)
    rest = {k: x for k, x in a.items() if k != "bank"}
    with torch.inference_mode():
        bank = a["bank"].clone()
    before = bank.clone()
    with _backend(kernels), pytest.raises(ValueError, match="bank is an inference tensor"):
        sdm_ops.sparse_delta_memory_(**rest, bank=bank, chunk_size=16)
    assert torch.equal(bank, before)
    # Inside inference mode the same call updates it.
    with _backend(kernels), torch.inference_mode():
        sdm_ops.sparse_delta_memory_(**rest, bank=bank, chunk_size=16)
    assert not torch.equal(bank, before)


@pytest.mark.parametrize("kernels", BACKENDS)
def test_in_place_refuses_a_bank_that_requires_grad_under_grad_mode_before_writing(kernels):
    dev = KERNEL_DEVICE if kernels else "cpu"
    a = make_sdm_inputs(B=1, T=20, H=2, D=16, S=9, W=3, R=2, seed=6, device=dev)
    rest = {k: x for k, x in a.items() if k != "bank"}
    bank = a["bank"].clone().requires_grad_()
    before = bank.detach().clone()
    with _backend(kernels), pytest.raises(ValueError, match="bank requires grad"):
        sdm_ops.sparse_delta_memory_(**rest, bank=bank, chunk_size=16)
    assert torch.equal(bank.detach(), before)
    with _backend(kernels), torch.no_grad():
        sdm_ops.sparse_delta_memory_(**rest, bank=bank, chunk_size=16)
    assert not torch.equal(bank.detach(), before)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_cpu_in_place_allocates_nothing_the_size_of_the_bank(packed):
    """The CPU path walks a float32 bank where it is: no allocation of a quarter of the bank's
    size or more (what a copy of it, or of a sequence's bank, would be)."""
    S, D = 2**14, 16
    if packed:
        a = make_sdm_inputs(B=1, T=50, H=2, D=D, S=S, W=3, R=2, seed=7)
        a["bank"] = torch.randn(2, 2, S, D)
        a["cu_seqlens"] = torch.tensor([0, 20, 50])
    else:
        a = make_sdm_inputs(B=2, T=50, H=2, D=D, S=S, W=3, R=2, seed=7)
    rest = {k: x for k, x in a.items() if k != "bank"}
    bank = a["bank"].clone()
    limit = bank.numel() * bank.element_size() // 4
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        sdm_ops.sparse_delta_memory_(**rest, bank=bank, chunk_size=16)
    sizes = [(e.name, e.cpu_memory_usage or 0) for e in prof.events()]
    assert any(n > 0 for _, n in sizes), "the profiler recorded no allocation"
    big = [(name, n) for name, n in sizes if n >= limit]
    assert not big, f"allocations of a quarter of the bank or more: {big}"
    assert not torch.equal(bank, a["bank"])  # it was updated (its values: test_oracle)


# ---------------------------------------------------------------------------
# torch.func.grad and vjp: the same gradients as torch.autograd
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("name", ["sparse_delta_memory", "product_key_topk", "wy_solve"])
def test_func_grad_and_vjp_equal_autograd_bitwise(kernels, name):
    fn, x = _calls(KERNEL_DEVICE if kernels else "cpu")[name]
    weight = torch.linspace(-1, 1, fn(x).numel(), device=x.device).view(fn(x).shape)
    loss = lambda x: (fn(x).float() * weight).sum()
    with _backend(kernels):
        leaf = x.detach().clone().requires_grad_()
        (want,) = torch.autograd.grad(loss(leaf), leaf)
        got = torch.func.grad(loss)(x.detach())
        out, vjp = torch.func.vjp(lambda x: fn(x).float(), x.detach())
        (got_vjp,) = vjp(weight.float())
    assert torch.equal(got, want), f"{name}: torch.func.grad differs from torch.autograd"
    assert torch.equal(got_vjp, want), f"{name}: torch.func.vjp differs from torch.autograd"


def test_func_grad_through_the_layer_equals_autograd_bitwise():
    layer = SparseDeltaMemory(32, 2, 16, (8, 8), 4, 4)
    x = torch.randn(2, 20, 32)
    params = {k: p.detach() for k, p in layer.named_parameters()}
    loss = lambda p: torch.func.functional_call(layer, p, (x,)).square().mean()
    got = torch.func.grad(loss)(params)
    layer.zero_grad()
    layer(x).square().mean().backward()
    for k, p in layer.named_parameters():
        assert torch.equal(got[k], p.grad), f"d{k}: torch.func.grad differs from autograd"


@pytest.mark.parametrize("name", ["sparse_delta_memory", "product_key_topk", "wy_solve"])
def test_jacrev_and_nested_grad_raise_naming_the_function(name):
    fn, x = _calls("cpu")[name]
    with pytest.raises(NotImplementedError, match=f"sdm_ops.{name} does not support .*vmap"):
        torch.func.jacrev(lambda x: fn(x).sum(0))(x)
    with pytest.raises(RuntimeError, match=f"sdm_ops: {name} does not support double"):
        torch.func.grad(lambda x: torch.func.grad(lambda y: fn(y).sum())(x).sum())(x)
    # An input that also requires grad outside the transform: its outer gradient would miss
    # the backward's own derivative.
    with pytest.raises(RuntimeError, match=f"sdm_ops: {name} does not support double"):
        torch.func.grad(lambda x: fn(x).sum())(x.detach().clone().requires_grad_())
