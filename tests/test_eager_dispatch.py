"""Eager calls dispatch no custom operator (``ops.eager.call``): the public functions run their
operator's body, under autograd through an autograd.Function of the operator's own setup and
backward, and the bodies and backwards run the internal operators' bodies (``eager.in_backward``),
since each dispatch is host time that every eager call pays. Checked on the kernel path
(natively on CUDA, under the interpreter on the CPU) with every dispatch refused, the profiler
still showing one range named after the public operator, and the results and gradients
compared bitwise against the same calls made through the operators (what a dispatch mode, and a
traced graph, get) and against the float64 oracle."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sdm_ops
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_packed_sdm_inputs,
    make_raw,
    make_sdm_inputs,
    make_wy_inputs,
    on_kernels,
    requires_kernels,
)
from tests.oracle import FLOATS, oracle_with_grads

pytestmark = requires_kernels


class _Dispatched(TorchDispatchMode):
    """Passes every operator through and records the sdm ones. Under a dispatch mode the
    registered backwards dispatch their internal operators (as while traced)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace.startswith("sdm"):
            self.names.add(f"{func.namespace}::{func._opname}")
        return func(*args, **(kwargs or {}))


def _never_dispatched():
    """A context in which calling any custom operator fails the test."""
    from unittest import mock

    from torch._library.custom_ops import CustomOpDef

    def refuse(op, *args, **kwargs):
        raise AssertionError(f"{op._namespace}::{op._name} was dispatched")

    return mock.patch.object(CustomOpDef, "__call__", refuse)


def _sdm_events(fn):
    """(what ``fn`` returned, the sorted names of the sdm operators the profiler saw), with
    no custom operator dispatched."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with _never_dispatched():
            result = fn()
    return result, sorted({e.name for e in prof.events() if e.name.startswith("sdm")})


def _forward_backward(a, final, seed):
    """Forward and backward of ``sparse_delta_memory`` on fresh leaves of ``a``: (out, final
    bank or None, the gradients by name)."""
    leaves = {k: (x.clone().requires_grad_() if k in FLOATS else x) for k, x in a.items()}
    with on_kernels():
        out, bank = sdm_ops.sparse_delta_memory(**leaves, chunk_size=16, output_final_state=final)
        g = torch.Generator().manual_seed(seed)
        loss = (out * torch.randn(out.shape, generator=g).to(out.device)).sum()
        if final:
            loss = loss + (bank * torch.randn(bank.shape, generator=g).to(bank.device)).sum()
        loss.backward()
    grads = {k: leaves[k].grad for k in FLOATS if k in leaves}
    return out.detach(), None if bank is None else bank.detach(), grads


@pytest.mark.parametrize("final", [False, True], ids=["working_set", "final_state"])
@pytest.mark.parametrize("case", ["dense", "shared", "packed"])
def test_forward_and_backward_never_dispatch_and_match_the_operators(case, final):
    if case == "packed":
        a = make_packed_sdm_inputs([9, 0, 23, 5], seed=3, device=KERNEL_DEVICE)
    else:
        a = make_sdm_inputs(B=2, T=37, shared=case == "shared", seed=1, device=KERNEL_DEVICE)
    (out, bank, grads), called = _sdm_events(lambda: _forward_backward(a, final, seed=2))
    assert called == ["sdm::sparse_delta_memory"], called

    # Every internal operator dispatched: the same kernels, so bitwise the same results.
    with _Dispatched() as mode:
        out_d, bank_d, grads_d = _forward_backward(a, final, seed=2)
    assert "sdm_internal::recurrence_bwd" in mode.names, mode.names
    assert torch.equal(out, out_d)
    assert (bank is None) == (bank_d is None) and (bank is None or torch.equal(bank, bank_d))
    for k in grads:
        assert torch.equal(grads[k], grads_d[k]), k

    g = torch.Generator().manual_seed(2)
    g_out = torch.randn(out.shape, generator=g)
    g_bank = torch.randn(bank.shape, generator=g) if final else None
    run, want, _ = oracle_with_grads(a, g_out, g_bank)
    assert_close(out, run.out, rtol=1e-4, name="out")
    if final:
        assert_close(bank, run.bank, rtol=1e-4, name="bank")
    for k in grads:
        assert_close(grads[k], want[k], rtol=1e-3, name=f"d{k}")


@pytest.mark.parametrize("T", [1, 37], ids=["decode", "prefill"])
def test_in_place_never_dispatches(T):
    a = make_sdm_inputs(B=2, T=T, seed=4, device=KERNEL_DEVICE)
    bank = a.pop("bank")
    state = bank.clone()
    with on_kernels():
        out, called = _sdm_events(lambda: sdm_ops.sparse_delta_memory_(**a, bank=state))
    assert called == ["sdm::sparse_delta_memory_"], called
    want_out, want_bank = sdm_ops.sparse_delta_memory(
        **{k: x.cpu() for k, x in a.items()}, bank=bank.cpu(), output_final_state=True
    )
    assert_close(out, want_out, rtol=1e-4, name="out")
    assert_close(state, want_bank, rtol=1e-4, name="bank")


def test_product_key_topk_and_wy_solve_never_dispatch_with_autograd():
    raw = make_raw((3, 5), (8, 6), seed=5, device=KERNEL_DEVICE, requires_grad=True)
    A, beta, QK = make_wy_inputs(4, 16, seed=6, device=KERNEL_DEVICE, requires_grad=True)

    def run():
        with on_kernels():
            val, _ = sdm_ops.product_key_topk(raw, (8, 6), k=4)
            X, QX = sdm_ops.wy_solve(A, beta, QK)
            (val.sum() + X.sum() + (QX * QX).sum()).backward()
        return [t.grad.clone() for t in (raw, A, beta, QK)]

    grads, called = _sdm_events(run)
    assert called == ["sdm::product_key_topk", "sdm::wy_solve"], called
    for t in (raw, A, beta, QK):
        t.grad = None
    with _Dispatched() as mode:
        grads_d = run()
    assert {"sdm_internal::product_key_topk_backward", "sdm_internal::wy_solve_backward"} <= (
        mode.names
    ), mode.names
    for g, g_d in zip(grads, grads_d):
        assert torch.equal(g, g_d)


def test_create_graph_refuses_a_double_backward_naming_the_public_function():
    """A backward with create_graph=True raises the documented error, naming the public
    function (never an internal operator), before computing anything."""
    raw = make_raw((3, 5), (8, 6), seed=7, device=KERNEL_DEVICE, requires_grad=True)
    A, beta, QK = make_wy_inputs(2, 16, seed=8, device=KERNEL_DEVICE, requires_grad=True)
    with on_kernels():
        val, _ = sdm_ops.product_key_topk(raw, (8, 6), k=4)
        with pytest.raises(RuntimeError, match="product_key_topk does not support double"):
            torch.autograd.grad(val.sum(), raw, create_graph=True)
        X, _ = sdm_ops.wy_solve(A, beta, QK)
        with pytest.raises(RuntimeError, match="wy_solve does not support double backward"):
            torch.autograd.grad(X.sum(), A, create_graph=True)


def test_eager_calls_without_autograd_run_the_bodies_and_never_dispatch():
    a = make_sdm_inputs(B=2, T=37, seed=9, device=KERNEL_DEVICE)
    state = a["bank"].clone()
    raw = make_raw((3, 5), (8, 6), seed=9, device=KERNEL_DEVICE)
    A, beta, QK = make_wy_inputs(4, 16, seed=9, device=KERNEL_DEVICE)
    with on_kernels():
        with _never_dispatched():
            out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
            step = {k: x[:, :1] if x.dim() == 4 and k != "bank" else x for k, x in a.items()}
            step["beta"] = a["beta"][:, :1]
            step_out = sdm_ops.sparse_delta_memory_(**dict(step, bank=state))
            val, lin = sdm_ops.product_key_topk(raw, (8, 6), k=4)
            X, QX = sdm_ops.wy_solve(A, beta, QK)
        # The same calls through the operators (a dispatch mode makes every call dispatch).
        state_d = a["bank"].clone()
        with _Dispatched() as mode:
            out_d, bank_d = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
            step_out_d = sdm_ops.sparse_delta_memory_(**dict(step, bank=state_d))
            val_d, lin_d = sdm_ops.product_key_topk(raw, (8, 6), k=4)
            X_d, QX_d = sdm_ops.wy_solve(A, beta, QK)
    assert {
        "sdm::sparse_delta_memory",
        "sdm::sparse_delta_memory_",
        "sdm::product_key_topk",
        "sdm::wy_solve",
    } <= mode.names, mode.names
    for got, want in (
        (out, out_d),
        (bank, bank_d),
        (step_out, step_out_d),
        (state, state_d),
        (val, val_d),
        (lin, lin_d),
        (X, X_d),
        (QX, QX_d),
    ):
        assert torch.equal(got, want)
    assert not torch.equal(state, a["bank"])  # the step wrote the bank


def test_an_in_place_call_bumps_the_banks_version_for_autograd():
    """Run without the dispatcher, the in-place operator still tells autograd that the bank
    changed: a graph that saved the bank refuses its backward afterwards."""
    a = make_sdm_inputs(B=2, T=1, seed=10, device=KERNEL_DEVICE)
    bank = a.pop("bank")
    scale = torch.ones((), device=KERNEL_DEVICE, requires_grad=True)
    y = (bank * scale).sum()  # saves the bank for the backward
    version = bank._version
    with on_kernels():
        sdm_ops.sparse_delta_memory_(**a, bank=bank)
    assert bank._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_an_in_place_call_on_an_inference_bank():
    a = make_sdm_inputs(B=2, T=1, seed=11, device=KERNEL_DEVICE)
    want = a["bank"].clone()
    with torch.inference_mode(), on_kernels():
        bank = a.pop("bank").clone()  # an inference tensor: it has no version to bump
        out = sdm_ops.sparse_delta_memory_(**a, bank=bank)
    want = want.cpu()
    want_out = sdm_ops.sparse_delta_memory_(**{k: x.cpu() for k, x in a.items()}, bank=want)
    assert_close(out, want_out, rtol=1e-5, name="out")
    assert_close(bank, want, rtol=1e-5, name="bank")


def _layer_grads(layer, x, wrap):
    """The layer's output and the gradients of its parameters and of x for a fixed loss, with
    the forward run through ``wrap``."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with on_kernels():
        y = wrap(lambda: layer(x))
        g = torch.Generator().manual_seed(3)
        (y * torch.randn(y.shape, generator=g).to(y.device)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in layer.parameters()]


def _checkpointed(fn):
    return torch.utils.checkpoint.checkpoint(fn, use_reentrant=False)


def _saved_on_cpu(fn):
    with torch.autograd.graph.save_on_cpu():
        return fn()


def _anomaly(fn):
    with torch.autograd.detect_anomaly(check_nan=False):
        return fn()


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize(
    "wrap", [_checkpointed, _saved_on_cpu, _anomaly], ids=["checkpoint", "save_on_cpu", "anomaly"]
)
def test_the_layer_under_autograd_tools_gives_the_same_gradients(wrap):
    """Activation checkpointing (the forward recomputed in the backward), saved-tensor hooks and
    anomaly mode work with the operators' autograd run without the dispatcher."""
    from sdm_ops.nn import SparseDeltaMemory

    torch.manual_seed(0)
    layer = SparseDeltaMemory(32, 2, 16, (4, 4), 3, 2, chunk_size=16).to(KERNEL_DEVICE)
    with torch.no_grad():
        layer.bank.normal_()
    x = torch.randn(2, 21, 32, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    want = _layer_grads(layer, x, lambda fn: fn())
    got = _layer_grads(layer, x, wrap)
    assert len(got) == len(want) > 3
    for g, w in zip(got, want):
        assert g is not None and torch.equal(g, w)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace, deprecated
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_jit_trace_still_records_the_operator():
    """The tracer records operators it sees dispatched: a traced call must not bypass them."""
    raw = make_raw((3, 5), (8, 6), seed=12, device=KERNEL_DEVICE)
    fn = lambda r: sdm_ops.product_key_topk(r, (8, 6), 4).val
    with on_kernels():
        traced = torch.jit.trace(fn, (raw,))
        assert "sdm::product_key_topk" in str(traced.graph)
        assert torch.equal(traced(raw), fn(raw))


def test_this_pytorch_has_every_private_call_of_the_eager_path():
    from sdm_ops.ops import eager

    assert eager.PRIVATE is not None and eager.find_private() is not None


@pytest.mark.parametrize(
    "where,name",
    [
        (torch._C, "_is_tracing"),
        (torch._C, "_is_torch_function_mode_enabled"),
        (torch._C._functorch, "peek_interpreter_stack"),
        (torch.utils._python_dispatch, "_get_current_dispatch_mode"),
        (torch._library.triton, "set_wrap_triton_enabled"),
        (torch._C._autograd, "_profiler_enabled"),
    ],
)
def test_a_missing_private_call_turns_the_eager_path_off(monkeypatch, where, name):
    from sdm_ops.ops import eager

    monkeypatch.delattr(where, name)
    assert eager.find_private() is None


def _sdm_names(fn):
    """(what ``fn`` returned, the names of the sdm operators the profiler saw)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = fn()
    return result, {e.name for e in prof.events() if e.name.startswith("sdm")}


@pytest.mark.parametrize("final", [False, True], ids=["working_set", "final_state"])
@pytest.mark.parametrize("case", ["dense", "packed"])
def test_without_the_private_calls_every_call_dispatches_with_the_same_results(
    monkeypatch, case, final
):
    """Where this PyTorch lacks a private call of the eager path (``eager.PRIVATE`` None),
    every public function and registered backward goes through the operators: the same
    kernels, so bitwise the same outputs and gradients as the path around the dispatcher."""
    from sdm_ops.ops import eager

    if case == "packed":
        a = make_packed_sdm_inputs([9, 0, 23, 5], seed=13, device=KERNEL_DEVICE)
    else:
        a = make_sdm_inputs(B=2, T=37, seed=13, device=KERNEL_DEVICE)
    raw = make_raw((3, 5), (8, 6), seed=14, device=KERNEL_DEVICE, requires_grad=True)
    A, beta, QK = make_wy_inputs(4, 16, seed=15, device=KERNEL_DEVICE, requires_grad=True)
    step = {k: x[:, :1] for k, x in a.items() if k not in ("bank", "cu_seqlens")}

    def run():
        out, bank, grads = _forward_backward(a, final, seed=16)
        with on_kernels():
            state = a["bank"].clone() if case == "dense" else None
            step_out = None if state is None else sdm_ops.sparse_delta_memory_(**step, bank=state)
            val, lin = sdm_ops.product_key_topk(raw, (8, 6), k=4)
            X, QX = sdm_ops.wy_solve(A, beta, QK)
            (val.sum() + X.sum() + (QX * QX).sum()).backward()
        others = [step_out, state, val, lin, X, QX] + [t.grad.clone() for t in (raw, A, beta, QK)]
        for t in (raw, A, beta, QK):
            t.grad = None
        return [out, bank, *grads.values(), *others]

    fast, names = _sdm_names(run)
    assert not any(n.startswith("sdm_internal::") for n in names), names
    monkeypatch.setattr(eager, "PRIVATE", None)
    slow, names = _sdm_names(run)
    assert {
        "sdm::sparse_delta_memory",
        "sdm::wy_solve",
        "sdm_internal::recurrence_bwd",
        "sdm_internal::wy_solve_backward",
        "sdm_internal::product_key_topk_backward",
    } <= names, names
    assert len(fast) == len(slow)
    for i, (got, want) in enumerate(zip(slow, fast)):
        assert (got is None) == (want is None), i
        assert got is None or torch.equal(got, want), i
