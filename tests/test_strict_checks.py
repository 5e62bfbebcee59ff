"""Strict checks and the default without them: on a GPU an eager call reads no data by default
(an index outside [0, S) acts as padding, malformed ``cu_seqlens`` are made well formed), and
strict mode (``sdm_ops.set_strict_checks``, ``sdm_ops.strict_checks()``, ``SDM_OPS_STRICT``)
rejects them with a ``ValueError`` naming the argument; on the CPU the checks always run.

The GPU's default is what every call whose data checks do not run gets: on the CPU the tests
take it by patching ``recurrence.data_checks_wanted`` to its answer for a GPU device."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

import sdm_ops
from sdm_ops import _checks, recurrence
from tests.helpers import (
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_cuda,
    requires_kernels,
)
from tests.oracle import FLOATS

S = 11
# (write entry, read entry) values outside [0, S): just past the bank, far past it, the
# int32 extremes, below -1.
BAD_VALUES = ((S, -2), (10**6, -(2**31)), (2**31 - 1, S + 3))


@pytest.fixture(autouse=True)
def _restore_strict():
    """Each test starts from the process's setting and leaves it as it found it."""
    before = sdm_ops.strict_checks_enabled()
    yield
    sdm_ops.set_strict_checks(before)


def _as_on_a_gpu():
    """The checks' decision for every device as it is for a GPU (strict mode's setting)."""
    return mock.patch.object(
        recurrence,
        "data_checks_wanted",
        lambda device: _checks.data_checks_wanted(torch.device("cuda")),
    )


def _default_mode(device: str):
    """Calls on ``device`` as a GPU makes them by default: no strict checks, and on the CPU
    the GPU's decision (no data read)."""
    sdm_ops.set_strict_checks(False)
    return _as_on_a_gpu() if device == "cpu" else contextlib.nullcontext()


def _bad_and_padded(a: dict, seed: int) -> tuple[dict, dict]:
    """``a`` with some index entries replaced by out-of-range values, and the same entries
    replaced by -1."""
    g = torch.Generator().manual_seed(seed)
    bad, padded = dict(a), dict(a)
    for k, name in enumerate(("write_idx", "read_idx")):
        idx = a[name]
        pick = torch.rand(idx.shape, generator=g) < 0.2
        values = torch.tensor([v[k] for v in BAD_VALUES])
        choice = values[torch.randint(0, len(values), idx.shape, generator=g)]
        pick, choice = pick.to(idx.device), choice.to(idx.device, idx.dtype)
        bad[name] = torch.where(pick, choice, idx)
        padded[name] = torch.where(pick, torch.full_like(idx, -1), idx)
        assert bool((bad[name] >= S).any() | (bad[name] < -1).any())
    return bad, padded


def _forward_backward(a: dict, **kw) -> list[torch.Tensor]:
    """out, final bank and the gradient of every float input of a fixed loss."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a.get(k) is not None}
    out, bank = sdm_ops.sparse_delta_memory(
        **dict(a, **leaves), chunk_size=16, output_final_state=True, **kw
    )
    g = torch.Generator().manual_seed(99)
    g_out = torch.randn(out.shape, generator=g).to(out.device)
    g_bank = torch.randn(bank.shape, generator=g).to(bank.device)
    loss = (out * g_out).sum() + (bank * g_bank).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return [out.detach(), bank.detach(), *grads]


def _in_place(a: dict, **kw) -> list[torch.Tensor]:
    bank = a["bank"].clone()
    rest = {k: v for k, v in a.items() if k != "bank"}
    out = sdm_ops.sparse_delta_memory_(bank=bank, chunk_size=16, **rest, **kw)
    return [out, bank]


def _inference(a: dict, **kw) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True, **kw))


def _assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype)
        assert torch.equal(g, w), f"{what}: result {i} differs"


# ---------------------------------------------------------------------------
# The setting
# ---------------------------------------------------------------------------


def test_the_setting_switches_and_the_context_restores_it():
    sdm_ops.set_strict_checks(False)
    assert not sdm_ops.strict_checks_enabled()
    with sdm_ops.strict_checks():
        assert sdm_ops.strict_checks_enabled()
        with sdm_ops.strict_checks(False):
            assert not sdm_ops.strict_checks_enabled()
        assert sdm_ops.strict_checks_enabled()
    assert not sdm_ops.strict_checks_enabled()
    with pytest.raises(RuntimeError, match="inside"):
        with sdm_ops.strict_checks():
            raise RuntimeError("inside")
    assert not sdm_ops.strict_checks_enabled(), "an exception left strict checks on"
    sdm_ops.set_strict_checks(True)
    assert sdm_ops.strict_checks_enabled()


@pytest.mark.parametrize("value", [1, "1", None])
def test_the_setting_takes_a_bool_only(value):
    with pytest.raises(TypeError, match="enabled must be a bool"):
        sdm_ops.set_strict_checks(value)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with sdm_ops.strict_checks(value):
            pass


@pytest.mark.parametrize(
    "value,want",
    [
        (None, False),
        ("", False),
        ("0", False),
        ("off", False),
        ("False", False),
        ("1", True),
        (" yes ", True),
        ("TRUE", True),
        ("on", True),
    ],
)
def test_the_environment_variable_s_words(value, want):
    assert _checks.strict_from_env(value) is want


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="SDM_OPS_STRICT must be one of .* got 'maybe'"):
        _checks.strict_from_env("maybe")


def test_the_environment_variable_sets_the_default_at_import():
    """``SDM_OPS_STRICT`` is read once, when sdm_ops is imported."""
    code = (
        "import sdm_ops, os; print(sdm_ops.strict_checks_enabled()); "
        "os.environ['SDM_OPS_STRICT'] = '0'; print(sdm_ops.strict_checks_enabled())"
    )
    env = dict(os.environ, SDM_OPS_STRICT="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True"]


def test_data_checks_are_wanted_on_the_cpu_always_and_on_a_gpu_only_when_strict():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    sdm_ops.set_strict_checks(False)
    assert _checks.data_checks_wanted(cpu)
    assert not _checks.data_checks_wanted(gpu)
    with sdm_ops.strict_checks():
        assert _checks.data_checks_wanted(cpu)
        assert _checks.data_checks_wanted(gpu)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_the_public_functions_ask_for_their_input_s_device(strict, packed):
    """Both functions ask ``data_checks_wanted`` about the indices' device, and read data
    (``_DataChecks.finish``) exactly when it says so."""
    if packed:
        a = make_packed_sdm_inputs([4, 0, 9], S=S, seed=1)
    else:
        a = make_sdm_inputs(B=2, T=9, S=S, seed=1)
    asked, finished = [], []
    real_finish = recurrence._DataChecks.finish

    def wanted(device):
        asked.append(device)
        return strict

    def finish(self):
        finished.append(True)
        return real_finish(self)

    with (
        mock.patch.object(recurrence, "data_checks_wanted", wanted),
        mock.patch.object(recurrence._DataChecks, "finish", finish),
    ):
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)
        _in_place(a)
    assert asked == [torch.device("cpu")] * 2
    assert finished == [True] * 2 if strict else finished == []


# ---------------------------------------------------------------------------
# The CPU checks, strict or not
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True])
def test_the_cpu_rejects_bad_indices_and_offsets_strict_or_not(strict):
    sdm_ops.set_strict_checks(strict)
    a = make_sdm_inputs(B=2, T=9, S=S, seed=2)
    bad, _ = _bad_and_padded(a, seed=3)
    for name in ("write_idx", "read_idx"):
        case = dict(a, **{name: bad[name]})
        with pytest.raises(ValueError, match=f"{name} must hold -1"):
            sdm_ops.sparse_delta_memory(**case, output_final_state=True)
        state, rest = a["bank"].clone(), {k: v for k, v in case.items() if k != "bank"}
        with pytest.raises(ValueError, match=f"{name} must hold -1"):
            sdm_ops.sparse_delta_memory_(bank=state, **rest)
        assert torch.equal(state, a["bank"]), "a rejected in-place call modified the bank"
    p = make_packed_sdm_inputs([4, 0, 9], S=S, seed=4)
    p["cu_seqlens"] = torch.tensor([0, 9, 4, 13], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        sdm_ops.sparse_delta_memory(**p, output_final_state=True)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        _in_place(p)


# ---------------------------------------------------------------------------
# The default without the checks: on a GPU, and on the CPU with the GPU's decision
# ---------------------------------------------------------------------------

DEFAULT_DEVICES = [
    pytest.param("cpu", "reference", id="cpu_reference"),
    pytest.param("cpu", "kernels", marks=requires_kernels, id="cpu_kernels"),
    pytest.param("cuda", "kernels", marks=requires_cuda, id="cuda"),
]


def _paths(device: str, path: str):
    """The kernels (under the interpreter on the CPU) or the CPU's reference path."""
    return on_kernels() if path == "kernels" else contextlib.nullcontext()


@pytest.mark.parametrize("device,path", DEFAULT_DEVICES)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_by_default_out_of_range_indices_equal_padding_bitwise(device, path, packed):
    """Without strict checks a GPU call rejects nothing: every index outside [0, S) gives
    bitwise the results of -1 there (outputs, final bank, every gradient; in place; without
    autograd)."""
    if packed:
        a = make_packed_sdm_inputs([7, 0, 20], S=S, seed=5, device=device)
    else:
        a = make_sdm_inputs(B=2, T=20, S=S, seed=5, device=device)
    bad, padded = _bad_and_padded(a, seed=6)
    with _default_mode(device), _paths(device, path):
        for run in (_forward_backward, _in_place, _inference):
            _assert_bitwise(run(bad), run(padded), run.__name__)
    assert sdm_ops.strict_checks_enabled() is False


@requires_cuda
def test_with_strict_checks_a_gpu_call_rejects_bad_indices_and_offsets():
    a = make_sdm_inputs(B=2, T=20, S=S, seed=7, device="cuda")
    bad, _ = _bad_and_padded(a, seed=8)
    with sdm_ops.strict_checks():
        for name in ("write_idx", "read_idx"):
            case = dict(a, **{name: bad[name]})
            with pytest.raises(ValueError, match=f"{name} must hold -1"):
                _forward_backward(case)
            state, rest = a["bank"].clone(), {k: v for k, v in case.items() if k != "bank"}
            with pytest.raises(ValueError, match=f"{name} must hold -1"):
                sdm_ops.sparse_delta_memory_(bank=state, **rest)
            assert torch.equal(state, a["bank"]), "a rejected in-place call modified the bank"
        p = make_packed_sdm_inputs([4, 0, 9], S=S, seed=9, device="cuda")
        p["cu_seqlens"] = torch.tensor([0, 9, 4, 13], dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            _forward_backward(p)
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            _in_place(p)


# (malformed offsets of T = 24 tokens, the well-formed offsets they act as)
MALFORMED = [
    ([0, 9, 4, 20, 24], [0, 9, 9, 20, 24]),  # a decrease: raised to the largest before it
    ([-7, 3, 3, 99], [0, 3, 3, 24]),  # outside [0, T]: clamped, the ends taken as 0 and T
    ([5, 4, 3, 2], [0, 4, 4, 24]),  # first and last taken as 0 and T
    ([0, 24, 0, 24], [0, 24, 24, 24]),  # overlapping sequences: the later one empty
    ([2, 9, 17, 20], [0, 9, 17, 24]),  # tokens before the first and after the last offset
]


@pytest.mark.parametrize("offsets,well_formed", MALFORMED)
def test_the_well_formed_offsets(offsets, well_formed):
    for dtype in (torch.int32, torch.int64):
        cu = torch.tensor(offsets, dtype=dtype)
        got = recurrence._well_formed_offsets(cu, 24)
        assert got.dtype == dtype and got.tolist() == well_formed
        assert cu.tolist() == offsets, "the caller's offsets were modified"
    valid = torch.tensor([0, 0, 5, 5, 24])
    assert torch.equal(recurrence._well_formed_offsets(valid, 24), valid)


@pytest.mark.parametrize(
    "offsets,well_formed,device,path",
    [
        pytest.param(*m, *d.values, marks=d.marks, id=f"{d.id}-{i}")
        for i, m in enumerate(MALFORMED)
        for d in DEFAULT_DEVICES
        # Under the interpreter: the cases the chunk tables alone would leave to no sequence
        # or to two.
        if d.id != "cpu_kernels" or i >= 3
    ],
)
def test_by_default_malformed_offsets_act_as_their_well_formed_version(
    offsets, well_formed, device, path
):
    """Without strict checks malformed offsets give bitwise the results of their
    well-formed version, every token in one sequence; on a GPU the same again on a second
    call."""
    lengths = [hi - lo for lo, hi in itertools.pairwise(well_formed)]
    a = make_packed_sdm_inputs(lengths, S=S, seed=10, device=device)
    assert a["v"].shape[1] == 24 and a["bank"].shape[0] == len(offsets) - 1
    bad = dict(a, cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device=device))
    good = dict(a, cu_seqlens=torch.tensor(well_formed, dtype=torch.int32, device=device))
    with _default_mode(device), _paths(device, path):
        for run in (_forward_backward, _in_place):
            first = run(bad)
            _assert_bitwise(first, run(good), f"{run.__name__} against the well-formed offsets")
            if device == "cuda":
                _assert_bitwise(run(bad), first, f"{run.__name__} twice")
