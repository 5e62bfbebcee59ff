"""The forward of the recurrence: kernels (natively on CUDA, under the interpreter on CPU)
against the float64 token-by-token oracle (``tests/oracle.py``), the public functions'
contracts, and determinism. ``tests/test_oracle.py`` holds the oracle tests at every chunk
size, in bfloat16 and with quantized snapshots."""

import pytest
import torch

import sdm_ops
from sdm_ops import ops
from sdm_ops.kernels import bank_copy, recurrence_fwd
from sdm_ops.ops.recurrence import _chunk_betas
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_sdm_inputs,
    on_kernels,
    requires_cuda,
    requires_kernels,
)
from tests.oracle import float64_args, sdm_oracle

pytestmark = requires_kernels


def _oracle(a):
    """(out, final state) of the float64 token-by-token oracle."""
    return sdm_oracle(float64_args(a))[:2]


def _run(a, **kw):
    with on_kernels(), torch.no_grad():
        return sdm_ops.sparse_delta_memory(**a, **kw, output_final_state=True)


def _inputs(**kw):
    return make_sdm_inputs(device=KERNEL_DEVICE, **kw)


@pytest.mark.parametrize("chunk_size,decay", [(16, True), (32, False)])
def test_tiled_phase2_matches_the_oracle_with_padding_duplicates_and_partial_chunks(
    chunk_size, decay, monkeypatch
):
    """Phase 2 in steps over tiles of two tokens (what large W or C take), both forward paths:
    without autograd (phase 2 in place on a copy of the bank, no snapshot) and with it (the
    functional operator, which keeps a snapshot). The one-tile path, which the tests' small W
    take, is ``tests/test_oracle.py``'s."""
    monkeypatch.setattr(recurrence_fwd, "_TILE", 128)
    a = _inputs(T=37, decay=decay, seed=chunk_size + decay)
    out_r, bank_r = _oracle(a)
    for grad in (False, True):
        b = dict(a, v=a["v"].clone().requires_grad_(grad))
        with on_kernels():
            out, bank = sdm_ops.sparse_delta_memory(
                **b, chunk_size=chunk_size, output_final_state=True
            )
        assert out.requires_grad == grad
        assert_close(out, out_r, rtol=1e-5, name=f"out (grad {grad})")
        assert_close(bank, bank_r, rtol=1e-5, name=f"bank (grad {grad})")


def test_a_geometry_without_phase_1s_sparse_path_matches_the_oracle():
    """W = 17 at chunk 64 has more entry positions a chunk than phase 1's sparse path takes
    (``layout.pair_positions`` 0: pair lists of no positions), so the dense kernels and the
    WY solve's panels take every chunk, with and without autograd."""
    from sdm_ops.layout import pair_positions

    assert pair_positions(17, 2, 64) == 0
    a = _inputs(B=1, T=40, H=1, D=16, S=300, W=17, R=2, seed=17)
    out_r, bank_r = _oracle(a)
    for grad in (False, True):
        b = dict(a, v=a["v"].clone().requires_grad_(grad))
        with on_kernels():
            out, bank = sdm_ops.sparse_delta_memory(**b, chunk_size=64, output_final_state=True)
        assert_close(out, out_r, rtol=1e-5, name=f"out (grad {grad})")
        assert_close(bank, bank_r, rtol=1e-5, name=f"bank (grad {grad})")
        if grad:
            (dv,) = torch.autograd.grad(out.sum(), b["v"])
            assert dv.isfinite().all() and dv.abs().sum() > 0


def test_kernels_match_reference_shared_bank_int32_indices_and_wide_rows():
    a = _inputs(T=20, D=32, S=9, W=5, R=3, shared=True, index_dtype=torch.int32, seed=5)
    out, bank = _run(a, chunk_size=16)
    out_r, bank_r = _oracle(a)
    assert bank.shape == (2, 2, 9, 32)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


def test_decays_of_exactly_zero_and_one_everywhere():
    a = _inputs(T=18, seed=6, zero_decay=0.5, one_decay=0.5)
    assert ((a["decay"] == 0) | (a["decay"] == 1)).all()
    out, bank = _run(a)
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


def test_every_entry_on_one_slot_serializes_the_writes():
    a = _inputs(T=20, S=1, W=3, R=2, seed=8, padding=0.0)
    out, bank = _run(a)
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


def test_no_write_or_no_read_entries():
    for W, R in ((0, 2), (2, 0)):
        a = _inputs(T=17, W=W, R=R, seed=9)
        out, bank = _run(a)
        out_r, bank_r = _oracle(a)
        assert_close(out, out_r, rtol=1e-5, name=f"out W={W} R={R}")
        assert_close(bank, bank_r, rtol=1e-5, name=f"bank W={W} R={R}")


def test_empty_sequence_copies_the_bank():
    a = _inputs(T=0, shared=True)
    out, bank = _run(a)
    assert out.shape == (2, 0, 2, 16)
    assert torch.equal(bank, a["bank"].expand(2, *a["bank"].shape))


def test_input_bank_is_never_modified():
    a = _inputs(T=20, seed=13)
    before = a["bank"].clone()
    _run(a)
    assert torch.equal(a["bank"], before)


def test_in_place_update_equals_functional_result():
    a = _inputs(T=21, seed=14)
    out, bank = _run(a, chunk_size=32)
    b = {k: v for k, v in a.items() if k != "bank"}
    state = a["bank"].clone()
    with on_kernels():
        out2 = sdm_ops.sparse_delta_memory_(bank=state, **b, chunk_size=32)
    assert_close(out2, out, rtol=1e-6, name="out")
    assert_close(state, bank, rtol=1e-6, name="bank")


@pytest.mark.parametrize("chunk_size,D,W", [(64, 128, 3), (32, 256, 3), (128, 64, 2)])
def test_in_place_forward_forms_out_in_column_steps_for_wide_rows_and_long_chunks(chunk_size, D, W):
    """The forwards without a snapshot form out after phase 2's walk, one chunk's columns in
    several steps when D or the chunk is large (``recurrence_fwd``'s out kernel); these shapes
    take those steps on the one-tile path (few entries a token), with a partial last chunk."""
    a = _inputs(B=1, T=chunk_size + 7, H=2, D=D, W=W, R=2, seed=D + chunk_size)
    out_r, bank_r = _oracle(a)
    state = a["bank"].clone()
    with on_kernels():
        out = sdm_ops.sparse_delta_memory_(
            bank=state, **{k: v for k, v in a.items() if k != "bank"}, chunk_size=chunk_size
        )
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(state, bank_r, rtol=1e-5, name="bank")


@pytest.mark.parametrize("sms", [0, 1000])
def test_forwards_without_a_snapshot_form_out_in_the_walk_or_after_it(sms, monkeypatch):
    """Where the walk's programs are no more than the SMs (and the bank is float32) it forms out
    itself, else ``_out_kernel`` does (``walk_forms_out``, here with ``sms`` SMs): the in-place
    and inference forwards give the oracle's result both ways, with a partial last chunk and
    duplicate slots."""
    from sdm_ops.kernels import recurrence_fwd as kf

    monkeypatch.setattr(kf, "_WALK_SMS", sms)
    device = torch.device(KERNEL_DEVICE)
    assert kf.walk_forms_out(4, 32, torch.float32, device) == (sms > 0)
    assert not kf.walk_forms_out(4, 32, torch.bfloat16, device)  # a bfloat16 bank: after
    a = _inputs(B=2, T=45, H=2, D=32, W=4, R=3, S=12, seed=37 + sms)
    out_r, bank_r = _oracle(a)
    state = a["bank"].clone()
    with on_kernels():
        out = sdm_ops.sparse_delta_memory_(
            bank=state, **{k: v for k, v in a.items() if k != "bank"}, chunk_size=16
        )
        with torch.no_grad():
            out_f, bank_f = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
    for name, got, want in (
        ("out", out, out_r),
        ("bank", state, bank_r),
        ("inference out", out_f, out_r),
        ("inference bank", bank_f, bank_r),
    ):
        assert_close(got, want, rtol=1e-5, name=name)


@pytest.mark.parametrize("bank_dtype", [torch.float32, torch.bfloat16])
def test_capped_walks_give_the_uncapped_results(bank_dtype, monkeypatch):
    """Where the walk's programs outnumber the SMs, the functional forwards' walks run capped
    at one wave, and the capped training walk (over a bfloat16 bank) leaves out to
    ``_out_kernel`` (``walk_capped``); the in-place walk and the training walk over a float32
    bank are never capped. With 0 SMs (capped) and 1000 (not), the final bank and every
    gradient are bitwise equal, and out equal to float32 rounding (tf32x3 after the walk, a
    full float32 dot in it)."""
    from sdm_ops.kernels import recurrence_fwd as kf

    device = torch.device(KERNEL_DEVICE)
    a = _inputs(B=2, T=45, H=2, D=32, W=4, R=3, S=12, bank_dtype=bank_dtype, seed=41)
    names = ("v", "beta", "write_w", "read_w", "bank", "decay")
    g_out = torch.randn(a["v"].shape, generator=torch.Generator().manual_seed(1)).to(device)
    real = kf.wrap_triton
    runs = {}
    for sms in (0, 1000):
        monkeypatch.setattr(kf, "_WALK_SMS", sms)
        many = sms == 0  # 4 streams of 32 columns: 8 programs
        bf16 = bank_dtype == torch.bfloat16
        assert kf.walk_capped(4, 32, "none", True, bank_dtype, device) == (many and bf16)
        assert kf.walk_capped(4, 32, None, True, bank_dtype, device) == many
        assert not kf.walk_capped(4, 32, None, False, bank_dtype, device)  # in place
        launched = []
        monkeypatch.setattr(kf, "wrap_triton", lambda k: launched.append(k) or real(k))
        leaves = {k: a[k].detach().clone().requires_grad_() for k in names}
        with on_kernels():
            out, bank = sdm_ops.sparse_delta_memory(
                **{**a, **leaves}, chunk_size=16, output_final_state=True
            )
            loss = (out.float() * g_out).sum() + (bank.float() * 0.5).sum()
            grads = torch.autograd.grad(loss, list(leaves.values()))
        assert (kf._capped_walk in launched) == (many and bf16)
        assert (kf._out_kernel in launched) == (many and bf16)
        runs[sms] = out.detach(), bank.detach(), grads
    (out0, bank0, g0), (out1, bank1, g1) = runs[0], runs[1000]
    assert torch.equal(bank0, bank1), "bank"
    for name, x, y in zip(names, g0, g1):
        assert torch.equal(x, y), f"d {name}"
    assert_close(out0, out1, rtol=1e-5, name="out")


def test_decode_steps_one_token_at_a_time_equal_the_whole_sequence():
    a = _inputs(B=1, T=6, seed=15)
    out, bank = _run(a)
    state = a["bank"].clone()
    outs = []
    with on_kernels():
        for t in range(6):
            step = {k: v[:, t : t + 1] for k, v in a.items() if k != "bank"}
            outs.append(sdm_ops.sparse_delta_memory_(bank=state, **step))
    assert_close(torch.cat(outs, 1), out, rtol=1e-5, name="out")
    assert_close(state, bank, rtol=1e-5, name="bank")


def test_out_of_range_indices_are_rejected_in_eager_mode_with_strict_checks():
    """Strict checks reject them on any device (the CPU checks without them too; a GPU by
    default reads no data: tests/test_strict_checks.py)."""
    a = _inputs(T=5)
    for name, bad in (("write_idx", 11), ("read_idx", -2)):
        b = dict(a)
        b[name] = a[name].clone()
        b[name][1, 2, 0, 0] = bad
        with pytest.raises(ValueError, match=name), sdm_ops.strict_checks():
            _run(b)


def _phase1(x, C):
    """Phase 1 of ``x`` at chunk size ``C`` through the operators, and what phase 2 takes
    before it: ``(v, beta, write_idx, read_idx)``, ``chunk_prepare``'s outputs, and the WY
    solve's X and QX in the shape of A [B, H, N, C, C]."""
    S = x["bank"].shape[-2]
    prep = ops.chunk_prepare(
        x["write_idx"], x["write_w"], x["read_idx"], x["read_w"], x["decay"], S, C
    )
    X, QX = ops.wy_solve(prep[0].view(-1, C, C), _chunk_betas(x["beta"], C), prep[1].view(-1, C, C))
    lead = (x["v"], x["beta"], x["write_idx"], x["read_idx"])
    return lead, prep, X.view(prep[0].shape), QX.view(prep[0].shape)


def test_kernels_mask_out_of_range_indices_as_padding():
    """The operators (what compiled and captured code runs) never touch rows outside [0, S):
    an out-of-range index behaves exactly like -1."""
    a = _inputs(T=19, seed=17)
    S, C = a["bank"].shape[-2], 16
    clean = {k: v.clone() for k, v in a.items()}
    for name, bad in (("write_idx", S), ("write_idx", -7), ("read_idx", 10**6)):
        a[name][0, 3, 1, 0] = bad
        clean[name][0, 3, 1, 0] = -1

    def run_ops(x):
        with on_kernels(), torch.no_grad():
            lead, prep, X, QX = _phase1(x, C)
            return ops.recurrence_fwd(*lead, *prep[2:8], X, QX, x["bank"], "none")[:2]

    bank = a["bank"].clone()
    out, new_bank = run_ops(a)
    out_c, bank_c = run_ops(clean)
    assert torch.equal(out, out_c) and torch.equal(new_bank, bank_c)
    assert torch.equal(a["bank"], bank)


@pytest.mark.parametrize("shared", [False, True], ids=["per_stream", "shared"])
def test_phase2_from_a_source_bank_reads_no_row_of_the_bank_it_writes(shared, phase2_tiles):
    """Phase 2's kernel with a source bank (how the functional operator runs it): every row some
    chunk writes starts as NaN in the updated bank, so a single read of it before its stream's
    first write would carry NaN into out and the bank; the rows no chunk writes keep their
    (other) values, bitwise; out and the written rows equal the float64 reference run from the
    source."""
    a = _inputs(T=37, S=20, seed=21, shared=shared)
    S, C = a["bank"].shape[-2], 16
    with on_kernels(), torch.no_grad():
        lead, prep, X, QX = _phase1(a, C)
        first = torch.zeros(4, S, dtype=torch.int32, device=KERNEL_DEVICE)
        bank_copy.first_writes(a["write_idx"], C, None, None, first)
        written = (first != bank_copy.UNWRITTEN).view(2, 2, S, 1)
        assert written.any() and not written.all()
        other = torch.randn(2, 2, S, 16, generator=torch.Generator().manual_seed(3))
        bank = torch.where(written.cpu(), float("nan"), other).to(KERNEL_DEVICE)
        out = torch.empty_like(a["v"])
        recurrence_fwd.recurrence_fwd(
            *lead,
            *prep[2:7],
            X,
            QX,
            bank,
            out,
            None,
            None,
            None,
            None,
            None,
            source=a["bank"],
            first=first,
        )
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(
        torch.where(written, bank, 0.0),
        torch.where(written.cpu(), bank_r, 0.0),
        rtol=1e-5,
        name="written rows",
    )
    assert torch.equal(
        torch.where(written, 0.0, bank).cpu(), torch.where(written.cpu(), 0.0, other)
    )


@requires_cuda
def test_large_shapes_match_reference_on_cuda():
    a = make_sdm_inputs(B=2, T=300, H=4, D=64, S=4096, W=8, R=8, device="cuda", seed=18)
    out, bank = _run(a, chunk_size=64)
    out_r, bank_r = _oracle(a)
    assert_close(out, out_r, rtol=1e-5, name="out")
    assert_close(bank, bank_r, rtol=1e-5, name="bank")


@requires_cuda
@pytest.mark.parametrize("chunk_size", [64, 128])
def test_forward_is_bitwise_deterministic_on_cuda(chunk_size):
    a = make_sdm_inputs(B=4, T=1000, H=4, D=64, S=512, W=8, R=8, device="cuda", seed=19)
    first = _run(a, chunk_size=chunk_size)
    second = _run(a, chunk_size=chunk_size)
    assert torch.equal(first.out, second.out) and torch.equal(first.bank, second.bank)


@requires_cuda
def test_bank_of_more_than_2_pow_31_elements_on_cuda():
    """64-bit bank offsets: a [1, 2, 2^20 + 7, 1024 ...] bank is too large for a test; use
    B * H * S * D = 2 * 4 * 2^20 * 256 = 2^31 elements plus one stream's worth."""
    B, H, S, D, T = 1, 9, 2**20, 256, 20
    g = torch.Generator(device="cuda").manual_seed(20)
    bank = torch.randn(B, H, S, D, device="cuda", generator=g)
    a = make_sdm_inputs(B=B, T=T, H=H, D=D, S=S, W=4, R=4, device="cuda", seed=20)
    a["bank"] = bank
    # Steer the last stream to the highest slots, past element 2^31.
    a["write_idx"][:, :, -1] = S - 1 - a["write_idx"][:, :, -1].clamp(min=0) % 8
    a["read_idx"][:, :, -1] = S - 1 - a["read_idx"][:, :, -1].clamp(min=0) % 8
    out, new_bank = _run(a)
    slots = torch.arange(S - 8, S, device="cuda")
    small = dict(a, bank=bank[:, -1:, S - 8 :].clone())
    for k in ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay"):
        small[k] = a[k][:, :, -1:].clone()
    small["write_idx"] = small["write_idx"] - (S - 8)
    small["read_idx"] = small["read_idx"] - (S - 8)
    out_r, bank_r = _oracle(small)
    assert_close(out[:, :, -1:], out_r, rtol=1e-5, name="out of the last stream")
    assert_close(new_bank[:, -1:, slots], bank_r, rtol=1e-5, name="its rows")
