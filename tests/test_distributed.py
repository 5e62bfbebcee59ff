"""Data-parallel training of a model of several ``SparseDeltaMemory`` layers: two ranks, each
on half of every batch, take the same SGD steps as one process on the whole batch (the same
loss at every step, the same parameters after the last), under ``DistributedDataParallel``
and under FSDP2 (``fully_shard`` on each layer and on the model). On CPU the ranks are two
processes of a gloo group (this runs everywhere); on two GPUs they use nccl, and the FSDP2
run compiles each layer with ``torch.compile(fullgraph=True)`` (skipped without two GPUs).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sdm_ops.nn import SparseDeltaMemory
from tests.distributed import RanksFailed, full_params, run_ranks, train_steps
from tests.helpers import SMALL_LAYER, assert_close, requires_multi_gpu

# Two ranks against one process: the same arithmetic but for the order of float32 sums (the
# loss's mean over two halves, each weight gradient's and the shared bank's sum over the batch
# made of two partial sums, the all-reduce of those), a rounding of about 1e-7 relative that
# the steps carry on; 1e-5 of the largest magnitude leaves room for that and for no more.
RTOL = 1e-5
# Compiled on two ranks against compiled on one: Inductor's kernels for a batch of 2 and of 4
# may split and fuse their reductions differently (more float32 rounding, as in compile_tests).
COMPILED_RTOL = 1e-4
B, T, D_MODEL, LAYERS, STEPS, LR = 4, 24, 32, 3, 3, 0.1


class Stack(nn.Module):
    """``(x, target) [B, T, d] -> loss``: a projection, ``LAYERS`` residual
    ``SparseDeltaMemory`` layers (with and without decay, 32 slots per head, so tokens share
    slots within a chunk), a head, the MSE to ``target``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_MODEL, D_MODEL)
        self.memories = nn.ModuleList(
            SparseDeltaMemory(
                **dict(SMALL_LAYER, d_model=D_MODEL, factors=(4, 8)),
                use_decay=i % 2 == 0,
                chunk_size=16,
            )
            for i in range(LAYERS)
        )
        self.head = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for memory in self.memories:
            h = h + memory(h)
        return F.mse_loss(self.head(h), target)


def make_model(device: torch.device | str, compiled: bool = False) -> Stack:
    """The same parameters in every process (drawn on the CPU), random banks (a zero bank
    reads zeros at the first step); with ``compiled``, each layer under
    ``torch.compile(fullgraph=True)``."""
    torch.manual_seed(0)
    model = Stack()
    with torch.no_grad():
        for memory in model.memories:
            memory.bank.normal_()
    model.to(device)
    if compiled:
        for memory in model.memories:
            memory.compile(fullgraph=True)
    return model


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: (x, target) [B, T, D_MODEL] on the CPU."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, T, D_MODEL, generator=g), torch.randn(B, T, D_MODEL, generator=g)


def rank_device(rank: int, device_type: str) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def ddp_rank(rank: int, world_size: int, device_type: str) -> dict:
    """One rank of the DDP run (``run_ranks``'s target)."""
    device = rank_device(rank, device_type)
    model = make_model(device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[rank] if device_type == "cuda" else None
    )
    losses = train_steps(ddp, ddp.parameters(), make_batch, STEPS, LR, device, rank, world_size)
    return {"losses": losses, "params": full_params(model)}


def fsdp_rank(rank: int, world_size: int, device_type: str, compiled: bool) -> dict:
    """One rank of the FSDP2 run (``run_ranks``'s target): each layer and the model sharded
    over the ranks, parameters gathered for each layer's forward and backward. The mesh is
    given: without one, ``fully_shard`` shards over the accelerator whenever there is one (a
    CUDA mesh for the CPU run on a GPU machine, whose gloo group cannot gather its shards)."""
    device = rank_device(rank, device_type)
    model = make_model(device)
    mesh = init_device_mesh(device_type, (world_size,))
    for memory in model.memories:
        fully_shard(memory, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Where the shards live: the mesh's device type and that of each local shard.
    devices = sorted(
        {p.device_mesh.device_type for p in model.parameters()}
        | {p.to_local().device.type for p in model.parameters()}
    )
    if compiled:  # after fully_shard: its hooks (which Dynamo does not trace) run eagerly
        for memory in model.memories:
            memory.compile(fullgraph=True)
    losses = train_steps(model, model.parameters(), make_batch, STEPS, LR, device, rank, world_size)
    graphs = counters["stats"]["unique_graphs"]  # what Dynamo compiled in this process
    return {"losses": losses, "params": full_params(model), "graphs": graphs, "devices": devices}


def one_process(device: str, compiled: bool = False) -> tuple[list[float], dict, dict]:
    """(losses, final parameters, initial parameters) of the same steps on the whole batch;
    on one CPU thread, as each CPU rank runs (tiny ops on several threads of a busy machine
    spend their time waiting for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if compiled:  # the layers compile afresh, whatever this process compiled before
        torch._dynamo.reset()
    try:
        model = make_model(device, compiled)
        initial = full_params(model)
        losses = train_steps(model, model.parameters(), make_batch, STEPS, LR, device)
    finally:
        torch.set_num_threads(threads)
    return losses, full_params(model), initial


def check_ranks_equal_one_process(ranks: list[dict], want, rtol: float) -> None:
    want_losses, want_params, initial = want
    assert want_losses[-1] < want_losses[0], f"SGD did not lower the loss: {want_losses}"
    for i in range(LAYERS):
        name = f"memories.{i}.bank"
        assert not torch.equal(want_params[name], initial[name]), (
            f"SGD left {name} unchanged: no gradient reached it"
        )
    got = ranks[0]
    assert len(got["losses"]) == STEPS
    for step, (g, w) in enumerate(zip(got["losses"], want_losses)):
        assert_close(
            torch.tensor(g),
            torch.tensor(w),
            rtol=rtol,
            name=f"global loss at step {step} (2 ranks {json.dumps(got['losses'])}, "
            f"1 process {json.dumps(want_losses)})",
        )
    assert got["params"].keys() == want_params.keys()
    for name, w in want_params.items():
        assert_close(got["params"][name], w, rtol=rtol, name=f"rank 0's {name}")
    for r, other in enumerate(ranks[1:], 1):  # the ranks end with the same parameters
        for name, p in other["params"].items():
            assert torch.equal(p, got["params"][name]), f"rank {r}'s {name} differs from rank 0's"


DEVICES = [
    pytest.param("cpu", id="cpu-gloo"),
    pytest.param("cuda", id="2gpu-nccl", marks=requires_multi_gpu),
]


@pytest.mark.parametrize("device_type", DEVICES)
def test_ddp_on_two_ranks_matches_one_process_on_the_whole_batch(device_type, tmp_path):
    # One process first: on GPUs it also fills Triton's kernel cache for the two ranks.
    want = one_process(device_type)
    backend = "nccl" if device_type == "cuda" else "gloo"
    ranks = run_ranks(ddp_rank, tmp_path, device_type, backend=backend)
    check_ranks_equal_one_process(ranks, want, RTOL)


@pytest.mark.parametrize(
    "device_type, compiled",
    [
        pytest.param("cpu", False, id="cpu-gloo"),
        pytest.param("cuda", True, id="2gpu-nccl-compiled", marks=requires_multi_gpu),
    ],
)
def test_fsdp2_on_two_ranks_matches_one_process_on_the_whole_batch(device_type, compiled, tmp_path):
    want = one_process(device_type, compiled)
    backend = "nccl" if device_type == "cuda" else "gloo"
    ranks = run_ranks(fsdp_rank, tmp_path, device_type, compiled, backend=backend)
    check_ranks_equal_one_process(ranks, want, COMPILED_RTOL if compiled else RTOL)
    for r, result in enumerate(ranks):
        assert (result["graphs"] > 0) == compiled, f"rank {r}: Dynamo compiled {result['graphs']}"
        assert result["devices"] == [device_type], f"rank {r}: shards on {result['devices']}"


def fail_on_rank_1(rank: int, world_size: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a collective (which fails when rank 1
    leaves, or rank 0 is terminated first)."""
    if rank == 1:
        raise ValueError("rank 1 fails here")
    torch.distributed.barrier()


def test_an_exception_on_a_rank_fails_the_run_with_its_traceback_first(tmp_path):
    with pytest.raises(RanksFailed) as info:
        run_ranks(fail_on_rank_1, tmp_path)
    message = str(info.value)
    # The rank's traceback, not only its message, and ahead of any other rank's.
    first = message.index("-- rank1 raised:")
    assert message.index("in fail_on_rank_1", first) < message.index("ValueError: rank 1", first)
    rank0 = message.find("-- rank0 raised:")  # -1: rank 0 was terminated before it raised
    assert rank0 == -1 or rank0 > first, message
