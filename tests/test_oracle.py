"""The recurrence against the tests' own float64 oracle (``tests/oracle.py``: the definition run
token by token, every gradient by float64 autograd), which shares no code and no algorithm
with the package: the Triton kernels (natively on CUDA, under the interpreter on CPU tensors)
and the CPU operators, at every chunk size with several chunks, with per-stream and shared
banks, packed batches, padding, duplicate slots and decays of exactly 0, with and without
``output_final_state``, forward with and without autograd and every gradient; bfloat16 values
and banks within bounds derived from bfloat16 rounding; each snapshot mode within its
documented per-group error bound, and the gradient error that bound allows, element by
element; the layer against a float64 composition of its projections, the exact top-k and the
oracle."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sdm_ops
from sdm_ops import reference as ref
from sdm_ops.kernels import recurrence_fwd
from sdm_ops.ops import KEPT_FOR_BACKWARD
from tests.helpers import (
    HAS_CUDA,
    KERNEL_DEVICE,
    SMALL_LAYER,
    assert_close,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_kernels,
    sdm_positional,
)
from tests.oracle import (
    FLOATS,
    chunk_entry_terms,
    dequantize_snapshot,
    float64_args,
    oracle_with_grads,
    sdm_oracle,
    snapshot_error_bound,
    snapshot_gradient_bounds,
)

RTOL = 1e-5  # the float32 contract: relative to max(|expected|, 1)
BACKENDS = [
    pytest.param(False, id="cpu_operators"),
    pytest.param(True, id="kernels", marks=requires_kernels),
]
F64 = torch.float64


def _backend(kernels: bool):
    return on_kernels() if kernels else contextlib.nullcontext()


def _cotangents(out_shape, bank_shape, seed: int, dtype=torch.float32):
    """Random output and bank gradients, exactly representable in ``dtype`` (so that a
    bfloat16 output's gradient is the one the oracle gets)."""
    g = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out_shape, generator=g).to(dtype).float()
    g_bank = None if bank_shape is None else torch.randn(bank_shape, generator=g).to(dtype).float()
    return g_out, g_bank


def _run(a: dict, *, kernels: bool, chunk_size: int, final: bool, seed=1, dtype=None, **kw):
    """(out, final bank or None, gradients by name, g_out, g_bank) of
    sum(out * g_out) [+ sum(bank * g_bank) with ``final``], every floating input a leaf."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a.get(k) is not None}
    with _backend(kernels):
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(a, **leaves), chunk_size=chunk_size, output_final_state=final, **kw
        )
        assert (bank is not None) == final
        g_out, g_bank = _cotangents(
            out.shape, bank.shape if final else None, seed, dtype or a["v"].dtype
        )
        loss = (out.float() * g_out.to(out.device)).sum()
        if final:
            loss = loss + (bank.float() * g_bank.to(bank.device)).sum()
        grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, bank, dict(zip(leaves, grads)), g_out, g_bank


def test_oracle_follows_the_definition_on_a_token_worked_by_hand():
    """One token on a bank of three slots: two write entries on slot 0 (weights add, decays
    multiply), a decay of exactly 0 on slot 2, a padding entry (ignored, whatever its weight
    and decay), and a read of slots 0 and 1 after the write. Every number is a short binary
    fraction, so the oracle must give it exactly."""
    a = dict(
        v=torch.tensor([1.0, -1.0]).view(1, 1, 1, 2),
        beta=torch.tensor([0.5]).view(1, 1, 1),
        write_idx=torch.tensor([0, 0, 2, -1]).view(1, 1, 1, 4),
        write_w=torch.tensor([0.5, 0.25, 1.0, 9.0]).view(1, 1, 1, 4),
        read_idx=torch.tensor([0, 1]).view(1, 1, 1, 2),
        read_w=torch.tensor([1.0, 2.0]).view(1, 1, 1, 2),
        bank=torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]).view(1, 3, 2),
        decay=torch.tensor([0.5, 0.5, 0.0, 0.125]).view(1, 1, 1, 4),
    )
    # k = (0.75, 0, 1), d = (0.25, 1, 0): M' rows (0.25, 0.5), (3, 4), (0, 0); k^T M' =
    # (0.1875, 0.375); beta (v - k^T M') = (0.40625, -0.6875) is added k[s] times to row s.
    run = sdm_oracle(float64_args(a))
    bank = torch.tensor([[0.5546875, -0.015625], [3.0, 4.0], [0.40625, -0.6875]], dtype=F64)
    assert torch.equal(run.bank, bank.view(1, 1, 3, 2))
    assert torch.equal(run.out, torch.tensor([6.5546875, 7.984375], dtype=F64).view(1, 1, 1, 2))


@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
def test_oracle_agrees_with_the_packages_token_reference(shared):
    """Two implementations of the definition written apart agree (to float64 rounding)."""
    a = float64_args(make_sdm_inputs(T=21, S=5, W=4, R=3, shared=shared, seed=40))
    run = sdm_oracle(a)
    out, bank = ref.sdm_token_reference(*sdm_positional(a))
    assert_close(run.out, out, rtol=1e-13, name="out")
    assert_close(run.bank, bank, rtol=1e-13, name="bank")


# Every chunk size with at least two chunks (the last one partial), per-stream and shared
# banks, a packed batch at two chunk sizes; slots few enough that tokens share them inside a
# chunk (and entries of one token do), 15% padding and 15% decays of exactly 0 and of 1 (see
# make_sdm_inputs). The interpreter's cost grows with C^3 (the WY solve) and with the entries a
# chunk puts on one slot, so the large chunks run one or two streams over a few more slots.
CASES = {
    "C16": dict(chunk_size=16, B=2, T=40, H=2, S=7, W=3, R=2),
    "C32_shared_no_decay": dict(
        chunk_size=32, B=2, T=70, H=1, S=9, W=3, R=2, shared=True, decay=False
    ),
    "C64": dict(chunk_size=64, B=1, T=100, H=2, S=24, W=2, R=2),
    "C128_shared": dict(chunk_size=128, B=1, T=140, H=1, S=40, W=2, R=2, shared=True),
    "C16_packed": dict(chunk_size=16, lengths=[0, 5, 16, 37, 1, 0, 20], S=9),
    "C64_packed_shared": dict(chunk_size=64, lengths=[70, 0, 9], shared=True, S=24, W=2),
    # S large against T x W: most slots are touched once, and reads find slots their stream
    # never writes (rows read straight from the initial bank, in every chunk).
    "C16_wide": dict(chunk_size=16, B=2, T=40, H=2, S=300, W=3, R=3),
    "C32_packed_wide": dict(chunk_size=32, lengths=[50, 3, 29], S=400, W=2, R=3),
}
# The cases whose streams must read slots they never write.
WIDE = ("C16_wide", "C32_packed_wide")


def _reads_never_written(a: dict) -> int:
    """How many (stream, slot) pairs are read but never written (a packed batch's streams are
    its sequences' heads)."""
    B, T, H, _ = a["write_idx"].shape
    cu = a.get("cu_seqlens")
    spans = [(0, T)] if cu is None else list(zip(cu.tolist()[:-1], cu.tolist()[1:]))
    count = 0
    for b in range(B):
        for t0, t1 in spans:
            for h in range(H):
                written = set(a["write_idx"][b, t0:t1, h].flatten().tolist())
                read = set(a["read_idx"][b, t0:t1, h].flatten().tolist())
                count += len(read - written - {-1})
    return count


@pytest.mark.parametrize("final", [False, True], ids=["out_only", "final_state"])
@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_recurrence_matches_the_oracle_forward_and_every_gradient(case, kernels, final):
    """out (and the final state with ``output_final_state``) from the forward under autograd
    and from the inference forward, and the gradient of every input, the initial bank's
    (shared or per stream) included, equal the oracle's to the float32 contract."""
    kw = dict(CASES[case])
    C = kw.pop("chunk_size")
    device = KERNEL_DEVICE if kernels else "cpu"
    if "lengths" in kw:
        a = make_packed_sdm_inputs(kw.pop("lengths"), D=16, seed=50 + C, device=device, **kw)
    else:
        a = make_sdm_inputs(D=16, seed=50 + C, device=device, **kw)
    if case in WIDE:
        assert _reads_never_written(a) > 10
    out, bank, grads, g_out, g_bank = _run(a, kernels=kernels, chunk_size=C, final=final)
    run, want, _ = oracle_with_grads(a, g_out, g_bank)
    assert_close(out, run.out, rtol=RTOL, name="out")
    if final:
        assert bank.shape == run.bank.shape
        assert_close(bank, run.bank, rtol=RTOL, name="final state")
    assert set(grads) == set(want)
    for k in grads:
        assert grads[k].shape == a[k].shape
        assert_close(grads[k], want[k], rtol=RTOL, name=f"d{k}")
    with _backend(kernels), torch.no_grad():  # the inference forward: nothing kept
        out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=C, output_final_state=final)
    assert_close(out, run.out, rtol=RTOL, name="inference out")
    if final:
        assert_close(bank, run.bank, rtol=RTOL, name="inference final state")


def _in_place(a: dict, bank, t0: int, t1: int, chunk_size: int):
    """``sparse_delta_memory_`` over tokens t0:t1 of ``a`` into ``bank``; returns out."""
    keys = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay")
    part = {k: a[k][:, t0:t1] for k in keys if a.get(k) is not None}
    return sdm_ops.sparse_delta_memory_(**part, bank=bank, chunk_size=chunk_size)


@pytest.mark.parametrize("kernels", BACKENDS)
@pytest.mark.parametrize(
    "schedule", ["decode", "prefill_then_decode", "wide_prefill_then_decode", "packed_prefill"]
)
def test_in_place_calls_match_the_oracle_token_by_token(kernels, schedule):
    """The in-place form, as a server drives it: one token a call (the decode step), a
    prefill of several chunks (the last one partial) followed by decode steps, the same on a
    bank much larger than the tokens touch, and a packed prefill. Every call's out and the
    bank after the last equal the oracle's, to the float32 contract."""
    device = KERNEL_DEVICE if kernels else "cpu"
    if schedule == "packed_prefill":
        a = make_packed_sdm_inputs([23, 0, 40, 5], D=16, S=9, seed=81, device=device)
        bank = a["bank"].clone()
        with _backend(kernels):
            out = sdm_ops.sparse_delta_memory_(
                **{k: x for k, x in a.items() if k != "bank"}, bank=bank, chunk_size=16
            )
        run = sdm_oracle(float64_args(a))
        assert_close(out, run.out, rtol=RTOL, name="out")
        assert_close(bank, run.bank, rtol=RTOL, name="bank")
        return
    S = 300 if schedule == "wide_prefill_then_decode" else 7
    a = make_sdm_inputs(B=2, T=45, H=2, D=16, S=S, W=3, R=2, seed=80, device=device)
    prefill = 0 if schedule == "decode" else 37
    bank = a["bank"].clone()
    outs = []
    with _backend(kernels):
        if prefill:
            outs.append(_in_place(a, bank, 0, prefill, 16))
        for t in range(prefill, a["v"].shape[1]):
            outs.append(_in_place(a, bank, t, t + 1, 16))
    run = sdm_oracle(float64_args(a))
    assert_close(torch.cat(outs, 1), run.out, rtol=RTOL, name="out")
    assert_close(bank, run.bank, rtol=RTOL, name="bank")


# ---------------------------------------------------------------------------
# bfloat16
# ---------------------------------------------------------------------------

# One rounding to bfloat16 (8 significant bits) is off by at most 2^-8 of the value when it
# rounds to nearest, as CUDA and torch's conversions do; Triton's interpreter truncates
# instead: 2^-7 for what a kernel stores in bfloat16 on the CPU.
BF16_NEAREST = 2.0**-8
BF16_UNIT = BF16_NEAREST if HAS_CUDA else 2.0**-7


def _bf16_unit(kernels: bool) -> float:
    return BF16_UNIT if kernels else BF16_NEAREST


def _within_rounding(got, want, unit, name):
    """|got - want| <= unit |want| (0 for float32 results) + the float32 contract, element by
    element."""
    if got.dtype == torch.float32:
        unit = 0.0
    got = got.detach().cpu().to(F64)
    slack = RTOL * max(want.abs().max().item(), 1.0) if want.numel() else 0.0
    excess = (got - want).abs() - (unit * want.abs() + slack)
    if excess.numel() and excess.max() > 0:
        i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{name}: {got[i].item():.6g} against {want[i].item():.6g} at {i} is off by more "
            f"than {unit:g} of the value + {slack:.2e}"
        )


@pytest.mark.parametrize("final", [False, True], ids=["out_only", "final_state"])
@pytest.mark.parametrize("kernels", BACKENDS)
def test_bfloat16_values_with_a_float32_bank_are_rounded_once(kernels, final):
    """bfloat16 values, strengths, weights and decays with a float32 bank: the arithmetic is
    float32 throughout and the bank stays float32, so out and every bfloat16 gradient are the
    oracle's (run on the same bfloat16 numbers, exact in float64) rounded once to bfloat16,
    element by element; the float32 state and bank gradient within the float32 contract. The
    output gradient is a bfloat16 number: the backward starts from exactly the oracle's."""
    device = KERNEL_DEVICE if kernels else "cpu"
    a = make_sdm_inputs(
        T=40, S=7, dtype=torch.bfloat16, bank_dtype=torch.float32, seed=61, device=device
    )
    out, bank, grads, g_out, g_bank = _run(a, kernels=kernels, chunk_size=16, final=final)
    assert out.dtype == torch.bfloat16 and grads["v"].dtype == torch.bfloat16
    run, want, _ = oracle_with_grads(a, g_out, g_bank)
    _within_rounding(out, run.out, _bf16_unit(kernels), "out")
    if final:
        assert bank.dtype == torch.float32
        _within_rounding(bank, run.bank, 0.0, "final state")
    for k in grads:
        _within_rounding(grads[k], want[k], _bf16_unit(kernels), f"d{k}")


def _trajectory(a, C, final_bank):
    """The states a kernel run with a bfloat16 bank passes through at its chunk boundaries,
    float64 [B, H, S, D] by token: the state before token nC, read as the final state of the
    run over the first nC tokens (the same chunks: the same arithmetic and roundings), and the
    final state ``final_bank`` at T when there is one."""
    T = a["v"].shape[1]
    B, H, S, D = a["v"].shape[0], a["v"].shape[2], a["bank"].shape[-2], a["v"].shape[-1]
    states = {0: a["bank"].detach().cpu().to(F64).expand(B, H, S, D)}
    with on_kernels():
        for c0 in range(C, T, C):
            head = {k: (x if k == "bank" else x[:, :c0]) for k, x in a.items()}
            head["v"] = head["v"].detach().requires_grad_()  # the forward the run took
            got = sdm_ops.sparse_delta_memory(**head, chunk_size=C, output_final_state=True)
            states[c0] = got.bank.detach().cpu().to(F64)
    if final_bank is not None:
        states[T] = final_bank.detach().cpu().to(F64)
    return states


def _rounding_bound(a64, terms, start, end, M0, updates, unit):
    """The largest rounding error the bfloat16 stores of the chunk of tokens [start, end) can
    leave in each bank element. A row with m write entries in the chunk is stored m times: the
    first store row_decay M0 + its entry's term, each later one adding one more term
    (scatter_w times the writing token's update); each store is off by at most ``unit`` of what
    it stores, which is at most P = row_decay |M0| + sum |scatter_w| |update|, so the row ends
    off by at most m ``unit`` P (to first order: errors of the errors are ``unit`` smaller).
    ``updates`` [B, T, H, D]: each token's update (the oracle's, run from M0)."""
    wi = a64["write_idx"][:, start:end]  # [B, c, H, W]
    hit = (wi[..., None] == torch.arange(M0.shape[-2])).to(F64)  # [B, c, H, W, S]
    count = hit.sum((1, 3))  # [B, H, S]
    sw = terms["scatter_w"][:, start:end].abs()
    P = torch.einsum("bchws,bchw,bchd->bhsd", hit, sw, updates[:, start:end].abs())
    # Every entry on a slot carries the slot's row decay: their mean is it.
    rd = torch.einsum("bchws,bchw->bhs", hit, terms["row_decay"][:, start:end])
    rd = torch.where(count > 0, rd / count.clamp(min=1), 1.0)
    return unit * count[..., None] * (P + rd[..., None] * M0.abs())


BF16_BANK_CASES = [
    pytest.param(torch.bfloat16, True, False, id="bf16_values-final_state"),
    pytest.param(torch.bfloat16, False, True, id="bf16_values-out_only-shared"),
    pytest.param(torch.float32, True, True, id="f32_values-final_state-shared"),
    pytest.param(torch.float32, False, False, id="f32_values-out_only"),
]


@requires_kernels
@pytest.mark.parametrize("v_dtype,final,shared", BF16_BANK_CASES)
def test_kernels_bfloat16_bank_rounds_within_its_stores_and_gradients_follow_its_run(
    v_dtype, final, shared
):
    """The kernels round a bfloat16 bank each time they store a row. The test reads the states
    the run passes through at its chunk boundaries (``_trajectory``) and checks

    - each chunk's rounding (its end state minus the oracle's run of the chunk from its start
      state) against the largest error its stores can make (``_rounding_bound``), element by
      element;
    - out, the final state and every gradient against the oracle run through those same
      states (each chunk's rounding added at its end): the backward reads the rows the forward
      stored and treats the roundings as constants, so what remains is one rounding of each
      result to its dtype, element by element, and float32 arithmetic.

    So the run is the oracle plus roundings each within what bfloat16 allows, and its
    gradients are exact for that run."""
    C = 16
    a = make_sdm_inputs(
        T=40,
        S=7,
        dtype=v_dtype,
        bank_dtype=torch.bfloat16,
        shared=shared,
        seed=62,
        device=KERNEL_DEVICE,
    )
    out, bank, grads, g_out, g_bank = _run(
        a, kernels=True, chunk_size=C, final=final, dtype=torch.bfloat16
    )
    states = _trajectory(a, C, bank)
    a64 = float64_args(a)
    terms = chunk_entry_terms(a64, C)
    shift = {}
    for start, end in zip(sorted(states)[:-1], sorted(states)[1:]):
        seg = {k: (states[start] if k == "bank" else x[:, start:end]) for k, x in a64.items()}
        run = sdm_oracle(seg)
        updates = torch.zeros(a64["v"].shape, dtype=F64)
        updates[:, start:end] = run.updates
        rounding = states[end] - run.bank
        bound = _rounding_bound(a64, terms, start, end, states[start], updates, BF16_UNIT)
        excess = rounding.abs() - bound - RTOL * max(states[end].abs().max().item(), 1.0)
        assert excess.max() <= 0, (
            f"tokens {start}:{end}: the bank's rounding exceeds what its stores allow by "
            f"{excess.max().item():.3e}"
        )
        shift[end] = rounding
    run, want, _ = oracle_with_grads(a, g_out, g_bank, add=shift)
    _within_rounding(out, run.out, BF16_UNIT, "out")
    if final:
        _within_rounding(bank, run.bank, 0.0, "final state")  # its rounding is in shift
    for k in grads:
        _within_rounding(grads[k], want[k], BF16_UNIT, f"d{k}")


@pytest.mark.parametrize("v_dtype,final,shared", BF16_BANK_CASES)
def test_cpu_operators_bfloat16_bank_rounds_the_final_state_once(v_dtype, final, shared):
    """The CPU operators keep a bfloat16 bank's state in float32 from chunk to chunk and round
    the final state once (the kernels round at every store: see the test above), and their
    snapshot keeps the chunk-start rows in the bank's dtype. So out, the final state and the
    gradients of v, beta and the bank are the oracle's rounded once to their dtypes, and
    those of write_w, read_w and decay are off by at most what bfloat16 snapshot rows allow
    (``tests.oracle.snapshot_gradient_bounds``), element by element."""
    C = 16
    a = make_sdm_inputs(T=40, S=7, dtype=v_dtype, bank_dtype=torch.bfloat16, shared=shared, seed=63)
    out, bank, grads, g_out, g_bank = _run(
        a, kernels=False, chunk_size=C, final=final, dtype=torch.bfloat16
    )
    run, want, _, bounds = snapshot_gradient_bounds(a, g_out, g_bank, C, "bf16", BF16_NEAREST)
    _within_rounding(out, run.out, BF16_NEAREST, "out")
    if final:
        _within_rounding(bank, run.bank, BF16_NEAREST, "final state")
    for k in grads:
        got, ref_k = grads[k].detach().to(F64), want[k]
        unit = 0.0 if grads[k].dtype == torch.float32 else BF16_NEAREST
        allowed = unit * ref_k.abs() + RTOL * max(ref_k.abs().max().item(), 1.0)
        if k in bounds:
            allowed = allowed + bounds[k]
        excess = ((got - ref_k).abs() - allowed).max().item()
        assert excess <= 0, f"d{k} is off by {excess:.3e} more than its rounding allows"


# ---------------------------------------------------------------------------
# Snapshots
# ---------------------------------------------------------------------------

# The worst ratio of a gradient's error to the error its snapshot's bound allows
# (snapshot_gradient_bounds), measured over these cases (the bound is reached only when every
# row error takes its largest value with the sign that adds up): at most 0.44 in every mode.
# The tests ask for KAPPA of the bound, a margin of 1.5 over that.
KAPPA = {"none": 1.0, "bf16": 0.65, "fp8": 0.65, "int4": 0.65}
# Columns 0-15 of the values and the bank at magnitude 1, columns 16-31 at 2^-16, and the
# output and bank gradients the other way round: the two column groups of a row differ 2^16
# times in size, and both matter as much to the weights' gradients. A scale shared by more
# than one group (a row's, say) would put the large group's step on the small one: int4 would
# round the small group to 0, fp8 into its subnormals (below 2^-6 of the scale, about 2^-15 of
# the largest value).
COLUMN_SCALE = torch.cat([torch.ones(16), torch.full((16,), 2.0**-16)])


@pytest.mark.parametrize(
    "mode,chunk_size,tiles",
    [
        ("none", 16, "one_tile"),
        ("bf16", 16, "one_tile"),
        ("fp8", 16, "one_tile"),
        ("int4", 16, "one_tile"),
        ("fp8", 32, "one_tile"),
        ("int4", 16, "tiled"),
    ],
)
@pytest.mark.parametrize("kernels", BACKENDS)
def test_snapshot_rows_and_the_gradients_stay_within_the_documented_per_group_bounds(
    kernels, mode, chunk_size, tiles, monkeypatch
):
    """The rows the forward keeps (read back from the documented storage, one scale per 16
    columns) hold each entry's chunk-start row within the mode's bound for its group
    (``tests.oracle.snapshot_error_bound``), element by element; the gradients of v, beta
    and the bank are exact whatever the mode; those of write_w, read_w and decay are off by
    at most KAPPA of the largest error those row errors allow, element by element
    (``tests.oracle.snapshot_gradient_bounds``), with output_final_state (and, for "none" and
    "int4", without)."""
    if tiles == "tiled":
        monkeypatch.setattr(recurrence_fwd, "_TILE", 128)
    device = KERNEL_DEVICE if kernels else "cpu"
    T = 2 * chunk_size + 8
    a = make_sdm_inputs(B=1, T=T, H=2, D=32, S=9, W=3, R=2, seed=70 + chunk_size)
    a["v"] = a["v"] * COLUMN_SCALE
    a["bank"] = a["bank"] * COLUMN_SCALE
    a = {k: x.to(device) for k, x in a.items()}
    leaves = {k: a[k].clone().requires_grad_() for k in FLOATS}
    g_out, g_bank = _cotangents((1, T, 2, 32), (1, 2, 9, 32), seed=71)
    g_out, g_bank = g_out / COLUMN_SCALE, g_bank / COLUMN_SCALE
    with _backend(kernels):
        out, bank, kept = torch.ops.sdm.sparse_delta_memory(
            *sdm_positional(dict(a, **leaves)),
            chunk_size=chunk_size,
            snapshot=mode,
            output_final_state=True,
        )
        snap = kept[KEPT_FOR_BACKWARD.index("snap")]
        scale = kept[KEPT_FOR_BACKWARD.index("snap_scale")]
        loss = (out * g_out.to(device)).sum() + (bank * g_bank.to(device)).sum()
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    unit = _bf16_unit(kernels)
    run, want, rows, bounds = snapshot_gradient_bounds(a, g_out, g_bank, chunk_size, mode, unit)
    # The rows: the kernel's own float32 rows are within the float32 contract of the exact
    # ones (relative to their group, the columns being independent).
    back = dequantize_snapshot(snap, scale, mode, 32)
    groups = rows.reshape(*rows.shape[:-1], 2, 16).abs().amax(-1, keepdim=True)
    slack = (RTOL * groups).expand(*rows.shape[:-1], 2, 16).reshape(rows.shape)
    excess = (back - rows).abs() - snapshot_error_bound(rows, mode, unit) - slack
    if excess.max() > 0:
        i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"snapshot {mode}: entry row element {i} holds {back[i].item():.6g} for "
            f"{rows[i].item():.6g}, beyond its group's bound by {excess.max().item():.3e}"
        )
    for k in ("v", "beta", "bank"):
        assert_close(grads[k], want[k], rtol=RTOL, name=f"{mode}: d{k}")
    for k, bound in bounds.items():
        got = grads[k].detach().cpu().to(F64)
        slack = RTOL * max(want[k].abs().max().item(), 1.0)
        excess = (got - want[k]).abs() - KAPPA[mode] * bound - slack
        if excess.max() > 0:
            i = tuple(int(j) for j in torch.unravel_index(excess.argmax(), excess.shape))
            raise AssertionError(
                f"snapshot {mode}: d{k}{list(i)} = {got[i].item():.6g} against "
                f"{want[k][i].item():.6g}, beyond {KAPPA[mode]} of the snapshot's bound "
                f"{bound[i].item():.3e} by {excess.max().item():.3e}"
            )
    if mode not in ("none", "int4"):
        return
    # Without a final state the gradients (no bank term) are the same functions of the same
    # snapshot.
    out2, bank2, grads2, g2, _ = _run(
        a, kernels=kernels, chunk_size=chunk_size, final=False, seed=72, snapshot=mode
    )
    assert bank2 is None
    run2, want2, _, bounds2 = snapshot_gradient_bounds(a, g2, None, chunk_size, mode, unit)
    assert_close(out2, run2.out, rtol=RTOL, name="out")
    for k in grads2:
        got = grads2[k].detach().cpu().to(F64)
        slack = RTOL * max(want2[k].abs().max().item(), 1.0)
        allowed = KAPPA[mode] * bounds2[k] + slack if k in bounds2 else slack
        assert ((got - want2[k]).abs() <= allowed).all(), f"{mode}, out only: d{k}"


# ---------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------


def _layer_oracle(layer, x, state=None):
    """The layer in float64 from its definition: the projections as plain matrix products,
    each slot's product-key score as the sum of one column per factor, the exact top k of
    those (``product_key_topk_bruteforce``), a softmax over them, the oracle's recurrence from
    the learned bank (or ``state``), and the output projection. Returns (y, final state,
    leaves by name: "x", "state" and the parameters' names) for autograd."""
    p = {n: t.detach().cpu().to(F64).requires_grad_() for n, t in layer.named_parameters()}
    p["x"] = x.detach().cpu().to(F64).requires_grad_()
    if state is not None:
        p["state"] = state.detach().cpu().to(F64).requires_grad_()
    B, T, _ = x.shape
    H, F, K, D = layer.heads, len(layer.factors), layer.key_dim, layer.head_dim

    def linear(name, inp):
        y = inp @ p[f"{name}.weight"].T
        return y if f"{name}.bias" not in p else y + p[f"{name}.bias"]

    def address(name, k):
        q = linear(name, p["x"]).view(B, T, H, F, K)
        blocks = [
            torch.einsum("bthk,hnk->bthn", q[..., f, :], keys) * K**-0.5
            for f, keys in enumerate(p["sub_keys"].split(list(layer.factors), 1))
        ]
        score = blocks[0]
        for block in blocks[1:]:  # row-major slots: the last factor varies fastest
            score = (score[..., :, None] + block[..., None, :]).flatten(-2)
        # float32 scores are within about 1e-6 of these: a gap of 1e-5 at the boundary of
        # the k best makes the layer's selection the same as the oracle's.
        kk = min(k, score.shape[-1])
        ranked = score.detach().sort(-1, descending=True).values
        if kk < score.shape[-1]:
            gap = (ranked[..., kk - 1] - ranked[..., kk]).min().item()
            assert gap > 1e-5, f"a near tie at the top-{kk} boundary ({gap:.1e}): another seed"
        _, idx = ref.product_key_topk_bruteforce(torch.cat(blocks, -1).detach(), layer.factors, k)
        return idx, torch.softmax(score.gather(-1, idx), -1)

    write_idx, write_w = address("k_proj", layer.write_topk)
    read_idx, read_w = address("q_proj", layer.read_topk)
    args = dict(
        v=linear("v_proj", p["x"]).view(B, T, H, D),
        beta=torch.sigmoid(linear("b_proj", p["x"])),
        write_idx=write_idx,
        write_w=write_w,
        read_idx=read_idx,
        read_w=read_w,
        bank=p["bank"] if state is None else p["state"],
    )
    if layer.use_decay:
        args["decay"] = torch.sigmoid(linear("decay_proj", p["x"]))[..., None].expand_as(write_w)
    run = sdm_oracle(args)
    y = linear("o_proj", run.out.reshape(B, T, H * D))
    return y, run.bank, p


@pytest.mark.parametrize("variant", ["learned_bank", "state_and_final_state", "no_decay"])
@pytest.mark.parametrize("kernels", BACKENDS)
def test_layer_matches_a_float64_composition_of_its_parts(kernels, variant):
    """``SparseDeltaMemory``'s output (and final state with ``return_state``) and the
    gradients of x, of every parameter and of a given state, against the layer computed in
    float64 from its definition (``_layer_oracle``), through three chunks."""
    from sdm_ops.nn import SparseDeltaMemory

    device = KERNEL_DEVICE if kernels else "cpu"
    torch.manual_seed(80)
    layer = SparseDeltaMemory(**SMALL_LAYER, use_decay=variant != "no_decay", chunk_size=16)
    with torch.no_grad():
        layer.bank.normal_()
    layer = layer.to(device)
    g = torch.Generator().manual_seed(81)
    x = torch.randn(2, 37, 32, generator=g)
    state = torch.randn(2, 2, 16, 16, generator=g) if variant == "state_and_final_state" else None
    g_y = torch.randn(2, 37, 32, generator=g)
    g_state = torch.randn(2, 2, 16, 16, generator=g)
    xl = x.to(device).requires_grad_()
    sl = None if state is None else state.to(device).requires_grad_()
    with _backend(kernels):
        if sl is None:
            y, final = layer(xl), None
        else:
            y, final = layer(xl, state=sl, return_state=True)
        loss = (y * g_y.to(device)).sum()
        if final is not None:
            loss = loss + (final * g_state.to(device)).sum()
        # With a given state the learned initial bank takes no part.
        params = {n: t for n, t in layer.named_parameters() if n != "bank" or sl is None}
        wrt = {"x": xl, **({} if sl is None else {"state": sl}), **params}
        grads = dict(zip(wrt, torch.autograd.grad(loss, list(wrt.values()))))
    y64, final64, leaves = _layer_oracle(layer, x, state)
    loss64 = (y64 * g_y.to(F64)).sum()
    if final is not None:
        loss64 = loss64 + (final64 * g_state.to(F64)).sum()
    want = dict(zip(wrt, torch.autograd.grad(loss64, [leaves[n] for n in wrt])))
    assert_close(y, y64, rtol=RTOL, name="y")
    if final is not None:
        assert_close(final, final64, rtol=RTOL, name="final state")
    for n in wrt:
        assert_close(grads[n], want[n], rtol=RTOL, name=f"d {n}")


def _packed_snapshot_bounds(a: dict, g_out, g_bank, chunk_size: int, mode: str, unit: float):
    """``snapshot_gradient_bounds`` of a packed batch: each sequence as a dense batch of one
    (it runs from its own bank, as if alone), the results put back in the packed layout."""
    cu = a["cu_seqlens"].tolist()
    runs, wants, bounds = [], [], []
    for n in range(len(cu) - 1):
        t = slice(cu[n], cu[n + 1])
        seq = {k: x[:, t] for k, x in a.items() if k not in ("bank", "cu_seqlens")}
        seq["bank"] = (a["bank"] if a["bank"].dim() == 3 else a["bank"][n])[None]
        gb = None if g_bank is None else g_bank[n : n + 1]
        run, want, _, bound = snapshot_gradient_bounds(seq, g_out[:, t], gb, chunk_size, mode, unit)
        runs.append(run)
        wants.append(want)
        bounds.append(bound)
    out = torch.cat([r.out for r in runs], 1)
    bank = torch.cat([r.bank for r in runs], 0)
    want = {k: torch.cat([w[k] for w in wants], 1) for k in wants[0] if k != "bank"}
    want["bank"] = torch.cat([w["bank"] for w in wants], 0)
    if a["bank"].dim() == 3:
        want["bank"] = want["bank"].sum(0)
    bound = {k: torch.cat([b[k] for b in bounds], 1) for k in bounds[0]}
    return out, bank, want, bound


def _mixed_magnitudes(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with each element scaled by 2^-k, k drawn in 0..20: every group of 16 columns
    mixes magnitudes, so fp8 stores codes in its subnormals and int4 rounds small elements
    to 0 and to every step."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 21, x.shape, generator=g)
    return x * torch.exp2(-k.to(x.dtype)).to(x.device)


@pytest.mark.parametrize("final", [False, True], ids=["out_only", "final_state"])
@pytest.mark.parametrize("layout", ["dense_tiled", "packed"])
@pytest.mark.parametrize("mode", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("kernels", BACKENDS)
def test_every_snapshot_mode_on_mixed_groups_packed_and_tiled_stays_within_its_bounds(
    kernels, mode, layout, final, monkeypatch
):
    """Each quantized snapshot, on a dense batch walked in tiles and on a packed batch, with
    and without the final state, on rows whose groups of 16 columns mix magnitudes: out,
    the final state and the gradients of v, beta and the bank equal the oracle's to the
    float32 contract; those of write_w, read_w and decay stay within what the snapshot's
    documented bound allows, element by element (the bound itself: where magnitudes mix
    inside a group, the errors come closer to it than KAPPA's margin, up to 0.8 of it)."""
    device = KERNEL_DEVICE if kernels else "cpu"
    C = 16
    if layout == "packed":
        a = make_packed_sdm_inputs([21, 40, 7], D=16, S=9, seed=90, device=device)
    else:
        monkeypatch.setattr(recurrence_fwd, "_TILE", 128)
        a = make_sdm_inputs(B=1, T=2 * C + 8, H=2, D=16, S=9, W=3, R=2, seed=91, device=device)
    a["bank"] = _mixed_magnitudes(a["bank"], seed=92)
    a["v"] = _mixed_magnitudes(a["v"], seed=93)
    out, bank, grads, g_out, g_bank = _run(
        a, kernels=kernels, chunk_size=C, final=final, snapshot=mode
    )
    unit = _bf16_unit(kernels)
    if layout == "packed":
        want_out, want_bank, want, bounds = _packed_snapshot_bounds(a, g_out, g_bank, C, mode, unit)
    else:
        run, want, _, bounds = snapshot_gradient_bounds(a, g_out, g_bank, C, mode, unit)
        want_out, want_bank = run.out, run.bank
    assert_close(out, want_out, rtol=RTOL, name="out")
    if final:
        assert_close(bank, want_bank, rtol=RTOL, name="final state")
    for k in ("v", "beta", "bank"):
        assert_close(grads[k], want[k], rtol=RTOL, name=f"{mode}: d{k}")
    for k, bound in bounds.items():
        got = grads[k].detach().cpu().to(F64)
        slack = RTOL * max(want[k].abs().max().item(), 1.0)
        excess = (got - want[k]).abs() - bound - slack
        assert excess.max() <= 0, f"snapshot {mode}: d{k} beyond its bound by {excess.max():.3e}"
