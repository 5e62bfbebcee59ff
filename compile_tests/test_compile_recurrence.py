"""``torch.compile`` of the recurrence: ``sparse_delta_memory`` with ``fullgraph=True,
dynamic=True`` over three sequence lengths compiling once and equal to eager, forward and
backward;
the in-place ``sparse_delta_memory_`` compiled equal to eager; out-of-range indices in compiled
code neither raising nor crashing but counting as padding; and on CUDA, CUDA graph capture of
decode steps and of the inference forward (its bank copy on a second stream), and the
recurrence's Triton kernels in Inductor's output code."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import sdm_ops
from compile_tests import (
    CHUNK,
    assert_kernels_in_code,
    fresh_dynamo,  # noqa: F401  (an autouse fixture)
    launched_kernels,
    run_sdm,
    sdm_loss,
)
from tests.helpers import assert_close, capture, make_sdm_inputs, requires_cuda

RTOL = 1e-5  # compiled against eager: float32 rounding
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
B, H, D, S, W, R = 1, 2, 16, 32, 3, 2  # B * H = 2 streams


def sdm_inputs(T: int, device: str, seed: int, **kwargs) -> dict:
    opts = dict(decay=True, shared=False) | kwargs
    return make_sdm_inputs(B, T, H, D, S, W, R, seed=seed, device=device, **opts)


def run_sdm_inplace(bank, v, beta, write_idx, write_w, read_idx, read_w, decay=None):
    return sdm_ops.sparse_delta_memory_(
        v, beta, write_idx, write_w, read_idx, read_w, bank, decay, chunk_size=CHUNK
    )


def seq_args(a: dict) -> tuple:
    """The inputs of ``run_sdm_inplace`` after the bank, from ``make_sdm_inputs``' dict."""
    return tuple(
        a.get(k) for k in ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay")
    )


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_sequence_lengths_compile_once_and_match_eager(device):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(run_sdm, backend=counter, fullgraph=True, dynamic=True)
    for T in (40, 57, 90):
        a = sdm_inputs(T, device, seed=T)
        out, bank = compiled(**a)
        want_out, want_bank = run_sdm(**a)
        assert_close(out, want_out, rtol=RTOL, name=f"out (T={T})")
        assert_close(bank, want_bank, rtol=RTOL, name=f"bank (T={T})")
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times over T = 40, 57, "
        f"90; dynamic shapes should compile once"
    )


FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_lengths_forward_and_backward_compile_once_and_match_eager(device):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(sdm_loss, backend=counter, fullgraph=True, dynamic=True)
    for T in (40, 57, 90):
        a = sdm_inputs(T, device, seed=100 + T)
        g = torch.Generator().manual_seed(T)
        g_out = torch.randn(a["v"].shape, generator=g).to(device)
        g_bank = torch.randn(B, H, S, D, generator=g).to(device)
        grads = []
        for fn in (compiled, sdm_loss):
            leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS}
            loss = fn(**dict(a, **leaves), g_out=g_out, g_bank=g_bank)
            grads.append(torch.autograd.grad(loss, [leaves[k] for k in FLOATS]))
        for name, got, want in zip(FLOATS, *grads):
            assert_close(got, want, rtol=RTOL, name=f"d{name} (T={T})")
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times over T = 40, 57, "
        f"90 with gradients; dynamic shapes should compile once"
    )


@pytest.mark.parametrize("device", DEVICES)
def test_fullgraph_inplace_matches_eager_out_and_bank(device):
    a = sdm_inputs(27, device, seed=1, shared=False, index_dtype=torch.int32)  # 2 chunks
    compiled = torch.compile(run_sdm_inplace, fullgraph=True)
    bank, want_bank = a["bank"].clone(), a["bank"].clone()
    out = compiled(bank, *seq_args(a))
    want_out = run_sdm_inplace(want_bank, *seq_args(a))
    assert_close(out, want_out, rtol=RTOL, name="out")
    assert_close(bank, want_bank, rtol=RTOL, name="bank updated in place")
    assert not torch.equal(bank, a["bank"]), "the compiled call left the bank unchanged"


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_out_of_range_indices_do_not_raise_and_count_as_padding(device):
    a = sdm_inputs(20, device, seed=2)
    bad, padded = dict(a), dict(a)
    for name, pos, value in (("write_idx", (0, 5, 1, 0), S + 5), ("read_idx", (0, 9, 0, 1), -7)):
        bad[name], padded[name] = a[name].clone(), a[name].clone()
        bad[name][pos] = value
        padded[name][pos] = -1
    # Eager mode with strict checks (on the CPU, always) checks the indices.
    with pytest.raises(ValueError, match="write_idx"), sdm_ops.strict_checks():
        run_sdm(**bad)
    out, bank = torch.compile(run_sdm, fullgraph=True)(**bad)
    want_out, want_bank = run_sdm(**padded)
    assert_close(out, want_out, rtol=RTOL, name="out")
    assert_close(bank, want_bank, rtol=RTOL, name="bank")


@requires_cuda
def test_cuda_graph_decode_steps_replay_equal_eager_steps():
    steps, batch, heads = 6, 2, 2  # B * H = 4 streams, T = 1 per step
    a = make_sdm_inputs(
        batch, steps, heads, D, S, W, R, seed=3, decay=True, shared=False, device="cuda"
    )
    tokens = seq_args(a)
    static_in = tuple(t[:, :1].clone() for t in tokens)
    bank = a["bank"].clone()

    def step(bank_, inputs):
        return sdm_ops.sparse_delta_memory_(*inputs[:6], bank_, *inputs[6:])

    scratch = bank.clone()
    graph, static_out = capture(
        lambda: step(bank, static_in), warm_up=lambda: step(scratch, static_in)
    )

    eager_bank = a["bank"].clone()
    for t in range(steps):
        for buf, src in zip(static_in, tokens):
            buf.copy_(src[:, t : t + 1])
        graph.replay()
        want = step(eager_bank, tuple(src[:, t : t + 1] for src in tokens))
        torch.cuda.synchronize()
        torch.testing.assert_close(
            static_out, want, rtol=0, atol=0, msg=lambda m: f"step {t}: out differs: {m}"
        )
        torch.testing.assert_close(
            bank, eager_bank, rtol=0, atol=0, msg=lambda m: f"step {t}: bank differs: {m}"
        )


@requires_cuda
@pytest.mark.parametrize("beside", [True, False], ids=["copy_beside", "copy_in_order"])
def test_inference_forward_eager_and_replayed_equals_the_in_place_call_on_a_copy(
    monkeypatch, beside
):
    # Without autograd the forward copies the bank on a second stream, beside phase 1 and the
    # WY solve, and joins it before phase 2 (or, for a bank large against phase 1's work, in
    # order: the bound is raised or lowered here to take either path). Its out and bank must
    # equal sparse_delta_memory_ on a clone (one stream), bitwise: eagerly, with the source
    # bank overwritten right after the call (the copy read it before), and replayed from a
    # CUDA graph on new inputs (the fork and the join captured). The bank is large enough
    # (64 MiB) for the copy to outlast phase 1 at this T.
    from sdm_ops.ops import recurrence as ops

    monkeypatch.setattr(ops, "_COPY_BESIDE_BYTES", 2**40 if beside else 0)
    sides = []
    copy_beside = ops._copy_beside

    def spy(*args):
        bank_out, side = copy_beside(*args)
        sides.append(side)
        return bank_out, side

    monkeypatch.setattr(ops, "_copy_beside", spy)
    shape = dict(B=2, T=200, H=2, D=64, S=65536, W=8, R=8, decay=True, device="cuda")
    rest = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay")

    def in_place_on_copy(a):
        bank = a["bank"].clone()
        out = sdm_ops.sparse_delta_memory_(**{k: a[k] for k in rest}, bank=bank)
        return out, bank

    a = make_sdm_inputs(**shape, seed=41)
    want = in_place_on_copy(a)
    src = a["bank"].clone()
    with torch.no_grad():
        got = sdm_ops.sparse_delta_memory(
            *(a[k] for k in rest[:-1]), src, a["decay"], output_final_state=True
        )
    src.fill_(float("nan"))
    for name, g, w in zip(("out", "bank"), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"eager {name}: {m}")

    static = {k: a[k].clone() for k in rest + ("bank",)}

    def forward():
        with torch.no_grad():
            return sdm_ops.sparse_delta_memory(**static, output_final_state=True)

    graph, static_out = capture(forward)
    for seed in (42, 43):
        b = make_sdm_inputs(**shape, seed=seed)
        for k in static:
            static[k].copy_(b[k])
        graph.replay()
        want = in_place_on_copy(b)
        torch.cuda.synchronize()
        for name, g, w in zip(("out", "bank"), static_out, want):
            torch.testing.assert_close(
                g, w, rtol=0, atol=0, msg=lambda m: f"replay {seed}: {name}: {m}"
            )
    assert sides and all((side is not None) == beside for side in sides), sides


@requires_cuda
def test_inductor_code_holds_the_recurrence_triton_kernels(monkeypatch):
    from sdm_ops.kernels import chunk_prepare, decode_step, recurrence_fwd, wy_solve

    # The reference shape's path, with _out_kernel, whatever the device's SM count (at this
    # test's few streams the walk would form out itself: recurrence_fwd.walk_forms_out).
    monkeypatch.setattr(recurrence_fwd, "_WALK_SMS", 0)
    kernels = (
        launched_kernels(chunk_prepare.chunk_prepare)
        + launched_kernels(wy_solve.wy_solve_fwd)
        + launched_kernels(recurrence_fwd.recurrence_fwd)
    )
    assert {"_chunk_prepare_kernel", "_recurrence_fwd_kernel"} <= set(kernels)
    a = sdm_inputs(40, "cuda", seed=4)
    compiled = torch.compile(run_sdm, fullgraph=True)
    _, codes = run_and_get_code(compiled, **a)
    assert_kernels_in_code(kernels, codes, "sparse_delta_memory")
    bank = a["bank"].clone()
    _, codes = run_and_get_code(torch.compile(run_sdm_inplace, fullgraph=True), bank, *seq_args(a))
    assert_kernels_in_code(kernels, codes, "sparse_delta_memory_")
    step = tuple(None if t is None else t[:, :1] for t in seq_args(a))  # a decode step
    _, codes = run_and_get_code(torch.compile(run_sdm_inplace, fullgraph=True), bank, *step)
    assert_kernels_in_code(launched_kernels(decode_step.decode_step), codes, "a decode step")
