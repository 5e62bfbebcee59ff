"""``torch.compile`` of the ``SparseDeltaMemory`` layer: ``fullgraph=True`` forward and backward
equal to eager, continuing from a state included; dynamic sequence lengths compiling once;
``torch._dynamo.explain`` finding no graph break; the in-place ``step_`` compiled equal to
eager. CPU (the operators' reference path)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from compile_tests import fresh_dynamo  # noqa: F401  (an autouse fixture)
from sdm_ops.nn import SparseDeltaMemory
from tests.helpers import assert_close

RTOL = 1e-4  # compiled against eager: Inductor fuses the projections differently
B, D_MODEL, H, D = 2, 32, 2, 16


def make_layer(decay: bool = True, equal: bool = False) -> SparseDeltaMemory:
    """Factors (4, 8) and different read and write top-k, or with ``equal`` factors (8, 8)
    and one top-k (the layer's other way to address: one product for all factors and one
    top-k for reads and writes)."""
    torch.manual_seed(0)
    layer = SparseDeltaMemory(
        D_MODEL,
        heads=H,
        head_dim=D,
        factors=(8, 8) if equal else (4, 8),
        read_topk=3,
        write_topk=3 if equal else 2,
        use_decay=decay,
        chunk_size=16,
    )
    with torch.no_grad():
        layer.bank.normal_()
    return layer


def make_x(T: int, seed: int) -> torch.Tensor:
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed))


def layer_loss(layer, x, g, state=None):
    y, final = layer(x, state=state, return_state=True)
    return (y * g).sum() + final.square().sum() * 1e-2


@pytest.mark.parametrize("equal", [False, True])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_fullgraph_forward_and_backward_match_eager(decay, with_state, equal):
    layer = make_layer(decay, equal)
    compiled = torch.compile(layer_loss, fullgraph=True)
    T = 37
    x = make_x(T, seed=1)
    g = torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(2))
    state = layer.initial_state(B).normal_() if with_state else None
    results = []
    for fn in (compiled, layer_loss):
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        st = None if state is None else state.clone().requires_grad_()
        loss = fn(layer, xs, g, st)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        assert (layer.bank.grad is None) == with_state  # a given state replaces the bank
        grads["x"] = xs.grad
        if st is not None:
            grads["state"] = st.grad
        results.append((loss.detach(), grads))
    (got_loss, got), (want_loss, want) = results
    assert_close(got_loss, want_loss, rtol=RTOL, name="loss")
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name], rtol=RTOL, name=f"grad of {name}")


def test_dynamic_sequence_lengths_compile_once_and_match_eager():
    layer = make_layer()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True, dynamic=True)
    for T in (20, 33, 47):
        x = make_x(T, seed=T)
        with torch.no_grad():
            assert_close(compiled(x), layer(x), rtol=RTOL, name=f"y (T={T})")
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times over T = 20, 33, "
        f"47; dynamic shapes should compile once"
    )


def test_explain_finds_no_graph_break():
    layer = make_layer()
    explanation = torch._dynamo.explain(layer)(make_x(25, seed=3))
    assert explanation.graph_break_count == 0, (
        f"{explanation.graph_break_count} graph break(s): {explanation.break_reasons}"
    )
    assert explanation.graph_count == 1


@pytest.mark.parametrize("equal", [False, True])
def test_compiled_step_matches_eager(equal):
    layer = make_layer(equal=equal)
    compiled = torch.compile(layer.step_, fullgraph=True)
    x = make_x(6, seed=4)
    want_state, got_state = layer.initial_state(B), layer.initial_state(B)
    for t in range(x.shape[1]):
        want = layer.step_(x[:, t : t + 1], want_state)
        got = compiled(x[:, t : t + 1], got_state)
        assert_close(got, want, rtol=RTOL, name=f"y of step_ (t={t})")
    assert_close(got_state, want_state, rtol=RTOL, name="state after step_")
