"""Serving a model built on ``SparseDeltaMemory`` with ``torch.export`` and AOTInductor.

A model to serve has two entry points, as ``sdm_ops.examples.tiny_lm.TinyLM`` shows:
``forward(tokens)`` runs a prompt and returns ``(logits, states)``, each layer's final bank, and
``step_(tokens, states)`` decodes the next tokens from those banks, updating them in place.
:func:`export_prompt` and :func:`export_decode` export the two as
``torch.export.ExportedProgram`` objects: the prompt with a dynamic batch and length, the decode
step (one token) with a dynamic batch, its states recorded as inputs the program mutates.
``torch._inductor.aoti_compile_and_package`` compiles each program into a ``.pt2`` package and
``torch._inductor.aoti_load_package`` loads it, without the model's code; the loaded decode
package updates the states it is given in place. A package reads its inputs with the strides of
the example, which the export functions make contiguous: give it contiguous tensors
(``AOTI_RUNTIME_CHECK_INPUTS=1`` makes it check them).

The exported graphs hold ``sdm.product_key_topk`` and ``sdm.sparse_delta_memory`` (prompt) or
``sdm.sparse_delta_memory_`` (decode) as single nodes, also after ``run_decompositions()``;
AOTInductor traces their bodies. On CUDA tensors those bodies launch the sdm Triton kernels,
which the package carries compiled. On CPU tensors they call the operators' reference, Python
custom operators (``sdm_internal::<op>_reference``) that the package calls through
AOTInductor's proxy executor: a process loading a CPU package must ``import sdm_ops`` first.

Export runs under ``torch.no_grad()``, the operators' inference path. With autograd on, the
functional operator also returns what its backward keeps, tensors with a dimension that counts
chunks, and ``torch.export`` then rejects a length range that holds one-chunk prompts (its
contiguity check of those tensors specializes the chunk count). The examples must
have batch >= 2 (``torch.export`` specializes sizes 0 and 1) and a prompt longer than every
layer's ``chunk_size``: AOTInductor specializes the number of chunks of the example when it is
1, and a package made from a one-chunk example computes longer prompts wrongly.

``python -m sdm_ops.serve --out DIR`` exports and packages a ``TinyLM``, loads the
packages and checks a prompt and decode steps against the eager model.
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from ._cli import add_device_option, positive_int


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sdm_ops.serve",
        description="Export a small model built on SparseDeltaMemory (prompt and decode step), "
        "compile both programs with AOTInductor into OUT/prompt.pt2 and OUT/decode.pt2, load "
        "them and check a prompt and decode steps against the eager model (exit status 0 when "
        "they agree).",
    )
    parser.add_argument("--out", type=Path, required=True, help="directory for the packages")
    add_device_option(parser)
    parser.add_argument(
        "--steps", type=positive_int, default=16, help="decode steps to check (default 16)"
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch
from torch import Tensor, nn

from ._cli import default_device
from .nn import SparseDeltaMemory


class DecodeStep(nn.Module):
    """``forward(tokens, states) = model.step_(tokens, states)``: ``torch.export`` traces a
    module's ``forward``, so the decode step is exported through this wrapper."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, states: list[Tensor]) -> Tensor:
        return self.model.step_(tokens, states)


def _check_tokens(tokens, length_ok: bool, rule: str) -> None:
    """``tokens`` is an example ``[B, T, ...]`` tensor with B >= 2 whose length T follows
    ``rule`` (``length_ok``)."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() < 2 or tokens.shape[0] < 2:
        raise ValueError(
            f"tokens must be [B, T, ...] with B >= 2 (torch.export specializes a batch of 1), "
            f"got shape {list(tokens.shape)}"
        )
    if not length_ok:
        raise ValueError(f"tokens must have {rule}, got shape {list(tokens.shape)}")


def export_prompt(
    model: nn.Module, tokens: Tensor, *, max_batch: int | None = None, max_len: int | None = None
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model(tokens)`` under ``torch.no_grad()``, with dimensions 0
    (batch, 1 to ``max_batch``) and 1 (length, 1 to ``max_len``) of ``tokens`` dynamic.

    ``tokens`` is an example, ``[B, T]`` with B >= 2 and T longer than the ``chunk_size`` of
    every ``SparseDeltaMemory`` in ``model`` (see the module's docstring)."""
    layers = [m for m in model.modules() if isinstance(m, SparseDeltaMemory)]
    chunk = max((m.chunk_size for m in layers), default=1)
    long = isinstance(tokens, Tensor) and tokens.dim() >= 2 and tokens.shape[1] > chunk
    _check_tokens(tokens, long, f"T > {chunk}, more than one chunk of every layer")
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    length = torch.export.Dim("length", min=1, max=max_len)
    with torch.no_grad():
        return torch.export.export(
            model,
            (tokens.contiguous(),),  # AOTInductor assumes the example's strides
            dynamic_shapes=({0: batch, 1: length},),
            strict=False,
        )


def export_decode(
    model: nn.Module, tokens: Tensor, states: Sequence[Tensor], *, max_batch: int | None = None
) -> torch.export.ExportedProgram:
    """``torch.export`` of ``model.step_(tokens, states)`` (through :class:`DecodeStep`) under
    ``torch.no_grad()``, with dimension 0 (batch, 1 to ``max_batch``) of ``tokens`` and of
    every state dynamic; the program updates ``states`` in place (its graph signature lists
    them as mutated inputs after ``run_decompositions()``). ``tokens`` ``[B, 1]`` and
    ``states`` (contiguous, ``[B, ...]``) are examples with B >= 2; they are not modified."""
    one = isinstance(tokens, Tensor) and tokens.dim() >= 2 and tokens.shape[1] == 1
    _check_tokens(tokens, one, "T = 1 (one token a step)")
    states = list(states)
    for i, state in enumerate(states):
        if not isinstance(state, Tensor) or state.shape[:1] != tokens.shape[:1]:
            raise ValueError(f"states[{i}] must be a tensor [B = {tokens.shape[0]}, ...]")
        if not state.is_contiguous():
            raise ValueError(f"states[{i}] must be contiguous (step_ updates it in place)")
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    with torch.no_grad():
        return torch.export.export(
            DecodeStep(model),
            (tokens.contiguous(), states),
            dynamic_shapes=({0: batch}, [{0: batch}] * len(states)),
            strict=False,
        )


def _package(program: torch.export.ExportedProgram, path: Path) -> str:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # Packaging copies the program's tree specs, and torch 2.13's deprecated LeafSpec
        # warns whenever one is made: PyTorch's own use, nothing a caller can change.
        warnings.filterwarnings(
            "ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning
        )
        out = torch._inductor.aoti_compile_and_package(program, package_path=str(path))
    print(f"  {path} ({time.perf_counter() - t0:.0f} s)")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dev = torch.device(args.device or default_device())
    torch.manual_seed(0)
    from .examples.tiny_lm import MEMORY, TinyLM

    model = TinyLM().to(dev).eval()
    g = torch.Generator().manual_seed(1)
    example = torch.randint(0, 256, (2, 2 * MEMORY["chunk_size"] + 1), generator=g).to(dev)
    with torch.no_grad():
        _, states = model(example)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"exporting and compiling with AOTInductor on {dev}:")
    prompt_path = _package(export_prompt(model, example), args.out / "prompt.pt2")
    decode_path = _package(export_decode(model, example[:, :1], states), args.out / "decode.pt2")
    prompt = torch._inductor.aoti_load_package(prompt_path)
    decode = torch._inductor.aoti_load_package(decode_path)

    # Contiguous inputs: a package reads its inputs with the example's strides.
    tokens = torch.randint(0, 256, (3, 50), generator=g).to(dev)
    steps = torch.randint(0, 256, (args.steps, 3, 1), generator=g).to(dev)
    with torch.no_grad():
        want, want_states = model(tokens)
        got, got_states = prompt(tokens)
        err = (got - want).abs().max().item()
        for token in steps:
            want = model.step_(token, want_states)
            got = decode(token, got_states)  # got_states updated in place
            err = max(err, (got - want).abs().max().item())
    scale = want.abs().max().item()
    ok = err <= 1e-4 * max(scale, 1.0)
    print(
        f"prompt of 50 tokens and {args.steps} decode steps, batch 3: largest logit "
        f"difference to eager {err:.1e} ({'ok' if ok else 'FAILED'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
