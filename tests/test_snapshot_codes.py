"""The snapshot's codecs, code by code, on the kernels (natively on CUDA, under the interpreter
on CPU tensors): the forward's encoders (``kernels._snapshot.e4m3_bits`` and
``store_snapshot``) and the backward's decoder (``load_snapshot``) against the
documented storage (``reference.quantize_rows`` / ``dequantize_rows``, torch's
float8_e4m3fn), over every code each mode can hold.

Through gradients alone a decoder is checked only on the codes the data happens to produce:
groups of 16 columns of like magnitude almost never produce fp8's subnormal codes. Here each
decoder reads every code, and the encoders see every representable value, the ties between
neighbours and groups that mix magnitudes."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from sdm_ops import reference as ref
from sdm_ops.kernels._snapshot import SNAP_CODES, e4m3_bits, load_snapshot, store_snapshot
from tests.helpers import HAS_CUDA, KERNEL_DEVICE, on_kernels, requires_kernels

pytestmark = requires_kernels

GROUP = 16
# float8_e4m3fn's NaN codes: the encoders clamp to +-448 (0x7E, 0xFE) and never emit them.
FP8_NAN_CODES = (0x7F, 0xFF)


@triton.jit
def _decode_kernel(
    snap, snap_scale, out, D: tl.constexpr, BD: tl.constexpr, MODE: tl.constexpr, EP: tl.constexpr
):
    """Program (e, g) decodes group g of the EP entries e * EP, ..., e * EP + EP - 1."""
    c0 = tl.program_id(1) * BD
    ent = (tl.program_id(0) * EP + tl.arange(0, EP)).to(tl.int64)[None, :]  # [1, EP]
    ok = ent >= 0
    cols = c0 + tl.arange(0, BD)
    x = load_snapshot(snap, snap_scale, ent, ok, c0, cols, D, BD, MODE)
    tl.store(out + ent[:, :, None] * D + cols[None, None, :], x)


@triton.jit
def _encode_kernel(
    rows, snap, snap_scale, D: tl.constexpr, BD: tl.constexpr, MODE: tl.constexpr, EP: tl.constexpr
):
    """Program (e, g) encodes group g of the EP entries e * EP, ..., as the forward stores it."""
    c0 = tl.program_id(1) * BD
    ent = (tl.program_id(0) * EP + tl.arange(0, EP)).to(tl.int64)[None, :]
    ok = ent >= 0
    cols = c0 + tl.arange(0, BD)
    x = tl.load(rows + ent[:, :, None] * D + cols[None, None, :])
    store_snapshot(snap, snap_scale, ent, x, ok, c0, cols, D, BD, MODE)


@triton.jit
def _e4m3_kernel(x, bits, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(bits + i, e4m3_bits(tl.load(x + i)))


EP = 8  # entries a program


def _decode(codes: torch.Tensor, scale: torch.Tensor | None, mode: str, D: int) -> torch.Tensor:
    """The backward's decoder on ``codes`` [E, D] ([E, D / 2] for int4) with ``scale``
    [E, D / 16] (fp8, int4): float32 rows [E, D]."""
    E = codes.shape[0]
    assert E % EP == 0
    dev = KERNEL_DEVICE
    out = torch.full((E, D), float("nan"), device=dev)  # every element must be written
    sc = torch.zeros(1, device=dev) if scale is None else scale.to(dev).contiguous()
    with on_kernels():
        _decode_kernel[(E // EP, D // GROUP)](
            codes.to(dev).contiguous(), sc, out, D=D, BD=GROUP, MODE=SNAP_CODES[mode], EP=EP
        )
    return out.cpu()


def _encode(rows: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's encoder on float32 ``rows`` [E, D]: (codes, scales) as it stores them."""
    E, D = rows.shape
    dev = KERNEL_DEVICE
    if mode == "int4":
        snap = torch.zeros(E, D // 2, dtype=torch.uint8, device=dev)
    elif mode == "fp8":
        snap = torch.zeros(E, D, dtype=torch.uint8, device=dev)
    else:
        dtype = torch.float32 if mode == "none" else torch.bfloat16
        snap = torch.zeros(E, D, dtype=dtype, device=dev)
    scale = torch.zeros(E, D // GROUP, device=dev)
    with on_kernels():
        _encode_kernel[(E // EP, D // GROUP)](
            rows.to(dev).contiguous(), snap, scale, D=D, BD=GROUP, MODE=SNAP_CODES[mode], EP=EP
        )
    return snap.cpu(), scale.cpu()


def _scales(E: int, groups: int, seed: int) -> torch.Tensor:
    """Positive float32 group scales over many binades, 1 among them."""
    g = torch.Generator().manual_seed(seed)
    s = torch.exp2(torch.randint(-30, 20, (E, groups), generator=g).float())
    s = s * (1 + torch.rand(E, groups, generator=g))
    s[0] = 1.0
    return s


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str, codes=None) -> None:
    same = (got == want) | (got.isnan() & want.isnan())
    same &= torch.signbit(got) == torch.signbit(want)  # -0 is not +0
    if not bool(same.all()):
        i = tuple(int(j) for j in (~same).nonzero()[0])
        code = "" if codes is None else f" (code {int(codes.reshape(got.shape)[i]):#04x})"
        raise AssertionError(
            f"{what}: {int((~same).sum())} of {got.numel()} differ; at {list(i)}{code} got "
            f"{got[i].item()!r}, want {want[i].item()!r}"
        )


def test_fp8_decoder_reads_every_code_as_float8_e4m3fn_times_its_scale():
    """Every e4m3 code (subnormals, both zeros, the largest normals; not the two NaN codes
    the encoder never stores), times its group's scale: bitwise what torch's float8_e4m3fn
    gives, scaled in float32."""
    codes = torch.tensor([c for c in range(256) if c not in FP8_NAN_CODES], dtype=torch.uint8)
    codes = torch.cat([codes, codes[: 256 - codes.numel()]])  # 256 codes, 2 repeated
    codes = codes.view(16, 16).repeat(2, 2)  # [32 entries, 32 columns]: every code in each group
    scale = _scales(32, 2, seed=1)
    want = ref.dequantize_rows(codes, scale, "fp8")
    _assert_bitwise(_decode(codes, scale, "fp8", 32), want, "fp8 decode", codes)
    # The subnormal codes alone (exponent field 0): mantissa m reads as m 2^-9.
    sub = torch.tensor([m | sign for sign in (0, 0x80) for m in range(8)], dtype=torch.uint8)
    got = _decode(sub.view(1, 16).repeat(EP, 1), torch.ones(EP, 1), "fp8", 16)[0]
    want = torch.tensor([m * 2.0**-9 for m in range(8)] * 2) * torch.tensor([1.0] * 8 + [-1.0] * 8)
    _assert_bitwise(got, want, "fp8 subnormal codes")


def test_int4_decoder_reads_every_byte_as_two_codes_minus_8_times_its_scale():
    """Every byte: the low nibble is the even column, the high nibble the odd one, each minus
    8, times the group's scale."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)  # [16, 32 columns]
    codes = torch.cat([codes, codes.flip(0)])
    scale = _scales(32, 2, seed=2)
    want = ref.dequantize_rows(codes, scale, "int4")
    _assert_bitwise(_decode(codes, scale, "int4", 32), want, "int4 decode")


@pytest.mark.parametrize("mode", ["none", "bf16"])
def test_plain_decoders_read_every_bfloat16_pattern_or_float32_value_unchanged(mode):
    """bf16: every one of the 65536 bfloat16 bit patterns (NaNs, infinities, subnormals, both
    zeros) widened to float32 exactly; none: float32 values as they are. (Triton's
    interpreter flushes bfloat16 subnormals to zero when it widens them; the GPU does not, so
    on the CPU the subnormal patterns are left out.)"""
    if mode == "bf16":
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32)
        if not HAS_CUDA:
            bits = bits[((bits & 0x7F80) != 0) | ((bits & 0x7F) == 0)]
            bits = bits[: bits.numel() // (16 * EP) * 16 * EP]
        rows = bits.to(torch.int16).view(torch.bfloat16).view(-1, 16)
    else:
        g = torch.Generator().manual_seed(3)
        rows = torch.randn(64, 16, generator=g) * torch.exp2(torch.randint(-126, 127, (64, 16)))
        rows[0, :4] = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    _assert_bitwise(_decode(rows, None, mode, 16), rows.float(), f"{mode} decode")


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties), and one float32 step
    either side of each midpoint, both signs."""
    vals = torch.tensor([c for c in range(0x7F)], dtype=torch.uint8).view(torch.float8_e4m3fn)
    vals = vals.float()  # 0 .. 448 ascending
    mid = (vals[1:] + vals[:-1]) / 2  # exact in float32
    near = torch.cat([torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    x = torch.cat([vals, mid, near])
    return torch.cat([x, -x])


def test_e4m3_encoder_rounds_to_nearest_even_as_float8_e4m3fn_does():
    """``e4m3_bits`` on every e4m3 value, every tie and its neighbours and random values of
    [-448, 448] across the binades (subnormals included): the bits torch's conversion to
    float8_e4m3fn gives."""
    g = torch.Generator().manual_seed(4)
    rnd = (torch.rand(4096, generator=g) * 2 - 1) * torch.exp2(
        -torch.randint(0, 24, (4096,), generator=g).float()
    )
    x = torch.cat([_e4m3_grid(), rnd * 448])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 256)])
    bits = torch.zeros(x.numel(), dtype=torch.int32, device=KERNEL_DEVICE)
    with on_kernels():
        _e4m3_kernel[(x.numel() // 256,)](x.to(KERNEL_DEVICE), bits, BLOCK=256)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    got = bits.cpu()
    bad = got != want
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} values encode wrongly; {x[i].item()!r} -> {int(got[i]):#04x}, "
            f"want {int(want[i]):#04x}"
        )


def _unpacked(codes: torch.Tensor, mode: str) -> torch.Tensor:
    """One code an element: int4's two nibbles a byte apart, fp8's bytes as they are."""
    if mode != "int4":
        return codes
    return torch.stack((codes & 15, codes >> 4), -1).flatten(-2)


def _mixed_groups(E: int, D: int, seed: int) -> torch.Tensor:
    """Rows whose groups of 16 columns mix magnitudes over 2^-20 .. 2^4 of the group's
    largest, so that fp8 codes fall in the subnormals and int4 codes on every step; some
    groups all zero, some exact ties of int4's rounding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(E, D, generator=g) * torch.exp2(-torch.randint(0, 24, (E, D), generator=g))
    x = x.float()
    x[1] = 0.0  # a group of zeros gets scale 1
    # int4 ties: value k + 1/2 steps of a group whose largest is 7 steps (scale 1).
    x[2, :GROUP] = torch.tensor([7.0, -7.0, 0.5, -0.5, 1.5, -1.5, 2.5, 3.5] + [0.0] * 8)
    return x


@pytest.mark.parametrize("mode", ["none", "bf16", "fp8", "int4"])
def test_encoder_stores_what_the_documented_quantization_gives_on_mixed_groups(mode):
    """The forward's snapshot store on groups that mix magnitudes: the codes and scales of
    ``reference.quantize_rows``, bitwise under the interpreter and within the GPU's float32
    division on CUDA (bf16: rounded to nearest even on the GPU, truncated under the
    interpreter, which stores bfloat16 so), and the decoder gives back the documented rows
    from them."""
    rows = _mixed_groups(64, 32, seed=5)
    codes, scale = _encode(rows, mode)
    want_codes, want_scale = ref.quantize_rows(rows, mode)
    if mode == "bf16" and not HAS_CUDA:
        # Triton's interpreter truncates to bfloat16 where the GPU rounds to nearest even.
        want_codes = (rows.view(torch.int32) & -(2**16)).view(torch.float32)
    if mode in ("none", "bf16"):
        _assert_bitwise(codes.float(), want_codes.float(), f"{mode} store")
        return
    if HAS_CUDA:
        # The GPU's float32 division is within 2 ulp of the correctly rounded quotient
        # (reference.quantize_rows): scales within that, and each code that of the stored
        # scale's quotient or of the quotient moved by that much.
        ulp = torch.nextafter(want_scale, torch.full_like(want_scale, float("inf"))) - want_scale
        off = (scale - want_scale).abs()
        assert bool((off <= 2 * ulp).all()), f"{mode} scales: {float((off / ulp).max())} ulp off"
        allowed = [
            _unpacked(ref.quantize_rows(rows, mode, scale=scale * f)[0], mode)
            for f in (1 - 2**-22, 1.0, 1 + 2**-22)
        ]
        got = _unpacked(codes, mode)
        ok = torch.stack([got == a for a in allowed]).any(0)
        assert bool(ok.all()), f"{mode} codes: {int((~ok).sum())} beyond the division's error"
        assert int((got != allowed[1]).sum()) <= 4, f"{mode} codes: many off the stored scale's"
    else:  # the interpreter divides as torch does
        _assert_bitwise(scale, want_scale, f"{mode} scales")
        assert torch.equal(codes, want_codes.view(codes.shape)), f"{mode} codes"
    back = _decode(codes, scale, mode, 32)
    _assert_bitwise(back, ref.dequantize_rows(codes, scale, mode), f"{mode} round trip")
    # fp8 in the subnormals actually occurred (the point of mixing magnitudes).
    if mode == "fp8":
        assert bool(((codes & 0x78) == 0).logical_and((codes & 7) != 0).any())
