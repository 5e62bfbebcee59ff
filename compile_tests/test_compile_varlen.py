"""``torch.compile`` and CUDA graphs of packed batches: ``cu_seqlens`` is a tensor input, so
new offsets (same number of sequences and tokens) reuse the compiled graph, forward and
backward; a CUDA graph captured with static ``cu_seqlens`` storage replays new offsets."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import sdm_ops
from compile_tests import (
    CHUNK,
    fresh_dynamo,  # noqa: F401  (an autouse fixture)
    sdm_loss,
)
from sdm_ops import reference as ref
from tests.helpers import assert_close, capture, make_packed_sdm_inputs, requires_cuda

RTOL = 1e-5
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
H, D, S, W, R = 2, 16, 32, 3, 2
FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")
# Three packings of 40 tokens into 3 sequences: empty, shorter than a chunk, several chunks.
PACKINGS = ([0, 7, 33], [20, 20, 0], [1, 16, 23])


def packed(lengths, device, seed):
    """(the other arguments, cu_seqlens) of a packed batch of ``lengths``."""
    a = make_packed_sdm_inputs(lengths, H, D, S, W, R, seed=seed, decay=True, device=device)
    return a, a.pop("cu_seqlens")


@pytest.mark.parametrize("device", DEVICES)
def test_new_offsets_reuse_the_compiled_graph_forward_and_backward(device):
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(sdm_loss, backend=counter, fullgraph=True)
    for i, lengths in enumerate(PACKINGS):
        a, cu = packed(lengths, device, seed=i)
        g = torch.Generator().manual_seed(10 + i)
        g_out = torch.randn(a["v"].shape, generator=g).to(device)
        g_bank = torch.randn(a["bank"].shape, generator=g).to(device)
        grads = []
        for fn in (compiled, sdm_loss):
            leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS}
            loss = fn(**dict(a, **leaves), cu_seqlens=cu, g_out=g_out, g_bank=g_bank)
            grads.append(torch.autograd.grad(loss, [leaves[k] for k in FLOATS]))
        for name, got, want in zip(FLOATS, *grads):
            assert_close(got, want, rtol=RTOL, name=f"d{name} (lengths {lengths})")
        want = ref.sdm_varlen_reference(
            **{k: t.cpu().double() for k, t in a.items()}, cu_seqlens=cu.cpu(), chunk_size=CHUNK
        )
        out, bank = torch.compile(sdm_ops.sparse_delta_memory, fullgraph=True)(
            **a, chunk_size=CHUNK, cu_seqlens=cu, output_final_state=True
        )
        assert_close(out, want[0], rtol=RTOL, name=f"out (lengths {lengths})")
        assert_close(bank, want[1], rtol=RTOL, name=f"bank (lengths {lengths})")
    assert counter.frame_count == 1, (
        f"compiled {counter.frame_count} times for three packings "
        f"of the same shapes; cu_seqlens values must not recompile"
    )


@requires_cuda
def test_cuda_graph_with_static_cu_seqlens_replays_new_offsets():
    a, cu = packed(PACKINGS[0], "cuda", seed=5)
    rest = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay")
    static = {k: a[k].clone() for k in rest}
    static_cu = cu.clone()
    bank = a["bank"].clone()

    def step():
        return sdm_ops.sparse_delta_memory_(
            bank=bank, **static, cu_seqlens=static_cu, chunk_size=CHUNK
        )

    graph, static_out = capture(step)
    for i, lengths in enumerate(PACKINGS):
        b, new_cu = packed(lengths, "cuda", seed=20 + i)
        for k in rest:
            static[k].copy_(b[k])
        static_cu.copy_(new_cu)
        bank.copy_(b["bank"])
        graph.replay()
        want_bank = b["bank"].clone()
        want_out = sdm_ops.sparse_delta_memory_(
            bank=want_bank, **{k: b[k] for k in rest}, cu_seqlens=new_cu, chunk_size=CHUNK
        )
        torch.cuda.synchronize()
        torch.testing.assert_close(
            static_out,
            want_out,
            rtol=0,
            atol=0,
            msg=lambda m: f"lengths {lengths}: out differs: {m}",
        )
        torch.testing.assert_close(
            bank, want_bank, rtol=0, atol=0, msg=lambda m: f"lengths {lengths}: bank differs: {m}"
        )
