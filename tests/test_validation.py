"""Bad input fails loudly, in eager mode, naming the argument, and writes nothing (the checks
that read data: on the CPU, and on a GPU with strict checks); edge cases that are legal work
(every entry padding, NaN values, mixed index dtypes, permuted inputs)."""

import warnings

import pytest
import torch

import sdm_ops
from sdm_ops import reference as ref
from tests.helpers import (
    KERNEL_DEVICE,
    assert_close,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_cuda,
    requires_kernels,
    requires_multi_gpu,
    sdm_positional,
    to_float64,
)


def _args(**kw):
    return make_sdm_inputs(B=2, T=5, H=2, D=16, S=11, W=3, R=2, **kw)


BAD = [
    # (argument, replacement maker, error type, text the message must contain)
    ("v", lambda a: a["v"].double(), TypeError, "v"),
    ("v", lambda a: a["v"][..., :15], ValueError, "D"),
    ("v", lambda a: a["v"][0], ValueError, "v"),
    ("v", lambda a: a["v"].tolist(), TypeError, "v"),
    ("beta", lambda a: a["beta"][:, :4], ValueError, "beta"),
    ("beta", lambda a: a["beta"].half(), TypeError, "beta"),
    ("write_idx", lambda a: a["write_idx"].float(), TypeError, "write_idx"),
    ("write_idx", lambda a: a["write_idx"][:, :, :1], ValueError, "write_idx"),
    ("write_w", lambda a: a["write_w"][..., :2], ValueError, "write_w"),
    ("write_w", lambda a: a["write_w"].to(torch.int32), TypeError, "write_w"),
    ("read_idx", lambda a: a["read_idx"].to(torch.int16), TypeError, "read_idx"),
    ("read_w", lambda a: a["read_w"][..., :1], ValueError, "read_w"),
    ("bank", lambda a: a["bank"][..., :8], ValueError, "bank"),
    ("bank", lambda a: a["bank"][:1], ValueError, "bank"),
    ("bank", lambda a: a["bank"].double(), TypeError, "bank"),
    ("decay", lambda a: a["decay"][..., :1], ValueError, "decay"),
    (
        "write_idx",
        lambda a: torch.where(a["write_idx"] == 3, 11, a["write_idx"]),
        ValueError,
        "write_idx",
    ),
    (
        "read_idx",
        lambda a: torch.where(a["read_idx"] == 3, -2, a["read_idx"]),
        ValueError,
        "read_idx",
    ),
    ("bank", lambda a: a["bank"].to("meta"), ValueError, "bank"),
]


@pytest.mark.parametrize(
    "name,make,error,text", BAD, ids=[f"{n}-{i}" for i, (n, *_) in enumerate(BAD)]
)
def test_bad_arguments_raise_naming_the_argument_and_write_nothing(name, make, error, text):
    a = _args(seed=1)
    bad = dict(a, **{name: make(a)})
    with pytest.raises(error, match=text):
        sdm_ops.sparse_delta_memory(**bad, output_final_state=True)
    if name != "bank":
        state = a["bank"].clone()
        before = state.clone()
        with pytest.raises(error, match=text):
            sdm_ops.sparse_delta_memory_(
                bank=state, **{k: v for k, v in bad.items() if k != "bank"}
            )
        assert torch.equal(state, before), "a rejected in-place call modified the bank"


@pytest.mark.parametrize(
    "option,value,error",
    [
        ("chunk_size", 48, ValueError),
        ("chunk_size", 64.0, TypeError),
        ("chunk_size", True, TypeError),
        ("snapshot", "fp16", ValueError),
        ("snapshot", None, ValueError),
    ],
)
def test_bad_options_raise_naming_the_option(option, value, error):
    with pytest.raises(error, match=option):
        sdm_ops.sparse_delta_memory(**_args(seed=2), **{option: value}, output_final_state=True)


def test_in_place_update_needs_a_contiguous_per_stream_bank():
    a = _args(seed=3)
    rest = {k: v for k, v in a.items() if k != "bank"}
    with pytest.raises(ValueError, match="bank"):
        sdm_ops.sparse_delta_memory_(bank=a["bank"][0], **rest)  # shared [H, S, D]
    with pytest.raises(ValueError, match="contiguous"):
        strided = a["bank"].transpose(0, 1).contiguous().transpose(0, 1)
        sdm_ops.sparse_delta_memory_(bank=strided, **rest)


def test_too_many_entries_per_token_is_rejected():
    a = make_sdm_inputs(B=1, T=2, H=1, D=16, S=5, W=65, R=2)
    with pytest.raises(ValueError, match="64"):
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)


def _oracle(a):
    return ref.sdm_token_reference(*sdm_positional(to_float64(a)))


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=requires_kernels)], ids=["cpu_reference", "kernels"]
)
def test_every_entry_padding_reads_zero_and_keeps_the_bank(kernels):
    a = make_sdm_inputs(
        B=1, T=17, H=2, D=16, S=5, W=2, R=2, seed=4, device=KERNEL_DEVICE if kernels else "cpu"
    )
    a["write_idx"].fill_(-1)
    a["read_idx"].fill_(-1)
    with on_kernels() if kernels else torch.no_grad():
        out, bank = sdm_ops.sparse_delta_memory(**a, output_final_state=True)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(bank, a["bank"])


@pytest.mark.parametrize(
    "kernels", [False, pytest.param(True, marks=requires_kernels)], ids=["cpu_reference", "kernels"]
)
def test_nan_and_inf_values_propagate_without_a_crash(kernels):
    """A non-finite value poisons what it reaches in the recurrence and, in the chunked form,
    the outputs of its whole chunk (its dual matmul multiplies it by zeros); earlier chunks are
    untouched, and the NaNs are where the chunked reference has them."""
    a = make_sdm_inputs(
        B=1, T=40, H=1, D=16, S=6, W=2, R=2, seed=5, device=KERNEL_DEVICE if kernels else "cpu"
    )
    a["v"][0, 20, 0, 2] = float("nan")
    a["v"][0, 25, 0, 5] = float("inf")
    with on_kernels() if kernels else torch.no_grad():
        out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
    out, bank = out.double().cpu(), bank.double().cpu()
    # The chunked reference: sparse gathers, like the kernels (the token-by-token one works on
    # dense keys, where 0 * inf spreads NaN to every slot).
    out_r, bank_r = ref.sdm_chunked_reference(*sdm_positional(to_float64(a)), chunk_size=16)
    assert_close(out[:, :16], out_r[:, :16], rtol=1e-5, name="the chunk before the NaN")
    assert out[:, 20:].isnan().any()
    assert torch.equal(out.isnan(), out_r.isnan())
    assert torch.equal(bank.isnan(), bank_r.isnan())
    finite = bank_r.isfinite()
    assert_close(bank[finite], bank_r[finite], rtol=1e-5, name="finite bank rows")


def test_mixed_int32_and_int64_indices_and_permuted_inputs():
    a = _args(seed=6)
    a["write_idx"] = a["write_idx"].to(torch.int32)
    base = sdm_ops.sparse_delta_memory(**a, output_final_state=True)
    perm = {
        k: (v.transpose(0, 1).contiguous().transpose(0, 1) if v.dim() >= 3 else v)
        for k, v in a.items()
    }
    assert not perm["v"].is_contiguous()
    again = sdm_ops.sparse_delta_memory(**perm, output_final_state=True)
    assert torch.equal(base.out, again.out) and torch.equal(base.bank, again.bank)
    out_r, bank_r = _oracle(a)
    assert_close(base.out, out_r, rtol=1e-5, name="out")
    assert_close(base.bank, bank_r, rtol=1e-5, name="bank")


def test_wy_solve_rejects_bad_arguments_naming_them():
    A, QK = torch.randn(2, 3, 16, 16).unbind(0)
    beta = torch.rand(3, 16)
    for args, error, text in [
        ((A.double(), beta, QK), TypeError, "A"),
        ((A, beta[:, :8], QK), ValueError, "beta"),
        ((A, beta, QK[:, :8]), ValueError, "QK"),
        ((A[0], beta, QK), ValueError, "A"),
    ]:
        with pytest.raises(error, match=text):
            sdm_ops.wy_solve(*args)


def test_data_checks_name_the_first_bad_argument():
    # The checks that read data run together (one host synchronization); with several bad
    # arguments the first in argument order is the one named.
    a = _args(seed=2)
    a["write_idx"] = torch.where(a["write_idx"] == 3, 11, a["write_idx"])
    a["read_idx"] = torch.where(a["read_idx"] == 3, -2, a["read_idx"])
    with pytest.raises(ValueError, match="write_idx must hold -1"):
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)
    a["write_idx"] = a["write_idx"].clamp(max=10)
    with pytest.raises(ValueError, match="read_idx must hold -1 .* got -2"):
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)


@requires_cuda
@pytest.mark.parametrize("packed", [False, True])
def test_a_strict_eager_call_waits_for_its_checks_not_for_the_stream(packed):
    # With strict checks the index-range and cu_seqlens checks read data on the GPU. An eager
    # call copies their results to pinned memory and waits on an event for them alone, with
    # phase 1 queued behind them, so it makes no stream or device synchronization and no
    # blocking copy; and the checks reject bad data on the GPU before the bank is written.
    # (Without strict checks a GPU call reads no data: tests/test_strict_checks.py.)
    with sdm_ops.strict_checks():
        _strict_call_waits_for_its_checks(packed)


def _strict_call_waits_for_its_checks(packed):
    if packed:
        a = make_packed_sdm_inputs([5, 9, 3], device="cuda", seed=3)
    else:
        a = make_sdm_inputs(device="cuda", seed=3)
    state = a["bank"].clone()
    rest = {k: v for k, v in a.items() if k != "bank"}
    with torch.no_grad():
        sdm_ops.sparse_delta_memory(**a, output_final_state=True)  # compiles the kernels first
        sdm_ops.sparse_delta_memory_(bank=state, **rest)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                sdm_ops.sparse_delta_memory(**a, output_final_state=True)
                sdm_ops.sparse_delta_memory_(bank=state, **rest)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    # torch warns once per process that the debug mode is a prototype; only the warnings
    # that report a synchronizing operation count.
    syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert syncs == []
    S = a["bank"].shape[-2]
    bad = dict(rest, read_idx=rest["read_idx"].masked_fill(rest["read_idx"] == 3, S))
    assert bool((bad["read_idx"] == S).any())
    before = state.clone()
    with pytest.raises(ValueError, match=f"read_idx must hold -1 .* got {S}"):
        sdm_ops.sparse_delta_memory_(bank=state, **bad)
    with pytest.raises(ValueError, match="read_idx"):
        sdm_ops.sparse_delta_memory(**dict(bad, bank=a["bank"]), output_final_state=True)
    assert torch.equal(state, before), "a rejected in-place call modified the bank"
    if packed:
        cu = rest["cu_seqlens"].clone()
        cu[1] = cu[2] + 1
        with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
            sdm_ops.sparse_delta_memory_(bank=state, **dict(rest, cu_seqlens=cu))
        assert torch.equal(state, before), "a rejected in-place call modified the bank"


@requires_multi_gpu
@pytest.mark.parametrize("packed", [False, True])
def test_tensors_on_a_gpu_other_than_the_current_one_run_there(packed):
    # Triton launches on the current device; the operators make their inputs' device current
    # while they launch, so results on cuda:1 with cuda:0 current equal those made on cuda:0.
    def make(device):
        if packed:
            return make_packed_sdm_inputs([5, 9, 3], device=device, seed=4)
        return make_sdm_inputs(device=device, seed=4)

    def run(a):
        leaves = {k: a[k].clone().requires_grad_() for k in ("v", "bank")}
        out, bank = sdm_ops.sparse_delta_memory(**dict(a, **leaves), output_final_state=True)
        grads = torch.autograd.grad(out.sum() + bank.sum(), list(leaves.values()))
        with torch.no_grad():  # the inference forward: its bank copy on a side stream
            inference = sdm_ops.sparse_delta_memory(**a, output_final_state=True)
        state = a["bank"].clone()
        step = sdm_ops.sparse_delta_memory_(
            bank=state, **{k: v for k, v in a.items() if k != "bank"}
        )
        raw = torch.randn(6, 8 + 8, generator=torch.Generator().manual_seed(5)).to(a["v"].device)
        top = sdm_ops.product_key_topk(raw, (8, 8), 4)
        return [t.cpu() for t in (out, bank, *grads, *inference, step, state, *top)]

    torch.cuda.set_device(0)
    want = run(make("cuda:0"))
    got = run(make("cuda:1"))
    assert torch.cuda.current_device() == 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"result {i} differs between cuda:1 and cuda:0"


@pytest.mark.parametrize("cu", [[0, 2, 5], (0, 2, 5), 5])
def test_cu_seqlens_that_is_not_a_tensor_raises_type_error_naming_it(cu):
    a = make_sdm_inputs(B=1, T=5, H=2, D=16, S=11, W=3, R=2, seed=4)
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        sdm_ops.sparse_delta_memory(**a, cu_seqlens=cu, output_final_state=True)
    bank = a.pop("bank").expand(2, -1, -1, -1).clone()
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        sdm_ops.sparse_delta_memory_(**a, bank=bank, cu_seqlens=cu)


@pytest.mark.parametrize("packed", [False, True])
def test_meta_tensors_give_meta_outputs_of_the_right_shapes(packed):
    """Meta tensors hold no data: the checks that read data are skipped, the shape checks
    still run, and both functions return meta tensors shaped as on a real device."""
    if packed:
        a = make_packed_sdm_inputs([5, 0, 21, 11], seed=5)
    else:
        a = make_sdm_inputs(B=2, T=37, H=2, D=16, S=11, W=3, R=2, seed=5)
    m = {k: t.to("meta") for k, t in a.items()}
    banks = a["bank"].shape[0]
    m["v"].requires_grad_()
    out, bank = sdm_ops.sparse_delta_memory(**m, output_final_state=True)
    assert out.is_meta and bank.is_meta
    assert out.shape == a["v"].shape and bank.shape == (banks, 2, 11, 16)
    out.sum().backward()
    assert m["v"].grad.is_meta and m["v"].grad.shape == a["v"].shape
    out_ = sdm_ops.sparse_delta_memory_(**dict(m, v=m["v"].detach()))
    assert out_.is_meta and out_.shape == a["v"].shape
    # Shape checks still run on meta tensors.
    with pytest.raises(ValueError, match="beta"):
        sdm_ops.sparse_delta_memory(**dict(m, beta=m["beta"][:, :4]), output_final_state=True)


def test_a_meta_decode_step_gives_a_meta_output():
    a = make_sdm_inputs(B=2, T=1, H=2, D=16, S=11, W=3, R=2, seed=6)
    out = sdm_ops.sparse_delta_memory_(**{k: t.to("meta") for k, t in a.items()})
    assert out.is_meta and out.shape == (2, 1, 2, 16)


@pytest.mark.parametrize("which", ["all", "v", "shared bank", "in place"])
def test_head_first_layout_is_reported_against_v_naming_the_layout(which):
    """fla's head-first [B, H, T, D] layout: every per-token input transposed shows only as a
    bank of the wrong heads, v alone transposed as a beta of the wrong shape; both are v's
    error, which names the expected [B, T, H, D] layout."""
    a = make_sdm_inputs(B=2, T=5, H=3, D=16, S=11, W=3, R=2, seed=7)
    hf = {k: t if k == "bank" else t.transpose(1, 2) for k, t in a.items()}
    bad = {
        "all": hf,
        "v": dict(a, v=hf["v"]),
        "shared bank": dict(hf, bank=a["bank"][0]),
        "in place": hf,
    }[which]
    fn = sdm_ops.sparse_delta_memory_ if which == "in place" else sdm_ops.sparse_delta_memory
    with pytest.raises(
        ValueError,
        match=r"^v must have shape \[B, T, H, D\] \(time before "
        r"heads\).*head-first \[B, H, T, D\]",
    ):
        fn(**bad)


def test_a_bank_of_the_wrong_heads_is_still_the_bank_s_error():
    a = _args(seed=8)  # T = 5, H = 2
    with pytest.raises(ValueError, match="^bank must have shape"):
        sdm_ops.sparse_delta_memory(**dict(a, bank=a["bank"][:, :1]), output_final_state=True)


def test_a_bad_option_under_torch_compile_names_the_option():
    """The checks run while Dynamo traces: without fullgraph the ValueError itself comes
    through; with fullgraph=True torch reports it inside its own exception (Unsupported:
    "Observed exception"), whose text holds the ValueError's."""
    a = _args(seed=9)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"chunk_size must be one of \[16, 32, 64, 128\]"):
        torch.compile(sdm_ops.sparse_delta_memory, fullgraph=True)(
            **a, chunk_size=7, output_final_state=True
        )
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="chunk_size must be one of"):
        torch.compile(sdm_ops.sparse_delta_memory)(**a, chunk_size=7, output_final_state=True)
