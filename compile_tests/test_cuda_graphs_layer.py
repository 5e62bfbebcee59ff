"""The ``SparseDeltaMemory`` layer under CUDA graphs: training steps under
``torch.compile(mode="reduce-overhead")`` equal to eager and replayed from CUDA graphs; decode
steps (``step_``) captured by hand in a ``torch.cuda.graph`` and replayed equal to eager steps;
the sdm Triton kernels that Inductor's output code holds for the layer's forward and backward
(an expecttest). CUDA only; every test here is skipped on CPU. Data-parallel training (DDP,
FSDP2) is in tests/test_distributed.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from compile_tests import (
    fresh_dynamo,  # noqa: F401  (an autouse fixture)
    kernels_defined_in,
    launched_kernels,
)
from sdm_ops.nn import SparseDeltaMemory
from tests.helpers import SMALL_LAYER, assert_close, capture, kernel_modules, requires_cuda

RTOL = 1e-4  # compiled or captured against eager, after SGD steps: float32 rounding
B, T, D_MODEL = 2, 24, 32
LR = 0.1


class TinyModel(nn.Module):
    """``x [B, T, d] -> loss``: a projection, a residual SparseDeltaMemory, a head, MSE to
    ``target [B, T, d]``. 32 slots per head, so tokens share slots within a chunk."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_MODEL, D_MODEL)
        self.memory = SparseDeltaMemory(
            **dict(SMALL_LAYER, d_model=D_MODEL, factors=(4, 8)),
            use_decay=True,
            chunk_size=16,
        )
        self.head = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.memory(h)
        return F.mse_loss(self.head(h), target)


def make_model(seed: int = 0) -> TinyModel:
    """The same parameters for the same seed, in every process (built on the CPU)."""
    torch.manual_seed(seed)
    model = TinyModel()
    with torch.no_grad():
        model.memory.bank.normal_()
    return model


def make_batch(step: int, batch: int = B) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, target) [batch, T, D_MODEL] on the CPU, fixed by ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(batch, T, D_MODEL, generator=g),
        torch.randn(batch, T, D_MODEL, generator=g),
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead"): training steps from CUDA graph trees
# ---------------------------------------------------------------------------


@requires_cuda
def test_reduce_overhead_training_steps_replay_cuda_graphs_and_match_eager():
    steps = 5  # step 1 warms up, step 2 records, steps 3-5 replay
    counters.clear()
    model = make_model().cuda()
    eager = copy.deepcopy(model)
    initial = params_of(model)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=LR)
    for step in range(steps):
        x, y = (t.cuda() for t in make_batch(step))
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(x, y)
        got = loss.item()  # read before the next replay reuses the output's memory
        loss.backward()
        opt.step()  # outside the compiled region; parameters stay in place
        opt.zero_grad(set_to_none=True)

        want = eager(x, y)
        want.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        assert_close(torch.tensor(got), want.detach(), rtol=RTOL, name=f"loss at step {step}")

    got_params, want_params = params_of(model), params_of(eager)
    for name, want in want_params.items():
        assert_close(got_params[name], want, rtol=RTOL, name=f"{name} after {steps} steps")
    assert not torch.equal(got_params["memory.bank"], initial["memory.bank"]), (
        "SGD left the bank unchanged: no gradient reached it"
    )

    skips = counters["inductor"]["cudagraph_skips"]
    assert skips == 0, (
        f"Inductor skipped CUDA graphs {skips} time(s) (the reason is logged "
        f"by torch._inductor's cudagraphs logger): {dict(counters['inductor'])}"
    )
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None, "reduce-overhead created no CUDA graph tree"
    recorded = manager.new_graph_id().id  # graph ids count up from 0 as graphs are recorded
    assert recorded >= 2, (
        f"{recorded} CUDA graph(s) recorded; expected the forward's and the backward's"
    )


# ---------------------------------------------------------------------------
# torch.cuda.graph by hand: the layer's decode steps
# ---------------------------------------------------------------------------


@requires_cuda
def test_cuda_graph_of_layer_decode_steps_replays_equal_eager_steps():
    prompt, steps = 20, 6
    layer = make_model().memory.cuda()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, prompt + steps, D_MODEL, generator=g).cuda()
    with torch.no_grad():
        _, state = layer(x[:, :prompt], return_state=True)  # [B, H, S, D], contiguous
    start = state.clone()
    eager_state = state.clone()
    static_x = x[:, prompt : prompt + 1].clone()

    scratch = state.clone()  # the warm-up calls' state
    graph, static_y = capture(
        lambda: layer.step_(static_x, state), warm_up=lambda: layer.step_(static_x, scratch)
    )
    torch.cuda.synchronize()
    assert torch.equal(state, start), "capturing ran the step: the state changed"

    for t in range(steps):
        token = x[:, prompt + t : prompt + t + 1]
        static_x.copy_(token)
        graph.replay()
        want = layer.step_(token, eager_state)
        torch.cuda.synchronize()
        assert_close(static_y, want, rtol=RTOL, name=f"y of replayed step {t}")
        assert_close(state, eager_state, rtol=RTOL, name=f"state after replayed step {t}")
    assert not torch.equal(state, start), "the replays left the state unchanged"


# ---------------------------------------------------------------------------
# The sdm Triton kernels in Inductor's output code
# ---------------------------------------------------------------------------


def sdm_kernel_names() -> set[str]:
    """Every ``@triton.jit`` kernel that a module of ``sdm_ops.kernels`` launches (modules
    whose names start with ``_`` hold shared helpers and launch nothing)."""
    names = set()
    for module in kernel_modules():
        names.update(launched_kernels(module))
    return names


def layer_loss(layer: SparseDeltaMemory, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    y, final = layer(x, return_state=True)
    return (y * g).sum() + final.square().sum() * 1e-2


@requires_cuda
def test_inductor_code_of_layer_forward_and_backward_holds_the_sdm_kernels():
    from expecttest import assert_expected_inline  # here: if missing, only this test fails

    candidates = sdm_kernel_names()
    layer = make_model().memory.cuda()
    x, g = (t.cuda() for t in make_batch(0))
    x.requires_grad_()
    compiled = torch.compile(layer_loss, fullgraph=True)

    def forward_and_backward():
        compiled(layer, x, g).backward()

    _, codes = run_and_get_code(forward_and_backward)
    # Defined there, not merely named: phase 2's forward kernel names _out_kernel in a comment,
    # and the layer's forward (a snapshot kept for the backward) does not launch that kernel.
    found = kernels_defined_in(candidates, codes)
    # Forward: product-key top-k (read and write addresses), the selection of finite inputs,
    # phase 1 (sort, pairs, and the dense kernel for heavy chunks), the WY solve's three kernels
    # (the pairs solve, then the diag and panel kernels for the chunks it leaves),
    # the first-write table, the copy of the bank rows no chunk writes and phase 2. Backward:
    # the bank gradient's copy, phase 2's three kernels (QX^T dout, the walk, and the dual
    # matmul, which carries the WY solve's backward), phase 1's three (on the forward's sort:
    # the lone entries, the pairs, the dense kernel), product-key top-k's.
    assert_expected_inline(
        " ".join(found),
        """\
_bank_copy_kernel _chunk_lone_bwd_kernel _chunk_pairs_bwd_kernel \
_chunk_pairs_kernel _chunk_prepare_bwd_kernel _chunk_prepare_kernel _chunk_sort_kernel \
_dual_matmul_bwd_kernel _finite_select_kernel _first_writes_kernel _fwd_diag_kernel \
_fwd_panel_kernel _pairs_solve_kernel _product_key_topk_bwd _product_key_topk_fwd \
_qx_dout_kernel _recurrence_bwd_kernel _recurrence_fwd_kernel""",
    )
