"""Running a function on several ranks of one ``torch.distributed`` process group, for the
distributed tests on CPU (gloo) and on GPUs (nccl). Independent of sdm_ops.

``run_ranks`` starts one process per rank with ``torch.multiprocessing.spawn``; the ranks meet
through a ``FileStore`` in a fresh folder, so no TCP port is chosen (two runs at once cannot
collide on one). Each rank's return value comes back to the caller. An exception in a rank
fails the call with ``RanksFailed``, whose message holds the traceback of every rank that
raised, the first to raise first: the others usually fail only because it left (a collective
whose peer closed its connection), and spawn alone would report whichever rank it noticed
first. Ranks still running are terminated rather than left waiting in a collective.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import ProcessException

# Collectives wait this long for a slow rank (one still compiling, say) before they fail.
TIMEOUT = timedelta(seconds=300)
# NVLink multicast stays off in NCCL and in PyTorch's symmetric memory: on a host whose GPUs
# others share, a program that uses it can put those GPUs out of service.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


class RanksFailed(RuntimeError):
    """A rank of ``run_ranks`` raised; the message holds the ranks' tracebacks."""


def _rank_main(
    rank: int,
    world_size: int,
    backend: str,
    folder: str,
    env: dict[str, str],
    fn: Callable,
    args: tuple,
) -> None:
    """One rank (``torch.multiprocessing.spawn``'s target, so module level): join the group,
    run ``fn(rank, world_size, *args)``, save what it returns to ``folder/rank<rank>.pt``; on
    an exception, save when it came and its traceback to ``folder/rank<rank>.err``, then
    raise it."""
    try:
        os.environ.update(env)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)  # the ranks share the CPU's cores
        dist.init_process_group(
            backend,
            init_method=Path(folder, "store").as_uri(),
            rank=rank,
            world_size=world_size,
            timeout=TIMEOUT,
        )
    except BaseException:
        _save_failure(folder, rank)
        raise
    try:
        torch.save(fn(rank, world_size, *args), Path(folder, f"rank{rank}.pt"))
        # Every rank done before any tears the group down: a rank that leaves while another
        # still has a collective in flight can abort that rank's process (gloo terminates it).
        dist.barrier()
    except BaseException:
        _save_failure(folder, rank)  # before the group goes, which fails the other ranks
        raise
    finally:
        dist.destroy_process_group()


def _save_failure(folder: str, rank: int) -> None:
    when = time.time()
    Path(folder, f"rank{rank}.err").write_text(f"{when!r}\n{traceback.format_exc()}")


def _failures(folder: Path) -> str:
    """The tracebacks the ranks saved, the earliest first."""
    found = []
    for path in folder.glob("rank*.err"):
        when, _, trace = path.read_text().partition("\n")
        found.append((float(when), path.stem, trace))
    return "\n".join(f"-- {rank} raised:\n{trace}" for _, rank, trace in sorted(found))


def run_ranks(
    fn: Callable,
    folder: str | os.PathLike,
    *args,
    backend: str = "gloo",
    world_size: int = 2,
) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each called
    in its own process, rank r of a ``backend`` process group (nccl: on GPU r). ``fn`` and
    ``args`` must pickle (``fn`` at module level); so must the results, which go through
    ``torch.save`` / ``torch.load`` in ``folder`` (an empty folder, e.g. ``tmp_path``).
    nccl ranks get ``NCCL_ENV`` in their environment. Raises ``RanksFailed`` when a rank
    fails."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"folder must be empty (the ranks' store and results), got {folder}")
    env = NCCL_ENV if backend == "nccl" else {}
    try:
        torch.multiprocessing.spawn(
            _rank_main, args=(world_size, backend, str(folder), env, fn, args), nprocs=world_size
        )
    except ProcessException as e:
        # Ranks killed by a signal or exiting without a Python exception save no traceback.
        saved = _failures(folder) or "none"
        raise RanksFailed(
            f"{e}\n\nThe ranks' tracebacks, the first to raise first:\n{saved}"
        ) from None
    return [torch.load(folder / f"rank{r}.pt") for r in range(world_size)]


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``module``, whole (an FSDP2 shard is all-gathered: a collective,
    so every rank calls this), detached, on the CPU; names without ``torch.compile``'s
    ``_orig_mod.``."""
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_orig_mod.", "")] = t.detach().cpu().clone()
    return out


def train_steps(
    model: Callable[..., torch.Tensor],
    params,
    batch: Callable[[int], tuple[torch.Tensor, ...]],
    steps: int,
    lr: float,
    device: torch.device | str,
    rank: int = 0,
    world_size: int = 1,
) -> list[float]:
    """``steps`` SGD steps (on ``params``) of ``model(*inputs) -> loss``, where ``inputs`` is
    rank ``rank``'s equal share (along dim 0) of the global batch ``batch(step)``; returns the
    global mean loss of each step: the ranks' losses all-reduced when ``world_size > 1``, so
    that with a mean loss every rank returns the loss of the whole batch."""
    opt = torch.optim.SGD(params, lr=lr)
    losses = []
    for step in range(steps):
        inputs = []
        for t in batch(step):
            if t.shape[0] % world_size:
                raise ValueError(f"the batch of {t.shape[0]} does not split over {world_size}")
            share = t.shape[0] // world_size
            inputs.append(t[rank * share : (rank + 1) * share].to(device))
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses
