"""Variable-length batches (``cu_seqlens``): a packed batch equals running each sequence on its
own, forward and backward, on the CPU path and in the kernels (natively on CUDA, under the
interpreter on CPU), against the float64 token-by-token oracle (``tests/oracle.py``) and
against each sequence run alone, with empty sequences, sequences shorter than a chunk and
lengths that are not multiples of it; bitwise determinism; the in-place variant; the chunk
tables; bad ``cu_seqlens`` rejected by name."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sdm_ops
from sdm_ops import reference as ref
from sdm_ops.kernels import recurrence_fwd
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_packed_sdm_inputs,
    on_kernels,
    requires_kernels,
    sdm_positional,
)
from tests.oracle import oracle_with_grads

FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")
H, D, S, W, R = 2, 16, 9, 3, 2
LENGTHS = [0, 5, 16, 37, 1, 0, 20]  # empty, short, one chunk exactly, several, partial


def packed_inputs(lengths, **kw) -> dict:
    """Arguments of ``sparse_delta_memory`` for sequences of ``lengths`` packed into [1, T]."""
    return make_packed_sdm_inputs(lengths, H, D, S, W, R, **kw)


def run_with_grads(fn, a: dict, g_out: torch.Tensor, g_bank: torch.Tensor, **kw):
    """(out, bank, gradients of FLOATS) of sum(out * g_out) + sum(bank * g_bank)."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a.get(k) is not None}
    out, bank = fn(**dict(a, **leaves), **dict(kw, output_final_state=True))
    loss = (out.to(torch.float64) * g_out).sum() + (bank.to(torch.float64) * g_bank).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return (
        out,
        bank,
        {k: torch.zeros_like(x) if g is None else g for (k, x), g in zip(leaves.items(), grads)},
    )


def oracle(a: dict, g_out, g_bank):
    """(out, final states, gradients) of the float64 token-by-token oracle, each sequence run
    alone from its bank."""
    run, grads, _ = oracle_with_grads(a, g_out, g_bank)
    return run.out, run.bank, grads


def grads_for(a: dict, seed: int):
    g = torch.Generator().manual_seed(seed)
    T, N = a["v"].shape[1], a["cu_seqlens"].shape[0] - 1
    return (
        torch.randn(1, T, H, D, generator=g, dtype=torch.float64).to(a["v"].device),
        torch.randn(N, H, S, D, generator=g, dtype=torch.float64).to(a["v"].device),
    )


def each_alone(
    v, beta, write_idx, write_w, read_idx, read_w, bank, decay=None, *, cu_seqlens, **kw
):
    """``sparse_delta_memory`` called on each sequence of a packed batch as a dense batch of one."""
    outs, banks = [], []
    cu = cu_seqlens.tolist()
    for n in range(len(cu) - 1):
        t = slice(cu[n], cu[n + 1])
        o, m = sdm_ops.sparse_delta_memory(
            v[:, t],
            beta[:, t],
            write_idx[:, t],
            write_w[:, t],
            read_idx[:, t],
            read_w[:, t],
            bank if bank.dim() == 3 else bank[n : n + 1],
            None if decay is None else decay[:, t],
            **dict(kw, output_final_state=True),
        )
        outs.append(o)
        banks.append(m.expand(1, *m.shape[1:]) if m.dim() == 4 else m[None])
    return torch.cat(outs, 1), torch.cat(banks, 0)


@requires_kernels
def test_kernels_quantized_snapshot_equals_each_sequence_alone():
    a = packed_inputs([3, 0, 18, 7], device=KERNEL_DEVICE, seed=13)
    g_out, g_bank = grads_for(a, 9)
    with on_kernels():
        got = run_with_grads(
            sdm_ops.sparse_delta_memory, a, g_out, g_bank, chunk_size=16, snapshot="int4"
        )
        want = run_with_grads(each_alone, a, g_out, g_bank, chunk_size=16, snapshot="int4")
    assert_close(got[0], want[0], rtol=1e-5, name="out")
    assert_close(got[1], want[1], rtol=1e-5, name="bank")
    for k in got[2]:
        assert_close(got[2][k], want[2][k], rtol=1e-5, name=f"d{k}")


def check_against_oracle(a, chunk_size, rtol, *, snapshot="none", kernels=True):
    g_out, g_bank = grads_for(a, 7)
    ctx = on_kernels() if kernels else contextlib.nullcontext()
    with ctx:
        out, bank, grads = run_with_grads(
            sdm_ops.sparse_delta_memory, a, g_out, g_bank, chunk_size=chunk_size, snapshot=snapshot
        )
    want_out, want_bank, want = oracle(a, g_out, g_bank)
    assert bank.shape == (a["cu_seqlens"].shape[0] - 1, H, S, D)
    assert_close(out, want_out, rtol=rtol, name="out")
    assert_close(bank, want_bank, rtol=rtol, name="bank")
    for k in grads:
        assert_close(grads[k], want[k], rtol=rtol, name=f"d{k}")


def test_chunk_tables_list_each_sequences_chunks_in_order():
    lengths, C = [0, 5, 16, 37, 1, 0, 20], 16
    cu = torch.tensor([0, 0, 5, 21, 58, 59, 59, 79])
    chunks, seq_chunks = ref.varlen_chunks(cu, 79, C)
    want, bounds, start = [], [0], 0
    for n in lengths:
        for t in range(0, n, C):
            want.append([start + t, min(C, n - t)])
        bounds.append(len(want))
        start += n
    assert chunks.shape == (-(-79 // C) + len(lengths), 2)
    assert chunks[: len(want)].tolist() == want
    assert (chunks[len(want) :] == 0).all(), "unused chunk slots must hold no tokens"
    assert seq_chunks.tolist() == bounds


@pytest.mark.parametrize("decay", [True, False])
def test_cpu_path_equals_each_sequence_alone_forward_and_backward(decay):
    a = packed_inputs(LENGTHS, seed=1, decay=decay)
    check_against_oracle(a, 16, 1e-5, kernels=False)


@requires_kernels
@pytest.mark.parametrize(
    "chunk_size,decay,tiles", [(16, True, "one_tile"), (16, True, "tiled"), (32, False, "one_tile")]
)
def test_kernels_equal_each_sequence_alone_forward_and_backward(
    chunk_size, decay, tiles, monkeypatch
):
    """Phase 2 with each chunk in one tile, and (at one chunk size) in steps over tiles of two
    tokens (what large W or C take)."""
    if tiles == "tiled":
        monkeypatch.setattr(recurrence_fwd, "_TILE", 128)
    a = packed_inputs(LENGTHS, device=KERNEL_DEVICE, seed=2 + chunk_size, decay=decay)
    check_against_oracle(a, chunk_size, 1e-5)


@requires_kernels
def test_kernels_shared_bank_and_int64_offsets():
    a = packed_inputs([3, 0, 18, 7], device=KERNEL_DEVICE, seed=4, shared=True)
    a["cu_seqlens"] = a["cu_seqlens"].to(torch.int64)
    check_against_oracle(a, 16, 1e-5)


@requires_kernels
def test_kernels_with_every_sequence_empty():
    a = packed_inputs([0, 0, 0], device=KERNEL_DEVICE, seed=5)
    with on_kernels():
        out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
    assert out.shape == (1, 0, H, D)
    assert torch.equal(bank, a["bank"]), "empty sequences must return their banks unchanged"
    check_against_oracle(a, 16, 1e-5)


@requires_kernels
def test_kernels_are_bitwise_deterministic():
    a = packed_inputs(LENGTHS, device=KERNEL_DEVICE, seed=6)
    g_out, g_bank = grads_for(a, 8)
    with on_kernels():
        first = run_with_grads(sdm_ops.sparse_delta_memory, a, g_out, g_bank, chunk_size=16)
        second = run_with_grads(sdm_ops.sparse_delta_memory, a, g_out, g_bank, chunk_size=16)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for k in first[2]:
        assert torch.equal(first[2][k], second[2][k]), f"d{k} differs between two runs"


@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=requires_kernels)])
def test_inplace_variant_updates_each_sequences_bank(kernels):
    device = KERNEL_DEVICE if kernels else "cpu"
    a = packed_inputs([4, 0, 19, 1], device=device, seed=9)
    bank = a["bank"].clone()
    rest = {k: v for k, v in a.items() if k != "bank"}
    ctx = on_kernels() if kernels else contextlib.nullcontext()
    with ctx:
        out = sdm_ops.sparse_delta_memory_(bank=bank, **rest, chunk_size=16)
    want_out, want_bank = ref.sdm_varlen_reference(
        **{k: v.cpu() for k, v in a.items()}, chunk_size=16
    )
    assert_close(out, want_out, rtol=1e-5, name="out")
    assert_close(bank, want_bank, rtol=1e-5, name="bank updated in place")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda cu: cu.add(1), "start at 0"),
        (lambda cu: torch.tensor([0, 9, 4, 20, 24], dtype=cu.dtype), "non-decreasing"),
        (lambda cu: torch.tensor([0, 3, 5, 8, 20], dtype=cu.dtype), "end at"),
        (lambda cu: cu.float(), "dtype int32 or int64"),
        (lambda cu: cu[None], "1 dimensions"),
        (lambda cu: cu[:1], "N \\+ 1 >= 2"),
    ],
)
def test_bad_cu_seqlens_raise_value_or_type_errors_naming_it(change, match):
    a = packed_inputs([3, 0, 18, 3], seed=10)
    a["cu_seqlens"] = change(a["cu_seqlens"])
    bank = a["bank"].clone()
    with pytest.raises(ValueError, match=match) as info:
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)
    assert "cu_seqlens" in str(info.value)
    assert torch.equal(bank, a["bank"])


def test_packed_batch_must_have_one_row_and_one_bank_per_sequence():
    a = packed_inputs([3, 5], seed=11)
    two_rows = {
        k: (torch.cat([v, v]) if k not in ("bank", "cu_seqlens") else v) for k, v in a.items()
    }
    with pytest.raises(ValueError, match="B = 2"):
        sdm_ops.sparse_delta_memory(**two_rows, output_final_state=True)
    with pytest.raises(ValueError, match=r"bank must have shape \[N, H, S, D\]"):
        sdm_ops.sparse_delta_memory(**dict(a, bank=a["bank"][:1]), output_final_state=True)


def test_cu_seqlens_on_another_device_is_rejected():
    a = packed_inputs([3, 5], seed=12)
    a["cu_seqlens"] = a["cu_seqlens"].to("meta")
    with pytest.raises(ValueError, match="cu_seqlens is on meta"):
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)


@pytest.mark.parametrize("offsets", [[0, 50, 10, 24], [-7, 3, 3, 99], [5, 4, 3, 2], [0, 24, 0, 24]])
def test_chunk_tables_stay_inside_the_batch_for_any_offsets(offsets):
    """Compiled code and CUDA graphs skip the checks of cu_seqlens: whatever it holds, every
    chunk of the tables lies within the T = 24 tokens and every slot within the table."""
    T, C = 24, 16
    chunks, seq_chunks = ref.varlen_chunks(torch.tensor(offsets), T, C)
    start, count = chunks[:, 0], chunks[:, 1]
    assert (start >= 0).all() and (count >= 0).all() and (count <= C).all()
    assert (start + count <= T).all(), chunks.tolist()
    assert (seq_chunks >= 0).all() and (seq_chunks <= chunks.shape[0]).all()
    assert (seq_chunks[1:] >= seq_chunks[:-1]).all()


@requires_kernels
@pytest.mark.parametrize(
    "offsets,T,C",
    [
        ([0, 0, 5, 21, 58, 59, 59, 79], 79, 16),  # LENGTHS: empty, short, exact, ...
        ([0, 79], 79, 64),
        ([0, 0], 0, 16),
        ([0, 3], 3, 128),
        ([0, 50, 10, 24], 24, 16),
        ([-7, 3, 3, 99], 24, 16),
        ([5, 4, 3, 2], 24, 16),
        ([0, 24, 0, 24], 24, 16),  # malformed: clamped as the reference
        (list(range(0, 301, 3)), 300, 16),  # 100 sequences: two steps of the walk
        (
            sorted(
                torch.randint(0, 4000, (150,), generator=torch.Generator().manual_seed(5)).tolist()
                + [0, 4000]
            ),
            4000,
            32,
        ),  # 150 slots per program and then some
    ],
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_chunk_tables_kernel_equals_the_reference(offsets, T, C, dtype):
    cu = torch.tensor(offsets, dtype=dtype)
    want_chunks, want_seq = ref.varlen_chunks(cu, T, C)
    with on_kernels():
        chunks, seq_chunks = sdm_ops.ops.varlen_chunks(cu.to(KERNEL_DEVICE), T, C)
    assert chunks.dtype == seq_chunks.dtype == torch.int64
    assert torch.equal(chunks.cpu(), want_chunks), (chunks.cpu() - want_chunks).abs().max()
    assert torch.equal(seq_chunks.cpu(), want_seq), (seq_chunks.cpu(), want_seq)


@requires_kernels
@pytest.mark.parametrize("W_, R_", [(0, 2), (3, 0)])
def test_kernels_bfloat16_and_no_write_or_no_read_entries_equal_each_sequence_alone(W_, R_):
    a = make_packed_sdm_inputs(
        [3, 18, 9], H, D, S, W_, R_, seed=14, dtype=torch.bfloat16, device=KERNEL_DEVICE
    )
    g_out, g_bank = grads_for(a, 16)
    with on_kernels():
        got = run_with_grads(sdm_ops.sparse_delta_memory, a, g_out, g_bank, chunk_size=16)
        want = run_with_grads(each_alone, a, g_out, g_bank, chunk_size=16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16
    assert_close(got[0], want[0], rtol=1e-2, name="out")
    assert_close(got[1], want[1], rtol=1e-2, name="bank")
    for k in got[2]:
        assert_close(got[2][k], want[2][k], rtol=1e-2, name=f"d{k}")


@requires_kernels
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_kernels_strided_cu_seqlens_equals_contiguous(dtype):
    """A strided view of valid offsets gives the same chunk tables, output, bank and gradients
    as the same offsets contiguous (the kernel reads cu_seqlens through its stride)."""
    a = packed_inputs([9, 0, 2, 0, 2, 11], device=KERNEL_DEVICE, seed=21, decay=True)
    every_other = torch.stack([a["cu_seqlens"], a["cu_seqlens"] + 100], 1).to(dtype)[:, 0]
    assert every_other.stride(0) == 2 and not every_other.is_contiguous()
    g_out, g_bank = grads_for(a, 22)
    T = a["v"].shape[1]
    with on_kernels():
        tables = sdm_ops.ops.varlen_chunks(every_other, T, 16)
        want_tables = sdm_ops.ops.varlen_chunks(every_other.contiguous(), T, 16)
        got = run_with_grads(
            sdm_ops.sparse_delta_memory,
            dict(a, cu_seqlens=every_other),
            g_out,
            g_bank,
            chunk_size=16,
        )
        want = run_with_grads(
            sdm_ops.sparse_delta_memory,
            dict(a, cu_seqlens=every_other.contiguous()),
            g_out,
            g_bank,
            chunk_size=16,
        )
        bank = a["bank"].clone()
        out_ = sdm_ops.sparse_delta_memory_(
            *sdm_positional(dict(a, bank=bank)),
            chunk_size=16,
            cu_seqlens=every_other,
        )
    for t, w in zip(tables, want_tables):
        assert torch.equal(t, w), (t, w)
    assert torch.equal(got[0], want[0]), "out differs with a strided cu_seqlens"
    assert torch.equal(got[1], want[1]), "bank differs with a strided cu_seqlens"
    for k in got[2]:
        assert torch.equal(got[2][k], want[2][k]), f"d{k} differs with a strided cu_seqlens"
    assert torch.equal(out_, want[0]) and torch.equal(bank, want[1]), "in place differs"
