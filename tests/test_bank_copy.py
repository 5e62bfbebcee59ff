"""The bank copy (``sdm::bank_copy`` and the kernel the forward and backward launch for their
fresh states): bitwise the source, per stream or from a shared bank, bfloat16 widened to
float32, special values kept, nothing written outside the destination. Its opcheck lives in
test_opcheck.py with the other operators'."""

import pytest
import torch

from sdm_ops import ops
from sdm_ops.kernels import bank_copy as kernel
from tests.helpers import KERNEL_DEVICE, on_kernels, requires_kernels

B, H, S, D = 3, 2, 37, 16       # 1184 elements a bank: 18.5 blocks of 64


def _bank(shape, dtype, seed, subnormal=True):
    """Random normals led by NaN, infinities, -0.0 and (``subnormal``) a subnormal number."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    special = [float("nan"), float("inf"), -float("inf"), -0.0] + [1e-40] * subnormal
    x.view(-1)[:len(special)] = torch.tensor(special).to(dtype)
    return x.to(KERNEL_DEVICE)


def _assert_same_bits(actual, expected, name):
    bits = torch.int32 if expected.dtype == torch.float32 else torch.int16
    a, e = actual.cpu().view(bits), expected.cpu().view(bits)
    differ = (a != e).nonzero()
    assert not len(differ), (f"{name}: {len(differ)} elements differ, first at "
                             f"{tuple(differ[0].tolist())}: {actual.cpu()[tuple(differ[0])]} "
                             f"against {expected.cpu()[tuple(differ[0])]}")


@requires_kernels
@pytest.mark.parametrize("programs", [0, 3, 40], ids=["block_a_program", "3_programs",
                                                      "more_programs_than_blocks"])
@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32)])
def test_kernel_copies_every_bank_bitwise_and_nothing_else(monkeypatch, shared, src_dtype,
                                                           dst_dtype, programs):
    monkeypatch.setattr(kernel, "BLOCK", 64)       # several blocks a bank, the last partial
    monkeypatch.setattr(kernel, "BOUNDED_BLOCK", 64)
    # Under the interpreter (numpy) a bfloat16 subnormal widens to the wrong float32; the GPU's
    # conversion is exact. So the widening case draws none.
    src = _bank((H, S, D) if shared else (B, H, S, D), src_dtype, seed=1 + shared,
                subnormal=src_dtype == dst_dtype)
    pad = 100
    buf = torch.full((2 * pad + B * H * S * D,), 7.0, dtype=dst_dtype, device=KERNEL_DEVICE)
    dst = buf[pad:pad + B * H * S * D].view(B, H, S, D)
    with on_kernels():
        kernel.bank_copy(src, dst, programs)      # 3: each program walks 6 or 7 blocks
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
