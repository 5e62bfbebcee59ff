"""The decode step (``sdm_internal::decode_step_``, T = 1, whose body ``sdm::sparse_delta_memory_``
runs in its own dispatch): the kernel (natively on CUDA, under the interpreter on CPU) and the
CPU path against the float64 token reference, with duplicate slots within the token, padding,
out-of-range indices and zero decays; in place and deterministic.
Its opcheck lives in test_opcheck.py with the other operators'."""

import contextlib

import pytest
import torch

import sdm_ops
from sdm_ops import reference as ref
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_sdm_inputs,
    on_kernels,
    requires_kernels,
    sdm_positional,
    to_float64,
)


def _inputs(**kw):
    """One token per stream, a per-stream bank; S small, so duplicates within the token are
    frequent."""
    kw = dict(dict(B=3, T=1, H=2, D=32, S=5, W=6, R=4, seed=0), **kw)
    return make_sdm_inputs(**kw)


def _oracle(a):
    a = to_float64({k: v.cpu() for k, v in a.items()})
    return ref.sdm_token_reference(*sdm_positional(a))


def _step(a, kernels: bool):
    bank = a["bank"].clone()
    rest = {k: v for k, v in a.items() if k != "bank"}
    with on_kernels() if kernels else contextlib.nullcontext():
        out = sdm_ops.sparse_delta_memory_(bank=bank, **rest)
    return out, bank


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=requires_kernels)], ids=["cpu_reference", "kernels"]
)
@pytest.mark.parametrize("decay", [True, False])
def test_decode_step_matches_float64_token_reference(kernels, decay):
    a = _inputs(decay=decay, seed=1 + decay, device=KERNEL_DEVICE if kernels else "cpu")
    out, bank = _step(a, kernels)
    out_r, bank_r = _oracle(a)
    assert out.shape == a["v"].shape and out.dtype == a["v"].dtype
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


@requires_kernels
def test_an_eager_decode_step_dispatches_one_operator():
    # The public operator runs the step's body itself: a nested sdm_internal::decode_step_
    # would be a second dispatch, host time that an eager decode loop pays every token.
    a = _inputs(seed=5, device=KERNEL_DEVICE)
    with torch.profiler.profile() as prof:
        out, bank = _step(a, True)
    called = sorted({e.name for e in prof.events() if e.name.startswith("sdm")})
    assert called == ["sdm::sparse_delta_memory_"], called
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


@requires_kernels
def test_decode_step_every_entry_on_one_slot_and_zero_decays():
    a = _inputs(
        S=1, W=5, R=3, padding=0.0, zero_decay=0.5, one_decay=0.2, seed=3, device=KERNEL_DEVICE
    )
    out, bank = _step(a, True)
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


@requires_kernels
def test_decode_step_bfloat16_values_and_bank_and_int32_indices():
    a = _inputs(dtype=torch.bfloat16, index_dtype=torch.int32, D=64, seed=4, device=KERNEL_DEVICE)
    out, bank = _step(a, True)
    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in a.items()}
    out_f, bank_f = _step(f32, False)  # the same step in float32 on the CPU path
    assert out.dtype == bank.dtype == torch.bfloat16
    assert_close(out, out_f, rtol=2**-7, name="out")
    assert_close(bank, bank_f, rtol=2**-7, name="bank")


@requires_kernels
def test_decode_step_masks_out_of_range_indices_as_padding():
    """With the eager index check off (as in compiled code), an index >= S or < -1 reads and
    writes nothing, exactly like -1."""
    from unittest import mock

    a = _inputs(seed=5, device=KERNEL_DEVICE)
    bad = dict(a)
    for name, value in (("write_idx", 99), ("read_idx", -7)):
        idx = a[name].clone()
        idx[0, 0, 1, 0] = value
        bad[name] = idx
        a[name] = torch.where(idx == value, -1, idx)
    with mock.patch.object(sdm_ops.recurrence, "data_checks_enabled", lambda: False):
        out, bank = _step(bad, True)
    out_r, bank_r = _step(a, True)
    assert torch.equal(out, out_r) and torch.equal(bank, bank_r)


@requires_kernels
def test_decode_steps_equal_the_chunked_path_and_repeat_bitwise():
    """Four tokens one step at a time equal the chunked in-place path over the four, to
    rounding; the same steps again give bitwise the same state."""
    a = make_sdm_inputs(B=2, T=4, H=2, D=32, S=7, W=3, R=2, seed=6, device=KERNEL_DEVICE)
    rest = {k: v for k, v in a.items() if k != "bank"}
    whole = a["bank"].clone()
    with on_kernels():
        out_whole = sdm_ops.sparse_delta_memory_(bank=whole, **rest)
    states = []
    for _ in range(2):
        bank = a["bank"].clone()
        outs = []
        with on_kernels():
            for t in range(4):
                outs.append(
                    sdm_ops.sparse_delta_memory_(
                        bank=bank, **{k: v[:, t : t + 1] for k, v in rest.items()}
                    )
                )
        states.append((torch.cat(outs, 1), bank))
    assert_close(states[0][0], out_whole, rtol=1e-5, name="out")
    assert_close(states[0][1], whole, rtol=1e-5, name="bank")
    assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])


def test_decode_step_reference_equals_the_token_and_chunked_references():
    """Against the dense token reference at a small S with every corner case, and against the
    chunked reference at a bank size the dense one could not hold."""
    a = _inputs(S=3, W=8, R=8, seed=7)
    out, new, slot = ref.decode_step_reference(**to_float64(a))
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-12, name="out")
    B, H, W = slot.shape
    rows = torch.gather(bank_r, 2, slot.clamp(min=0)[..., None].expand(B, H, W, bank_r.shape[-1]))
    assert_close(
        torch.where((slot >= 0)[..., None], new, 0),
        torch.where((slot >= 0)[..., None], rows, 0),
        rtol=1e-12,
        name="new rows",
    )
    big = _inputs(S=1 << 16, D=16, seed=8)
    out, bank = _step(big, False)
    out_r, bank_r = ref.sdm_chunked_reference(*sdm_positional(to_float64(big)), chunk_size=16)
    assert_close(out, out_r, rtol=1e-5, name="out (S = 65536)")
    assert_close(bank, bank_r, rtol=1e-5, name="bank (S = 65536)")
