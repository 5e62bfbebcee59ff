"""The reference itself: chunked form == token-by-token recurrence == the dense delta rules."""

import pytest
import torch

from sdm_ops import reference as ref
from tests.helpers import assert_close, make_sdm_inputs, sdm_positional, to_float64


def _token(a):
    return ref.sdm_token_reference(*sdm_positional(a))


def _chunked(a, c):
    return ref.sdm_chunked_reference(*sdm_positional(a), chunk_size=c)


@pytest.mark.parametrize("chunk_size", [1, 3, 16, 64])
@pytest.mark.parametrize("decay", [True, False])
def test_chunked_equals_token_by_token_with_padding_duplicates_and_zero_decays(chunk_size, decay):
    a = to_float64(make_sdm_inputs(T=41, S=7, W=4, R=3, decay=decay, seed=chunk_size))
    out, bank = _chunked(a, chunk_size)
    out_t, bank_t = _token(a)
    assert_close(out, out_t, rtol=1e-12, name="out")
    assert_close(bank, bank_t, rtol=1e-12, name="bank")


def test_shared_bank_equals_bank_copied_per_stream():
    a = to_float64(make_sdm_inputs(shared=True, seed=3))
    out, bank = _chunked(a, 16)
    b = dict(a, bank=a["bank"].expand(2, *a["bank"].shape).clone())
    out2, bank2 = _chunked(b, 16)
    assert torch.equal(out, out2) and torch.equal(bank, bank2)


def test_empty_sequence_returns_the_bank_unchanged():
    a = to_float64(make_sdm_inputs(T=0))
    out, bank = _chunked(a, 16)
    assert out.shape == (2, 0, 2, 16)
    assert torch.equal(bank, a["bank"])


def _dense_kda(q, k, v, beta, g, S0):
    """Kimi Delta Attention, token by token, on dense [K, V] states (fla's naive form)."""
    B, T, H, K = k.shape
    state = S0.clone()
    outs = []
    for t in range(T):
        state = state * g[:, t].exp()[..., None]
        kt = k[:, t]
        err = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, state)
        state = state + beta[:, t][..., None, None] * kt[..., None] * err[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("gate", ["kda", "gated_deltanet", "deltanet"])
def test_full_addressing_is_the_dense_delta_rule(gate):
    """W = R = S with write_idx = read_idx = arange(S): KDA with g = log(decay), gated DeltaNet
    with one decay per token, DeltaNet without decay."""
    g = torch.Generator().manual_seed(7)
    B, T, H, S, D = 2, 23, 2, 8, 16
    k = torch.randn(B, T, H, S, generator=g, dtype=torch.float64)
    k = torch.nn.functional.normalize(k, dim=-1)
    q = torch.randn(B, T, H, S, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    if gate == "kda":
        decay = torch.rand(B, T, H, S, generator=g, dtype=torch.float64) * 0.5 + 0.5
    elif gate == "gated_deltanet":
        decay = torch.rand(B, T, H, 1, generator=g, dtype=torch.float64) * 0.5 + 0.5
        decay = decay.expand(B, T, H, S)
    else:
        decay = torch.ones(B, T, H, S, dtype=torch.float64)
    idx = torch.arange(S).expand(B, T, H, S)
    out_d, state_d = _dense_kda(q, k, v, beta, decay.log(), S0)
    out, bank = ref.sdm_chunked_reference(
        v, beta, idx, k, idx, q, S0, None if gate == "deltanet" else decay, chunk_size=8
    )
    assert_close(out, out_d, rtol=1e-12, name="out")
    assert_close(bank, state_d, rtol=1e-12, name="bank")


def test_chunked_reference_is_differentiable_in_every_float_input():
    a = to_float64(make_sdm_inputs(B=1, T=9, H=1, D=16, S=5, W=2, R=2, seed=11))
    names = ["v", "beta", "write_w", "read_w", "bank", "decay"]
    for n in names:
        a[n] = a[n].clone().requires_grad_()
    out, bank = _chunked(a, 4)
    grads = torch.autograd.grad(out.sum() + bank.square().sum(), [a[n] for n in names])
    assert all(gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0 for gr in grads)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "int4"])
def test_snapshot_quantization_error_is_within_its_documented_bound(mode):
    rows = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 3
    codes, scale = ref.quantize_rows(rows, mode)
    back = ref.dequantize_rows(codes, scale, mode)
    amax = rows.reshape(64, 2, 16).abs().amax(-1, keepdim=True).expand(64, 2, 16).reshape(64, 32)
    err = (back - rows).abs()
    if mode == "bf16":
        assert (err <= rows.abs() * 2.0**-8).all()
    elif mode == "fp8":  # half a step of 3 mantissa bits, or of the subnormal spacing
        assert (err <= torch.maximum(rows.abs() * 2.0**-4, amax / 448 * 2.0**-10)).all()
    else:  # half a step of amax / 7
        assert (err <= amax / 14 * (1 + 1e-6)).all()
