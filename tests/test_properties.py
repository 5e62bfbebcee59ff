"""Property-based tests (hypothesis): the public functions against the plainest reference (the
float64 token-by-token oracle, ``tests/oracle.py``) on random shapes and options, forward and
every gradient, in every snapshot mode (CPU operators)."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdm_ops
from tests.helpers import assert_close, make_sdm_inputs
from tests.oracle import FLOATS, snapshot_gradient_bounds

SETTINGS = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def sdm_cases(draw):
    return (
        dict(
            B=draw(st.integers(1, 2)),
            T=draw(st.integers(0, 45)),
            H=draw(st.integers(1, 2)),
            D=draw(st.sampled_from([16, 32])),
            S=draw(st.integers(1, 24)),
            W=draw(st.integers(0, 5)),
            R=draw(st.integers(0, 5)),
            decay=draw(st.booleans()),
            shared=draw(st.booleans()),
            index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
            padding=draw(st.sampled_from([0.0, 0.3, 1.0])),
            seed=draw(st.integers(0, 2**16)),
        ),
        draw(st.sampled_from([16, 32, 64, 128])),
        draw(st.sampled_from(["none", "bf16", "fp8", "int4"])),
    )


@SETTINGS
@given(sdm_cases())
def test_sparse_delta_memory_matches_the_token_by_token_recurrence(case):
    """out, the final state and every gradient (the forward under autograd keeps the drawn
    snapshot): those of v, beta and the bank to the float32 contract in every mode, those of
    write_w, read_w and decay within what the mode's snapshot rows allow, element by element
    (``tests.oracle.snapshot_gradient_bounds``; 0 for "none")."""
    kwargs, chunk_size, snapshot = case
    a = make_sdm_inputs(**kwargs)
    leaves = {k: a[k].clone().requires_grad_() for k in FLOATS if k in a}
    out, bank = sdm_ops.sparse_delta_memory(
        **dict(a, **leaves), chunk_size=chunk_size, snapshot=snapshot, output_final_state=True
    )
    g = torch.Generator().manual_seed(kwargs["seed"])
    g_out, g_bank = torch.randn(out.shape, generator=g), torch.randn(bank.shape, generator=g)
    loss = (out * g_out).sum() + (bank * g_bank).sum()
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    run, want, _, bounds = snapshot_gradient_bounds(a, g_out, g_bank, chunk_size, snapshot, 2**-8)
    assert out.shape == a["v"].shape and bank.shape == run.bank.shape
    assert_close(out, run.out, rtol=1e-5, name=f"out {kwargs} C={chunk_size}")
    assert_close(bank, run.bank, rtol=1e-5, name=f"bank {kwargs} C={chunk_size}")
    for k, got in grads.items():
        got = torch.zeros_like(a[k]) if got is None else got
        if k not in bounds:
            assert_close(got, want[k], rtol=1e-5, name=f"d{k} {kwargs} C={chunk_size}")
            continue
        slack = 1e-5 * max(want[k].abs().max().item(), 1.0) if want[k].numel() else 0.0
        err = (got.double() - want[k]).abs() - bounds[k] - slack
        assert not err.numel() or err.max() <= 0, (
            f"d{k} {kwargs} C={chunk_size} {snapshot}: beyond the snapshot's bound by "
            f"{err.max().item():.3e}"
        )


@SETTINGS
@given(sdm_cases())
def test_in_place_update_equals_the_functional_result(case):
    kwargs, chunk_size, _ = case
    kwargs["shared"] = False
    a = make_sdm_inputs(**kwargs)
    out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=chunk_size, output_final_state=True)
    state = a["bank"].clone()
    out2 = sdm_ops.sparse_delta_memory_(
        bank=state, **{k: v for k, v in a.items() if k != "bank"}, chunk_size=chunk_size
    )
    assert_close(out2, out, rtol=1e-5, name="out")
    assert_close(state, bank, rtol=1e-5, name="bank")


@SETTINGS
@given(
    st.lists(st.integers(1, 7), min_size=1, max_size=3),
    st.integers(1, 40),
    st.integers(0, 3),
    st.integers(0, 2**16),
)
def test_product_key_topk_is_an_exact_top_k(factors, k, rows, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-3, 4, (rows, sum(factors)), generator=g).float()  # many ties
    val, lin = sdm_ops.product_key_topk(raw, factors, k)
    kk = min(k, torch.tensor(factors).prod().item())
    assert lin.shape == (rows, kk)
    assert (lin[:, 1:] > lin[:, :-1]).all(), "lin must be strictly ascending"
    # The scores are the slots' sums, and no slot left out scores more than one selected.
    cols = torch.split(raw, factors, dim=-1)
    dense = cols[0]
    for c in cols[1:]:
        dense = (dense[:, :, None] + c[:, None, :]).reshape(rows, dense.shape[1] * c.shape[1])
    assert torch.equal(val, torch.gather(dense, 1, lin))
    if rows and kk < dense.shape[1]:
        rest = dense.scatter(1, lin, float("-inf"))
        assert (rest.amax(1) <= val.amin(1)).all()
