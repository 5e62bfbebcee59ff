"""``output_final_state=False``: the recurrence on the working set of touched rows.

The row numbering (``working_set.working_rows``) against a plain loop over the entries; the
outputs and every gradient against the same call that returns the final state (which runs on
the whole bank), on the reference path and on the kernels; and, through the traced graph of a
forward and backward, that no tensor of the call has S rows but the bank's own gradient.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

import sdm_ops
from sdm_ops import recurrence, working_set
from tests.oracle import FLOATS

from .helpers import (
    KERNEL_DEVICE,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_cuda,
    requires_kernels,
)


def _loop_rows(write_idx, read_idx, S, streams_of_token):
    """The numbering by plain loops: per stream, its valid slots ascending."""
    B, T, H, W = write_idx.shape
    slots: dict[int, set[int]] = {}
    for idx in (write_idx, read_idx):
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    p = streams_of_token(b, t, h)
                    for s in idx[b, t, h].tolist():
                        if p is not None and 0 <= s < S:
                            slots.setdefault(p, set()).add(s)
    return {p: sorted(v) for p, v in slots.items()}


def _check_rows(rows, write_idx, read_idx, S, P, streams_of_token):
    want = _loop_rows(write_idx, read_idx, S, streams_of_token)
    U = rows.row_slots.shape[1]
    assert rows.row_slots.shape == (P, U)
    for p in range(P):
        got = rows.row_slots[p].tolist()
        n = len(want.get(p, []))
        assert got[:n] == want.get(p, []), f"stream {p}"
        assert got[n:] == [-1] * (U - n), f"stream {p}: unused rows"
    for idx, entry_rows in ((write_idx, rows.write_rows), (read_idx, rows.read_rows)):
        assert entry_rows.dtype == torch.int64 and entry_rows.shape == idx.shape
        B, T, H, E = idx.shape
        for b in range(B):
            for t in range(T):
                for h in range(H):
                    p = streams_of_token(b, t, h)
                    for e in range(E):
                        s, r = int(idx[b, t, h, e]), int(entry_rows[b, t, h, e])
                        if p is None or not 0 <= s < S:
                            assert r == -1
                        else:
                            assert r == want[p].index(s)


def test_rows_number_each_streams_distinct_slots_in_slot_order():
    a = make_sdm_inputs(B=2, T=9, H=3, S=13, W=3, R=2, seed=1)
    # Out-of-range entries count as padding, as in the kernels.
    a["write_idx"][0, 1, 0, 0] = 13
    a["write_idx"][1, 2, 2, 1] = -7
    a["read_idx"][0, 3, 1, 0] = 99
    rows = working_set.working_rows(a["write_idx"], a["read_idx"], 13)
    assert rows.row_slots.shape[1] == working_set.working_set_rows(9, 3, 2, 13) == 13
    _check_rows(rows, a["write_idx"], a["read_idx"], 13, 6, lambda b, t, h: b * 3 + h)


def test_rows_of_a_packed_batch_are_per_sequence():
    # Sequences of 4, 0 and 6 tokens; S large enough that U = T * (W + R) < S.
    a = make_packed_sdm_inputs([4, 0, 6], H=2, S=1000, W=3, R=2, seed=2)
    cu = a["cu_seqlens"].tolist()

    def stream(b, t, h):
        n = max(i for i in range(3) if cu[i] <= t)
        return n * 2 + h

    rows = working_set.working_rows(a["write_idx"], a["read_idx"], 1000, a["cu_seqlens"])
    assert rows.row_slots.shape == (6, 10 * 5)
    _check_rows(rows, a["write_idx"], a["read_idx"], 1000, 6, stream)


def test_rows_of_an_empty_sequence_batch():
    a = make_sdm_inputs(B=2, T=0, H=2, S=5)
    rows = working_set.working_rows(a["write_idx"], a["read_idx"], 5)
    assert rows.row_slots.shape == (4, 1) and bool((rows.row_slots == -1).all())


def _run(a, final, kernels, chunk_size):
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a.get(k) is not None}
    with on_kernels() if kernels else torch.enable_grad():
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(a, **leaves), chunk_size=chunk_size, output_final_state=final
        )
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
        grads = torch.autograd.grad(out, list(leaves.values()), g)
    return out, bank, dict(zip(leaves, grads))


CASES = {
    # name: (inputs, chunk size)
    "per_stream": (lambda dev: make_sdm_inputs(B=2, T=40, S=9, seed=4, device=dev), 16),
    "shared": (lambda dev: make_sdm_inputs(B=2, T=40, S=9, shared=True, seed=5, device=dev), 16),
    "large_S": (lambda dev: make_sdm_inputs(B=2, T=33, S=5000, seed=6, device=dev), 32),
    "bf16_bank": (
        lambda dev: make_sdm_inputs(
            B=1, T=40, S=9, bank_dtype=torch.bfloat16, shared=True, seed=7, device=dev
        ),
        16,
    ),
    "tiled": (lambda dev: make_sdm_inputs(B=1, T=20, H=1, S=40, W=20, R=9, seed=8, device=dev), 16),
    "packed": (
        lambda dev: make_packed_sdm_inputs([7, 0, 30], S=9, seed=9, device=dev),
        16,
    ),
    "packed_shared": (
        lambda dev: make_packed_sdm_inputs([21, 5], S=300, shared=True, seed=10, device=dev),
        16,
    ),
}


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=requires_kernels)], ids=["reference", "kernels"]
)
@pytest.mark.parametrize("case", list(CASES))
def test_without_the_final_state_out_and_gradients_equal_those_with_it(case, kernels):
    """The working set renames rows and changes nothing else: out and every gradient (the
    initial bank's included, shared or per stream) are bitwise those of the call that returns
    the final state, and that call's bank comes back only when asked for."""
    make, C = CASES[case]
    a = make(KERNEL_DEVICE if kernels else "cpu")
    out_f, bank_f, grads_f = _run(a, True, kernels, C)
    out, bank, grads = _run(a, False, kernels, C)
    assert bank is None and bank_f is not None
    assert torch.equal(out, out_f)
    for k in grads:
        assert torch.equal(grads[k], grads_f[k]), k


@requires_kernels
def test_without_the_final_state_kernels_are_deterministic_and_agree_with_the_reference():
    a = make_sdm_inputs(B=2, T=70, S=300, shared=True, seed=11, device=KERNEL_DEVICE)
    out1, _, g1 = _run(a, False, True, 32)
    out2, _, g2 = _run(a, False, True, 32)
    assert torch.equal(out1, out2) and all(torch.equal(g1[k], g2[k]) for k in g1)
    cpu = {k: v.cpu() if v is not None else v for k, v in a.items()}
    out_r, _, g_r = _run(cpu, False, False, 32)
    torch.testing.assert_close(out1.cpu(), out_r, rtol=1e-5, atol=1e-5)
    for k in g1:
        torch.testing.assert_close(g1[k].cpu(), g_r[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=requires_kernels)], ids=["reference", "kernels"]
)
def test_out_of_range_indices_act_as_padding_without_the_final_state(kernels):
    """Unchecked (as in compiled code), an index outside [0, S) reads and writes nothing: the
    same result as -1 there."""
    a = make_sdm_inputs(B=2, T=20, S=9, shared=True, seed=12, device=KERNEL_DEVICE)
    bad = {k: (v.clone() if v is not None else v) for k, v in a.items()}
    bad["write_idx"][0, 3, 1, 0] = 9
    bad["read_idx"][1, 5, 0, 1] = 1 << 40
    bad["write_idx"][1, 7, 0, 2] = -5
    pad = {k: (v.clone() if v is not None else v) for k, v in bad.items()}
    for idx in (pad["write_idx"], pad["read_idx"]):
        idx[(idx < 0) | (idx >= 9)] = -1
    if not kernels:
        bad, pad = ({k: v.cpu() if v is not None else v for k, v in d.items()} for d in (bad, pad))
    with mock.patch.object(recurrence, "data_checks_enabled", lambda: False):
        out_b, _, g_b = _run(bad, False, kernels, 16)
    out_p, _, g_p = _run(pad, False, kernels, 16)
    assert torch.equal(out_b, out_p)
    assert all(torch.equal(g_b[k], g_p[k]) for k in g_b)


def _traced_shapes(fn, *args):
    """The shapes of every tensor in the forward and backward graphs AOT autograd traces of
    ``fn(*args)`` (a loss), after running them once."""
    shapes = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            for val in torch.utils._pytree.tree_leaves(node.meta.get("val")):
                if isinstance(val, torch.Tensor):
                    shapes.append(tuple(val.shape))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    compiled(*args).backward()
    return shapes


@pytest.mark.parametrize("bank_grad", [False, True], ids=["bank_fixed", "bank_learned"])
def test_no_tensor_of_the_call_has_S_rows_but_the_banks_gradient(bank_grad):
    """Forward and backward with a shared bank of S = 4096 rows, 2 streams of 20 tokens: the
    only tensors with S rows are the bank and, when it is learned, its gradient [H, S, D]; in
    particular no [B, H, S, D] state (with the final state, the traced graphs hold one)."""
    S = 4096
    a = make_sdm_inputs(B=2, T=20, H=2, D=16, S=S, shared=True, seed=13)
    bank = a.pop("bank").requires_grad_(bank_grad)
    v = a.pop("v").requires_grad_()

    def loss(v, bank, final):
        out, _ = sdm_ops.sparse_delta_memory(
            v, bank=bank, **a, chunk_size=16, output_final_state=final
        )
        return out.sum()

    shapes = _traced_shapes(lambda v, bank: loss(v, bank, False), v, bank)
    with_S = [s for s in shapes if S in s]
    assert with_S and all(s == (2, S, 16) for s in with_S), with_S
    assert any(s == (2, 20, 2, 16) for s in shapes)  # the trace did see the call's tensors
    with_final = _traced_shapes(lambda v, bank: loss(v, bank, True), v, bank)
    assert (2, 2, S, 16) in with_final


@requires_cuda
def test_peak_memory_of_training_does_not_grow_with_S_but_by_the_banks_gradient():
    """Forward and backward at S = 2^16 and 2^20 (B = 2, T = 1024, H = 4, D = 64, a shared
    float32 bank requiring grad): the peak above the inputs grows by no more than the
    gradient's own growth (its zeroed [H, S, D]) and 64 MiB of slack."""

    def peak(S):
        a = make_sdm_inputs(B=2, T=1024, H=4, D=64, S=S, W=8, R=8, shared=True, seed=14)
        a = {k: v.cuda() if v is not None else v for k, v in a.items()}
        leaves = {k: a[k].requires_grad_() for k in ("v", "beta", "write_w", "read_w", "bank")}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out, _ = sdm_ops.sparse_delta_memory(**a, chunk_size=64)
        torch.autograd.grad(out.sum(), list(leaves.values()))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(2**16), peak(2**20)
    grad_growth = 4 * (2**20 - 2**16) * 64 * 4
    assert large - small <= grad_growth + 64 * 2**20, (small, large)


@requires_kernels
@pytest.mark.parametrize("final", [True, False], ids=["final_state", "working_set"])
def test_int32_indices_equal_int64_indices_over_many_chunks(final):
    """The index dtype changes nothing: out and every gradient bitwise, over five chunks (the
    walks carry each chunk's indices into the next iteration, where a 32-bit index once
    went wrong from the third chunk on)."""
    a = make_sdm_inputs(B=2, T=70, S=9, shared=True, seed=15, device=KERNEL_DEVICE)
    a32 = dict(a, write_idx=a["write_idx"].int(), read_idx=a["read_idx"].int())
    out, _, grads = _run(a, final, True, 16)
    out32, _, grads32 = _run(a32, final, True, 16)
    assert torch.equal(out, out32)
    assert all(torch.equal(grads[k], grads32[k]) for k in grads)


def _force_numbering(monkeypatch):
    """Number the working set whatever its size (the rule of ``numbers_rows`` switched off)."""
    from sdm_ops.meta import recurrence as meta

    rule = lambda T, W, R, S, output_final_state: not output_final_state
    monkeypatch.setattr(working_set, "numbers_rows", rule)
    monkeypatch.setattr(meta, "numbers_rows", rule)


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=requires_kernels)])
@pytest.mark.parametrize("case", ["per_stream", "shared", "packed", "tiled"])
def test_slots_as_rows_equal_the_numbered_working_set_bitwise(case, kernels, monkeypatch):
    """Where the working set would be as large as the bank (T (W + R) >= S), the call runs on
    the slots themselves, with no numbering: out and every gradient are bitwise those of the
    numbered working set, and no entry is numbered."""
    make, C = CASES[case]
    a = make(KERNEL_DEVICE if kernels else "cpu")
    B, T, H, W = a["write_idx"].shape
    assert not working_set.numbers_rows(T, W, a["read_idx"].shape[-1], a["bank"].shape[-2], False)
    with mock.patch.object(working_set, "working_rows", side_effect=AssertionError("numbered")):
        out, _, grads = _run(a, False, kernels, C)
    _force_numbering(monkeypatch)
    want_out, _, want = _run(a, False, kernels, C)
    assert torch.equal(out, want_out)
    for k in want:
        assert torch.equal(grads[k], want[k]), f"d{k}"
