"""Padding and non-finite values: no silent wrong answer, on the CPU operators and on the
kernels (natively on CUDA, under the interpreter on CPU tensors), forward and backward.

The contract (README, ``sdm_ops/_finite.py``):

- a token whose entries are all padding changes nothing, whatever its value, beta, weights
  and decays hold (NaN and inf included): the other tokens' outputs, the final state and
  every other gradient are bitwise those of the same call with that token's values finite;
- a non-finite value at token t (or in a bank row it reads or writes) reaches no output of an
  earlier token and nothing of another stream: before the first token whose exact output or
  update is not finite (the float64 oracle, which follows the definition with selects), every
  output equals the oracle's, and a stream without such a token equals it entirely;
- read weights never reach the bank.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sdm_ops
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_sdm_inputs,
    on_kernels,
    requires_kernels,
)
from tests.oracle import FLOATS, float64_args, sdm_oracle

RTOL = 1e-5
NAN, INF = float("nan"), float("inf")
BACKENDS = [
    pytest.param(False, id="cpu_operators"),
    pytest.param(True, id="kernels", marks=requires_kernels),
]


def _backend(kernels: bool):
    return on_kernels() if kernels else contextlib.nullcontext()


def _device(kernels: bool) -> str:
    return KERNEL_DEVICE if kernels else "cpu"


def _pad_tokens(a: dict, b: int, tokens, fill: float) -> dict:
    """``a`` with tokens ``tokens`` of batch row b all padding, every value of theirs ``fill``."""
    a = {k: x.clone() for k, x in a.items()}
    for k in ("write_idx", "read_idx"):
        a[k][b, tokens] = -1
    for k in ("v", "beta", "write_w", "read_w", "decay"):
        if a.get(k) is not None:
            a[k][b, tokens] = fill
    return a


def _call(a: dict, kernels: bool, C: int, final: bool = True, grad: bool = False, **kw):
    """(out, bank, grads by name or None) of one call; the loss weights each output element."""
    leaves = {}
    if grad:
        leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a.get(k) is not None}
    with _backend(kernels):
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(a, **leaves), chunk_size=C, output_final_state=final, **kw
        )
        grads = None
        if grad:
            g = torch.linspace(-1, 1, out.numel(), device=out.device).view(out.shape)
            loss = (out.float() * g).sum() + (0.0 if bank is None else bank.float().sum())
            grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    return out, bank, grads


def _bitwise(x: torch.Tensor, y: torch.Tensor, what: str) -> None:
    same = (x == y) | (x.isnan() & y.isnan())
    assert bool(same.all()), f"{what}: {int((~same).sum())} elements differ"


# ---------------------------------------------------------------------------
# Padding
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("fill", [NAN, INF, -INF, 1e30])
def test_trailing_padding_with_any_values_changes_nothing(kernels, C, fill):
    """B = 2, T = 40, the last 4 tokens of row 1 padding holding ``fill`` everywhere: the outputs,
    the final state and every gradient equal those of the same padding holding zeros,
    bitwise, and the padding tokens' own v and beta gradients are 0."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=2, T=40, H=2, D=16, S=9, W=3, R=2, seed=1, device=dev)
    want = _call(_pad_tokens(a, 1, slice(36, 40), 0.0), kernels, C, grad=True)
    got = _call(_pad_tokens(a, 1, slice(36, 40), fill), kernels, C, grad=True)
    assert bool(got[0][:, :36].isfinite().all()) and bool(got[1].isfinite().all())
    _bitwise(got[0], want[0], "out")
    _bitwise(got[1], want[1], "final state")
    for k in want[2]:
        _bitwise(got[2][k], want[2][k], f"d{k}")
    assert bool((got[2]["v"][1, 36:] == 0).all()) and bool((got[2]["beta"][1, 36:] == 0).all())


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("final", [False, True], ids=["out_only", "final_state"])
def test_padding_in_every_row_at_the_default_chunk_size_leaves_everything_finite(kernels, final):
    """NaN-valued trailing padding (as ``torch.empty`` leaves a right-padded batch) of
    different lengths in every row, default chunk size: every output and the final state are
    finite and equal the oracle's."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=3, T=50, H=2, D=16, S=9, W=3, R=2, seed=2, device=dev)
    for b, n in enumerate((3, 17, 49)):
        a = _pad_tokens(a, b, slice(50 - n, 50), NAN)
    out, bank, _ = _call(a, kernels, 64, final=final)
    run = sdm_oracle(float64_args(a))
    assert bool(out.isfinite().all())
    assert_close(out, run.out, rtol=RTOL, name="out")
    if final:
        assert_close(bank, run.bank, rtol=RTOL, name="final state")


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("what", ["write_w", "decay", "read_w"])
def test_padding_entries_with_any_weight_and_decay_are_inert(kernels, what):
    """Entries of index -1 among valid ones, their weight (or decay) NaN: the same results as
    with those values finite, bitwise, outputs, final state and gradients."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=1, T=37, H=2, D=16, S=9, W=3, R=2, seed=3, padding=0.3, device=dev)
    idx = a["read_idx" if what == "read_w" else "write_idx"]
    poisoned = dict(a, **{what: torch.where(idx < 0, NAN, a[what])})
    want = _call(dict(a, **{what: torch.where(idx < 0, 0.5, a[what])}), kernels, 16, grad=True)
    got = _call(poisoned, kernels, 16, grad=True)
    _bitwise(got[0], want[0], "out")
    _bitwise(got[1], want[1], "final state")
    for k in want[2]:
        g, w = got[2][k], want[2][k]
        if k == what:  # the padding entries' own gradient is 0
            assert bool((g[idx < 0] == 0).all())
            g, w = g[idx >= 0], w[idx >= 0]
        _bitwise(g, w, f"d{k}")


@pytest.mark.parametrize("kernels", BACKENDS)
def test_in_place_decode_and_prefill_ignore_padding_values(kernels):
    """The in-place form, one token a call and a prefill: a padding token holding NaN changes
    neither the bank nor any output but its own, which is 0."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=2, T=21, H=2, D=16, S=9, W=3, R=2, seed=4, device=dev)
    a = _pad_tokens(a, 0, [3, 20], NAN)
    clean = _pad_tokens(a, 0, [3, 20], 0.0)
    for args in (a, clean):
        args["bank_out"] = args["bank"].clone()
        rest = {k: x for k, x in args.items() if k not in ("bank", "bank_out")}
        with _backend(kernels):
            outs = [
                sdm_ops.sparse_delta_memory_(
                    **{k: x[:, t : t + 1] for k, x in rest.items()}, bank=args["bank_out"]
                )
                for t in range(10)
            ]
            outs.append(
                sdm_ops.sparse_delta_memory_(
                    **{k: x[:, 10:] for k, x in rest.items()}, bank=args["bank_out"], chunk_size=16
                )
            )
        args["outs"] = torch.cat(outs, 1)
    _bitwise(a["outs"], clean["outs"], "out")
    _bitwise(a["bank_out"], clean["bank_out"], "bank")
    assert bool(a["bank_out"].isfinite().all())


# ---------------------------------------------------------------------------
# Non-finite values: causality, streams, reads
# ---------------------------------------------------------------------------


def _check_causal(a: dict, out: torch.Tensor, bank: torch.Tensor | None) -> None:
    """Per stream, every output before the first token whose exact output or update is not
    finite equals the oracle's (and is finite); a stream with no such token equals it whole,
    final state included."""
    run = sdm_oracle(float64_args(a))
    bad = ~(run.out.isfinite().all(-1) & run.updates.isfinite().all(-1))  # [B, T, H]
    B, T, H, _ = out.shape
    for b in range(B):
        for h in range(H):
            hit = bad[b, :, h].nonzero()
            t_bad = int(hit[0]) if hit.numel() else T
            got = out[b, :t_bad, h]
            assert bool(got.isfinite().all()), f"stream ({b}, {h}): non-finite before {t_bad}"
            assert_close(got, run.out[b, :t_bad, h], rtol=RTOL, name=f"out ({b}, {h}) < {t_bad}")
            if t_bad == T and bank is not None:
                bank_bh = bank[b, h] if bank.dim() == 4 else bank[h]
                assert_close(bank_bh, run.bank[b, h], rtol=RTOL, name=f"bank ({b}, {h})")


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("C", [16, 32])
@pytest.mark.parametrize(
    "what", ["v", "beta", "write_w", "decay", "read_w", "bank_row", "v_inf", "write_w_inf"]
)
def test_a_non_finite_value_reaches_no_earlier_token_and_no_other_stream(kernels, C, what):
    """One non-finite value at token 21 of stream (0, 1) (mid-chunk at C = 16 and 32), or a
    NaN bank row that token 21 reads and writes: every earlier output of that stream and
    every other stream equal the oracle's."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=2, T=40, H=2, D=16, S=9, W=3, R=2, seed=5, padding=0.0, device=dev)
    t = 21
    value = INF if what.endswith("_inf") else NAN
    key = what.removesuffix("_inf")
    if key == "bank_row":
        s = int(a["write_idx"][0, t, 1, 0])
        a["read_idx"][0, t, 1, 0] = s
        a["bank"] = a["bank"].clone()
        a["bank"][0, 1, s, 3] = NAN
        # Only token 21 touches slot s before its own write.
        for k in ("write_idx", "read_idx"):
            a[k][0, :t, 1] = torch.where(a[k][0, :t, 1] == s, (s + 1) % 9, a[k][0, :t, 1])
    elif key in ("v",):
        a[key][0, t, 1, 5] = value
    elif key == "beta":
        a[key][0, t, 1] = value
    else:
        a[key][0, t, 1, 1] = value
    out, bank, _ = _call(a, kernels, C)
    _check_causal(a, out, bank)


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("what", ["beta", "write_w", "decay", "read_w"])
def test_an_infinite_bfloat16_value_reaches_no_earlier_token(kernels, what):
    """bfloat16 inputs, one inf at token 21 of stream (0, 1), mid-chunk at C = 16 (an infinite
    bfloat16 value must not pass for finite, or the chunk's pair terms carry it to the tokens
    before it): every earlier output of that stream is finite and within bfloat16 rounding of
    the same call with that value 0.5, and every other stream is bitwise that call's."""
    dev = _device(kernels)
    a = make_sdm_inputs(
        B=2, T=40, H=2, D=16, S=9, W=3, R=2, seed=6, padding=0.0, dtype=torch.bfloat16, device=dev
    )
    t = 21
    at = (0, t, 1) if what == "beta" else (0, t, 1, 1)
    finite = {k: x.clone() for k, x in a.items()}
    finite[what][at] = 0.5
    a[what][at] = INF
    out, bank, _ = _call(a, kernels, 16)
    want, want_bank, _ = _call(finite, kernels, 16)
    early = out[0, :t, 1]
    assert bool(early.isfinite().all()), f"{int((~early.isfinite()).sum())} earlier values"
    assert_close(early, want[0, :t, 1], rtol=2**-6, name="earlier outputs")
    for b, h in ((0, 0), (1, 0), (1, 1)):
        _bitwise(out[b, :, h], want[b, :, h], f"out ({b}, {h})")
        _bitwise(bank[b, h], want_bank[b, h], f"bank ({b}, {h})")


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("C", [16, 64])
def test_a_non_finite_read_weight_never_reaches_the_bank(kernels, C):
    """NaN read weights (and one whose read reads the row the token writes) leave the final
    state equal to the oracle's, finite: reads do not write."""
    dev = _device(kernels)
    a = make_sdm_inputs(B=2, T=40, H=2, D=16, S=9, W=3, R=2, seed=6, device=dev)
    a["read_w"][0, 5, 0, 0] = NAN
    a["read_idx"][1, 30, 1, 1] = a["write_idx"][1, 30, 1, 0]
    a["read_w"][1, 30, 1, 1] = INF
    out, bank, _ = _call(a, kernels, C)
    run = sdm_oracle(float64_args(a))
    assert bool(bank.isfinite().all())
    assert_close(bank, run.bank, rtol=RTOL, name="final state")
    _check_causal(a, out, None)


# ---------------------------------------------------------------------------
# Property: random non-finite positions, padding runs and chunk sizes
# ---------------------------------------------------------------------------


@st.composite
def nonfinite_cases(draw):
    B, T, H = draw(st.integers(1, 2)), draw(st.integers(1, 40)), draw(st.integers(1, 2))
    case = dict(
        shape=dict(B=B, T=T, H=H, D=16, S=draw(st.integers(2, 30)), W=3, R=2),
        seed=draw(st.integers(0, 2**16)),
        C=draw(st.sampled_from([16, 32, 64, 128])),
        final=draw(st.booleans()),
        pads=draw(
            st.lists(
                st.tuples(st.integers(0, B - 1), st.integers(0, T - 1), st.integers(1, 8)),
                max_size=3,
            )
        ),
        bads=draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["v", "beta", "write_w", "decay", "read_w", "bank"]),
                    st.integers(0, B - 1),
                    st.integers(0, T - 1),
                    st.integers(0, H - 1),
                    st.sampled_from([NAN, INF, -INF]),
                ),
                max_size=3,
            )
        ),
    )
    return case


def _apply(case: dict, device: str) -> dict:
    a = make_sdm_inputs(**case["shape"], seed=case["seed"], device="cpu")
    for b, t0, n in case["pads"]:
        a = _pad_tokens(a, b, slice(t0, t0 + n), NAN)
    S = case["shape"]["S"]
    for key, b, t, h, value in case["bads"]:
        if key == "bank":
            a["bank"][b, h, t % S, t % 16] = value
        elif key in ("v",):
            a[key][b, t, h, t % 16] = value
        elif key == "beta":
            a[key][b, t, h] = value
        else:
            a[key][b, t, h, t % a[key].shape[-1]] = value
    return {k: x.to(device) for k, x in a.items()}


@pytest.mark.parametrize("kernels", BACKENDS)
def test_property_padding_is_inert_and_non_finite_values_are_causal(kernels):
    """Hypothesis draws shapes, chunk sizes, NaN-valued padding runs and NaN or inf values in
    v, beta, weights, decays and bank rows: before each stream's first token whose exact
    output or update is not finite, every output equals the float64 oracle's, and streams
    without one equal it whole (the final state too)."""

    @settings(
        max_examples=25 if kernels else 60,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(nonfinite_cases())
    def check(case):
        a = _apply(case, _device(kernels))
        out, bank, _ = _call(a, kernels, case["C"], final=case["final"])
        _check_causal(a, out, bank)

    check()


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("W,R", [(3, 2), (8, 8), (1, 5)])
def test_finite_select_kernel_is_bitwise_the_reference(dtype, decay, W, R):
    """``sdm_internal::finite_select``'s kernel against ``_finite.select`` (its CPU path) on
    inputs with padding (negative and past-S indices), tokens with no valid write, NaN, inf
    and -inf in beta, weights and decays, and the largest finite values: every output
    bitwise, NaN where the reference has NaN."""
    from sdm_ops import _finite, ops

    g = torch.Generator().manual_seed(W * 10 + R)
    B, T, H, S = 2, 37, 3, 11

    def values(*shape):
        x = torch.randn(*shape, generator=g)
        pick = torch.rand(*shape, generator=g)
        x = torch.where(pick < 0.06, NAN, x)
        x = torch.where((pick >= 0.06) & (pick < 0.1), INF, x)
        x = torch.where((pick >= 0.1) & (pick < 0.13), -INF, x)
        x = torch.where((pick >= 0.13) & (pick < 0.15), torch.finfo(dtype).max, x)
        return x.to(dtype)

    def indices(*shape):
        idx = torch.randint(-3, S + 3, shape, generator=g)
        idx[0, :5] = -1  # tokens whose entries are all padding
        return idx

    args = (
        values(B, T, H),
        indices(B, T, H, W),
        values(B, T, H, W),
        indices(B, T, H, R),
        values(B, T, H, R),
        values(B, T, H, W) if decay else None,
        S,
    )
    want = _finite.select(*args)
    with on_kernels():
        moved = [x.to(KERNEL_DEVICE) if isinstance(x, torch.Tensor) else x for x in args]
        got = ops.finite_select(*moved)
    assert len(got) == len(want) == len(_finite.SELECTED)
    for name, x, y in zip(_finite.SELECTED, got, want):
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        _bitwise(x.cpu(), y, name)
    assert want[1].isnan().any() and want[5].any(), "the inputs exercise no non-finite value"
