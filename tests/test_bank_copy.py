"""The bank copy (``sdm_internal::bank_copy`` and the kernel the forward and backward launch for
their fresh states): bitwise the source, per stream or from a shared bank, bfloat16 widened to
float32, special values kept, nothing written outside the destination; the forward's copy of
the rows no chunk writes and the table it reads (``first_writes``), which are no operators of
their own. The opcheck of ``sdm_internal::bank_copy`` lives in test_opcheck.py with the other
operators'."""

import itertools

import pytest
import torch

from sdm_ops import ops
from sdm_ops import reference as ref
from sdm_ops.kernels import bank_copy as kernel
from tests.helpers import KERNEL_DEVICE, on_kernels, requires_kernels

B, H, S, D = 3, 2, 37, 16  # 1184 elements a bank: 18.5 blocks of 64


def _bank(shape, dtype, seed, subnormal=True):
    """Random normals led by NaN, infinities, -0.0 and (``subnormal``) a subnormal number."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    special = [float("nan"), float("inf"), -float("inf"), -0.0] + [1e-40] * subnormal
    x.view(-1)[: len(special)] = torch.tensor(special).to(dtype)
    return x.to(KERNEL_DEVICE)


def _assert_same_bits(actual, expected, name):
    bits = torch.int32 if expected.dtype == torch.float32 else torch.int16
    a, e = actual.cpu().view(bits), expected.cpu().view(bits)
    differ = (a != e).nonzero()
    assert not len(differ), (
        f"{name}: {len(differ)} elements differ, first at "
        f"{tuple(differ[0].tolist())}: {actual.cpu()[tuple(differ[0])]} "
        f"against {expected.cpu()[tuple(differ[0])]}"
    )


@requires_kernels
@pytest.mark.parametrize(
    "programs", [0, 3, 40], ids=["block_a_program", "3_programs", "more_programs_than_blocks"]
)
@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
@pytest.mark.parametrize(
    "src_dtype,dst_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_kernel_copies_every_bank_bitwise_and_nothing_else(
    monkeypatch, shared, src_dtype, dst_dtype, programs
):
    monkeypatch.setattr(kernel, "BLOCK", 64)  # several blocks a bank, the last partial
    monkeypatch.setattr(kernel, "BOUNDED_BLOCK", 64)
    # Under the interpreter (numpy) a bfloat16 subnormal widens to the wrong float32; the GPU's
    # conversion is exact. So the widening case draws none.
    src = _bank(
        (H, S, D) if shared else (B, H, S, D),
        src_dtype,
        seed=1 + shared,
        subnormal=src_dtype == dst_dtype,
    )
    pad = 100
    buf = torch.full((2 * pad + B * H * S * D,), 7.0, dtype=dst_dtype, device=KERNEL_DEVICE)
    dst = buf[pad : pad + B * H * S * D].view(B, H, S, D)
    with on_kernels():
        kernel.bank_copy(src, dst, programs)  # 3: each program walks 6 or 7 blocks
    want = src.expand(B, H, S, D).to(dst_dtype)
    _assert_same_bits(dst, want, "copy")
    outside = torch.cat([buf[:pad], buf[-pad:]]).cpu()
    assert (outside == 7.0).all(), "the kernel wrote outside the destination"


@requires_kernels
@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
@pytest.mark.parametrize("programs", [0, 2])
def test_operator_returns_a_fresh_contiguous_copy_like_the_cpu_path(shared, programs):
    bank = _bank((H, S, D) if shared else (B, H, S, D), torch.float32, seed=3)
    with on_kernels():
        out = ops.bank_copy(bank, B, programs)
    want = ops.bank_copy(bank.cpu(), B)
    assert out.shape == (B, H, S, D) and out.is_contiguous()
    assert out.data_ptr() != bank.data_ptr()
    _assert_same_bits(out, want, "operator against the CPU path")
    out.zero_()
    _assert_same_bits(bank, _bank(bank.shape, torch.float32, seed=3), "source after the copy")


def _first_by_loops(write_idx, S, C):
    """The ``first`` table of a dense batch by plain loops: an oracle sharing no code with the
    reference or the kernel."""
    Bn, T, Hn, W = write_idx.shape
    first = [[kernel.UNWRITTEN] * S for _ in range(Bn * Hn)]
    for b, t, h, w in itertools.product(range(Bn), range(T), range(Hn), range(W)):
        s = int(write_idx[b, t, h, w])
        if 0 <= s < S:
            first[b * Hn + h][s] = min(first[b * Hn + h][s], t // C)
    return torch.tensor(first, dtype=torch.int32)


@requires_kernels
@pytest.mark.parametrize("C", [16, 32])
def test_first_writes_holds_each_slots_first_writing_chunk(C):
    """Padding, indices below -1 and past S, duplicate slots, a partial last chunk and slots
    no chunk writes (S = 60; the entries name slots -3 to 44 and 60 to 69)."""
    g = torch.Generator().manual_seed(7 + C)
    write_idx = torch.randint(-3, 45, (2, 70, 3, 5), generator=g)
    write_idx[torch.rand(write_idx.shape, generator=g) < 0.1] = 65
    want = _first_by_loops(write_idx, 60, C)
    assert (want == kernel.UNWRITTEN).any() and (want > 0).any() and (want < kernel.UNWRITTEN).any()
    got = torch.zeros(6, 60, dtype=torch.int32, device=KERNEL_DEVICE)
    with on_kernels():
        kernel.first_writes(write_idx.to(KERNEL_DEVICE), C, None, None, got)
    assert torch.equal(got.cpu(), want)


@requires_kernels
def test_first_writes_of_a_packed_batch_numbers_chunk_slots_per_sequence():
    """Sequences of 0, 21, 5 and 40 tokens (chunk 16): each stream's table holds its own
    sequence's chunk slots; the empty sequence's table is all UNWRITTEN."""
    lengths, C, S, Hn = [0, 21, 5, 40], 16, 30, 2
    g = torch.Generator().manual_seed(9)
    T = sum(lengths)
    write_idx = torch.randint(-1, S, (1, T, Hn, 4), generator=g)
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
    chunks, seq_chunks = ops.varlen_chunks(cu, T, C)
    want = torch.full((len(lengths) * Hn, S), kernel.UNWRITTEN, dtype=torch.int32)
    for n, (t0, length, c0, _) in enumerate(ref.varlen_sequences(chunks, seq_chunks)):
        seq = _first_by_loops(write_idx[:, t0 : t0 + length], S, C)
        want[n * Hn : (n + 1) * Hn] = torch.where(seq == kernel.UNWRITTEN, seq, seq + c0)
    got = torch.zeros(len(lengths) * Hn, S, dtype=torch.int32, device=KERNEL_DEVICE)
    with on_kernels():
        dev = [t.to(KERNEL_DEVICE) for t in (write_idx, chunks, seq_chunks)]
        kernel.first_writes(dev[0], C, dev[1], dev[2], got)
    assert (want[:Hn] == kernel.UNWRITTEN).all()
    assert torch.equal(got.cpu(), want)


@requires_kernels
@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
def test_unwritten_copy_copies_only_the_rows_no_chunk_writes(monkeypatch, shared):
    monkeypatch.setattr(kernel, "BLOCK", 64)
    src = _bank((H, S, D) if shared else (B, H, S, D), torch.float32, seed=5 + shared)
    g = torch.Generator().manual_seed(6)
    first = torch.randint(0, 4, (B * H, S), generator=g, dtype=torch.int32)
    first[torch.rand(B * H, S, generator=g) < 0.5] = kernel.UNWRITTEN
    first = first.to(KERNEL_DEVICE)
    pad = 100
    buf = torch.full((2 * pad + B * H * S * D,), 7.0, device=KERNEL_DEVICE)
    dst = buf[pad : pad + B * H * S * D].view(B, H, S, D)
    with on_kernels():
        kernel.bank_copy_unwritten(src, dst, first)
    copied = (first == kernel.UNWRITTEN).view(B, H, S, 1).cpu()
    want = torch.where(copied, src.cpu().expand(B, H, S, D), 7.0)
    _assert_same_bits(dst, want, "partial copy")
    outside = torch.cat([buf[:pad], buf[-pad:]]).cpu()
    assert (outside == 7.0).all(), "the kernel wrote outside the destination"
