"""Capacity: recall against the number of stored key-value pairs, the sparse memory beside a
dense delta rule.

``python -m benchmarks.capacity`` trains, for each number of pairs P (16 to 4096 by default), two
models on multi-query associative recall (``sdm_ops.examples.mqar.MQARTask`` with
one token layout for the whole sweep: P pairs whose keys come from a vocabulary of
``keys_per_pair * P`` keys, then up to ``max_queries`` of their keys again, T = 2P + queries
tokens) and evaluates both on the same held-out sequences:

- ``sdm``: :class:`sdm_ops.nn.SparseDeltaMemory`, a bank of ``prod(factors)`` slots per head
  addressed by product-key top-k;
- ``dense``: :class:`DenseDeltaRule`, DeltaNet with a ``[head_dim, head_dim]`` state per head:
  fla-core's ``chunk_delta_rule`` when it imports and the input is on a GPU, else
  :func:`sdm_ops.sparse_delta_memory` with every slot addressed (W = R = S = head_dim,
  ``write_idx = read_idx = arange(S)``), which is the same recurrence (``docs/design.md``,
  "Dense limit").

Both layers have the same d_model, heads and head_dim and, with the default options, the
same number of trained parameters (checked to within 10%); the models around them are the
same (embedding, two blocks of token shift + memory + MLP, head), trained with the same
steps, batches, optimizer and seeds. Neither learns an initial state: the SDM layer's bank
stays zero, as the dense state starts at zero. The numbers of pairs run in the order given,
and at each one a model continues from itself as trained at the previous one (a curriculum:
trained from scratch at thousands of pairs, neither model finds the task's signal in a few
hundred steps); ``--from-scratch`` trains a new model at each.

The defaults, and why:

- the key vocabulary grows with the pairs (4 keys a pair): with one vocabulary of the largest
  P's size (4096 keys) from the start, each key turns up in a few sequences a step at small
  P and the models learn many times more slowly (a small SDM model at 4 pairs recalls under
  a fifth of the queries where 16 keys let it recall nearly all in as many steps); a few keys
  a pair keep every key frequent while a sequence's keys stay a draw;
- AdamW at a peak learning rate of 1e-3 (linear warmup, cosine decay): at d_model 256, 5e-3
  holds the SDM model at the loss of the values' uniform distribution (ln 256) where 1e-3
  leaves it;
- 1500 steps for the new models at 16 pairs, where they learn to store and recall, then 400
  at each next number of pairs, where they adapt;
- 32768 tokens a step, at most 256 sequences: at small T a step is bound by the host's
  launches, not the GPU, so 256 short sequences cost about what 32 do and give each step
  8 times the examples; at large T a step holds a few long sequences of 256 queries each.

On one H200 the default sweep (9 numbers of pairs, both models) takes about 7 minutes, nearly
half of it at the first number of pairs (1500 steps a model, and the kernels compile); each
later number of pairs takes about 15 s for the SDM model and 8 s for the dense one.

It prints progress lines while it trains (each with the model's step and loss, then the whole
sweep's steps done of its total, time elapsed and time left), a table (pairs, sequence
length, each model's recall and training time) at the end, and writes a PNG plot of recall
against pairs (``--plot``; matplotlib is the optional extra ``plot``) and, with ``--json``,
the results, which ``benchmarks/table.py`` renders as Markdown and ``--from-json`` plots
again.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import inspect
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from benchmarks import _plot
from benchmarks._cli import command_parser
from sdm_ops._cli import add_device_option, positive_float, positive_int, seconds
from sdm_ops.layout import CHUNK_SIZES, HEAD_DIMS, MAX_ENTRIES

PROG = "python -m benchmarks.capacity"
MODELS = ("sdm", "dense")
BACKENDS = ("auto", "fla", "sdm")
EVAL_SEED = 1234
PARAM_TOLERANCE = 0.10  # the largest relative difference of the two layers' parameter counts


# ---------------------------------------------------------------------------
# The sweep's configuration
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One sweep: the task at each number of pairs, the two models and their training."""

    pairs: tuple[int, ...] = tuple(2**i for i in range(4, 13))  # 16 .. 4096
    max_queries: int = 256
    keys_per_pair: int = 4  # the key vocabulary at P pairs: keys_per_pair * P keys
    values: int = 256
    d_model: int = 256
    heads: int = 4
    head_dim: int = 64
    factors: tuple[int, ...] = (256, 256)
    topk: int = 8
    layers: int = 2
    chunk_size: int = 64
    steps: int = 400
    first_steps: int | None = 1500  # a new model's steps; None: twice ``steps``
    batch_tokens: int = 32768
    max_batch: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    eval_sequences: int = 256
    seed: int = 0
    dense_backend: str = "auto"
    warm_start: bool = True

    def num_keys(self, pairs: int) -> int:
        """The key vocabulary at ``pairs`` pairs."""
        return self.keys_per_pair * pairs

    @property
    def vocab(self) -> int:
        """Token ids of the whole sweep: the largest key vocabulary, then the values."""
        return self.num_keys(max(self.pairs)) + self.values

    @property
    def new_model_steps(self) -> int:
        return self.first_steps if self.first_steps is not None else 2 * self.steps

    @property
    def slots(self) -> int:
        return math.prod(self.factors)

    def task(self, pairs: int) -> mqar.MQARTask:
        return mqar.MQARTask(
            num_keys=self.num_keys(pairs),
            num_values=self.values,
            num_pairs=pairs,
            num_queries=min(pairs, self.max_queries),
            value_offset=self.num_keys(max(self.pairs)),
        )

    def batch_size(self, seq_len: int) -> int:
        """Sequences per step: ``batch_tokens`` tokens, at least 1, at most ``max_batch``."""
        return max(1, min(self.max_batch, self.batch_tokens // seq_len))

    def check(self) -> None:
        """ValueError naming the option that cannot run."""
        if not self.pairs or any(p < 1 for p in self.pairs):
            raise ValueError(f"pairs must be positive numbers, got {list(self.pairs)}")
        if self.head_dim % len(self.factors):
            raise ValueError(
                f"head_dim ({self.head_dim}) must be a multiple of the number of factors "
                f"({len(self.factors)}): the SDM layer's key_dim is head_dim / len(factors)"
            )
        for name in (
            "keys_per_pair",
            "max_queries",
            "values",
            "steps",
            "new_model_steps",
            "batch_tokens",
            "max_batch",
            "layers",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_sequences < 1:
            raise ValueError(f"eval_sequences must be positive, got {self.eval_sequences}")


# A few minutes on a CPU, most of them the dense layer's: its full addressing (W = R = 16 on
# the reference path) costs each step several times the SDM layer's top-4.
SMALL = Config(
    pairs=(4, 16),
    max_queries=32,
    values=32,
    d_model=32,
    heads=2,
    head_dim=16,
    factors=(32, 32),
    topk=4,
    layers=2,
    chunk_size=16,
    steps=100,
    first_steps=None,
    batch_tokens=256,
    max_batch=16,
    lr=1e-2,
    warmup=20,
    eval_sequences=64,
)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    d, s = Config(), SMALL
    epilog = (
        "Output: a header naming both layers and their parameter counts, progress\n"
        "lines while each model trains (its step and loss, then the whole sweep's steps\n"
        "done of its total, time elapsed and time left), a line per trained model, then\n"
        "the table. Without matplotlib it prints the table and says how to get the\n"
        f"plot ({_plot.INSTALL_HINT}).\n"
        f"--small: pairs {' '.join(map(str, s.pairs))}, d_model {s.d_model}, "
        f"{s.heads} heads of {s.head_dim},\nfactors {' '.join(map(str, s.factors))}, "
        f"top-{s.topk}, {2 * s.steps} steps new then {s.steps}: the sweep's code at a size a\n"
        "CPU manages, too short to learn recall; 16 minutes on 2 CPU cores shared with\n"
        "other work, most of it the dense layer's full addressing on the CPU reference path.\n"
        "On a GPU, float32 matmuls run in TF32 (torch.set_float32_matmul_precision)."
    )
    parser = command_parser(PROG, __doc__, epilog)
    task = parser.add_argument_group("task")
    task.add_argument(
        "--pairs",
        type=positive_int,
        nargs="+",
        metavar="P",
        help=f"numbers of key-value pairs (default {' '.join(map(str, d.pairs))})",
    )
    task.add_argument(
        "--max-queries",
        type=positive_int,
        metavar="N",
        help=f"queries a sequence at most: min(P, N) keys asked again (default {d.max_queries})",
    )
    task.add_argument(
        "--keys-per-pair",
        type=positive_int,
        metavar="N",
        help=f"key vocabulary at P pairs: N * P keys (default {d.keys_per_pair})",
    )
    task.add_argument(
        "--values", type=positive_int, metavar="N", help=f"value vocabulary (default {d.values})"
    )
    model = parser.add_argument_group("models (the same for both where it applies)")
    model.add_argument(
        "--d-model", type=positive_int, metavar="N", help=f"model width (default {d.d_model})"
    )
    model.add_argument(
        "--heads", type=positive_int, metavar="N", help=f"memory heads (default {d.heads})"
    )
    model.add_argument(
        "--head-dim",
        type=int,
        choices=HEAD_DIMS,
        metavar="N",
        help=f"value width of a head, and the dense layer's key width, one of "
        f"{', '.join(map(str, HEAD_DIMS))} (default {d.head_dim})",
    )
    model.add_argument(
        "--factors",
        type=positive_int,
        nargs="+",
        metavar="F",
        help=f"the SDM layer's product-key factors: prod(F) slots a head (default "
        f"{' '.join(map(str, d.factors))}: {d.slots} slots); their mean near d_model keeps "
        f"the parameter counts equal",
    )
    model.add_argument(
        "--topk",
        type=positive_int,
        metavar="K",
        help=f"slots the SDM layer reads and writes a token (default {d.topk})",
    )
    model.add_argument(
        "--layers", type=positive_int, metavar="N", help=f"blocks per model (default {d.layers})"
    )
    model.add_argument(
        "--chunk-size",
        type=int,
        choices=CHUNK_SIZES,
        metavar="N",
        help=f"the recurrences' chunk, one of {', '.join(map(str, CHUNK_SIZES))} "
        f"(default {d.chunk_size})",
    )
    model.add_argument(
        "--dense-backend",
        choices=BACKENDS,
        help="the dense layer's recurrence: fla (fla-core's chunk_delta_rule, CUDA), sdm "
        "(sparse_delta_memory addressing every slot) or auto (fla on a GPU when it "
        "imports, else sdm; the default)",
    )
    train = parser.add_argument_group("training (the same for both models)")
    train.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help=f"steps of a model continuing at each next number of pairs (default {d.steps})",
    )
    train.add_argument(
        "--first-steps",
        type=positive_int,
        metavar="N",
        help="steps of a new model: at the first number of pairs, or at every one with "
        f"--from-scratch (default {d.first_steps}; with --small twice --steps)",
    )
    train.add_argument(
        "--batch-tokens",
        type=positive_int,
        metavar="N",
        help=f"tokens per step: batch = N // T sequences, 1 to --max-batch "
        f"(default {d.batch_tokens})",
    )
    train.add_argument(
        "--max-batch",
        type=positive_int,
        metavar="N",
        help=f"sequences per step at most (default {d.max_batch})",
    )
    train.add_argument(
        "--lr",
        type=positive_float,
        metavar="LR",
        help=f"AdamW's peak learning rate (default {d.lr:g})",
    )
    train.add_argument(
        "--eval-sequences",
        type=positive_int,
        metavar="N",
        help=f"held-out sequences each model is evaluated on (default {d.eval_sequences})",
    )
    train.add_argument(
        "--seed",
        type=int,
        help="seed of the models' initialization and of the training batches (default 0)",
    )
    train.add_argument(
        "--from-scratch",
        action="store_true",
        help="train a new model at each number of pairs (default: continue from the model "
        "trained at the previous one)",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="the small preset for a CPU (see below); options given as well override it",
    )
    add_device_option(parser)
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="CPU threads of PyTorch's operators (default: PyTorch's own); 1 helps on a "
        "busy machine",
    )
    parser.add_argument(
        "--log-interval",
        type=seconds,
        default=5.0,
        metavar="SECONDS",
        help="seconds between progress lines of a training run (default 5)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--plot",
        default="capacity.png",
        metavar="PATH",
        help="the PNG of recall against pairs (default capacity.png; needs matplotlib)",
    )
    out.add_argument("--no-plot", action="store_true", help="write no plot")
    out.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH (python benchmarks/table.py PATH "
        "renders them as a Markdown table)",
    )
    out.add_argument(
        "--from-json",
        metavar="PATH",
        help="train nothing: print the table of a results file written by --json and "
        "plot it (to --plot)",
    )
    return parser


OPTION_FIELDS = (
    "pairs",
    "max_queries",
    "keys_per_pair",
    "values",
    "d_model",
    "heads",
    "head_dim",
    "factors",
    "topk",
    "layers",
    "chunk_size",
    "dense_backend",
    "steps",
    "first_steps",
    "batch_tokens",
    "max_batch",
    "lr",
    "eval_sequences",
    "seed",
)


def config_from_args(args: argparse.Namespace) -> Config:
    """The preset (``--small`` or the default) with the options given."""
    given = {f: getattr(args, f) for f in OPTION_FIELDS if getattr(args, f) is not None}
    for f in ("pairs", "factors"):
        if f in given:
            given[f] = tuple(given[f])
    if args.from_scratch:
        given["warm_start"] = False
    return dataclasses.replace(SMALL if args.small else Config(), **given)


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sdm_ops.examples import mqar
from sdm_ops.nn import SparseDeltaMemory
from sdm_ops.recurrence import sparse_delta_memory

# ---------------------------------------------------------------------------
# The dense delta rule
# ---------------------------------------------------------------------------


@functools.cache
def fla_delta_rule() -> tuple[Callable | None, str | None]:
    """(fla-core's ``chunk_delta_rule``, None), or (None, why it does not import); tried
    once."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
    except Exception as e:  # noqa: BLE001 - a missing or broken optional install
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return None, f"{type(e).__name__}: {first}"
    return chunk_delta_rule, None


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """The dense layer's recurrence for ``backend`` on ``device``: ``"fla"`` or ``"sdm"``.
    ``"auto"`` is fla's ``chunk_delta_rule`` on a GPU when fla-core imports, else the
    package's own full addressing; ``"fla"`` without fla-core or a GPU raises ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    cuda = torch.device(device).type == "cuda"
    if backend == "sdm":
        return "sdm"
    if backend == "auto":
        return "fla" if cuda and fla_delta_rule()[0] is not None else "sdm"
    fn, why = fla_delta_rule()
    if fn is None:
        raise ValueError(f"backend 'fla' needs fla-core (pip install fla-core): {why}")
    if not cuda:
        raise ValueError(f"backend 'fla' runs on a CUDA device, not {device}")
    return "fla"


BACKEND_NAMES = {
    "fla": "fla chunk_delta_rule",
    "sdm": "sparse_delta_memory, full addressing",
}


class DenseDeltaRule(nn.Module):
    """DeltaNet: ``x [B, T, d_model] -> y [B, T, d_model]`` with a dense ``[head_dim,
    head_dim]`` state per head, from zero.

    Per head, token t projects a query ``q_t`` and a key ``k_t`` (each L2-normalized), a value
    ``v_t``, a strength ``beta_t = sigmoid(.)`` and an output gate ``g_t``; the state S
    follows the delta rule and is read after the write (fla's kernels take q, k, v and beta
    in bfloat16, the package's in float32)::

        S = S + beta_t k_t (v_t - S^T k_t)^T
        o_t = S^T q_t

    and ``y = o_proj(o * 2 sigmoid(g))`` over the heads. The gate brings the parameter count
    to that of a :class:`SparseDeltaMemory` with ``key_dim * len(factors) = head_dim`` and
    ``mean(factors) = d_model``; its projection starts at zero, so the layer starts as plain
    DeltaNet (a gate of 1) and learns to gate from there (a randomly initialized SiLU gate,
    as in fla's DeltaNet layer, slows this layer's learning of recall several times over).

    Args:
        d_model: input and output width.
        heads: number of heads.
        head_dim: the key and value width of each head: the state is ``head_dim x head_dim``.
        backend: ``"fla"`` (fla-core's ``chunk_delta_rule``, CUDA), ``"sdm"``
            (:func:`sdm_ops.sparse_delta_memory` addressing all ``head_dim`` slots, any
            device; head_dim at most 64) or ``"auto"`` (fla on a GPU when it imports, else
            sdm), chosen at each call from the input's device.
        chunk_size: the chunk of the ``"sdm"`` recurrence.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        head_dim: int,
        backend: str = "auto",
        chunk_size: int = 64,
    ):
        super().__init__()
        for name, value in (("d_model", d_model), ("heads", heads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {list(HEAD_DIMS)}, got {head_dim}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
        if backend == "sdm" and head_dim > MAX_ENTRIES:
            raise ValueError(
                f"head_dim must be at most {MAX_ENTRIES} with backend 'sdm' (one write entry "
                f"per state row), got {head_dim}"
            )
        if chunk_size not in CHUNK_SIZES:
            raise ValueError(f"chunk_size must be one of {list(CHUNK_SIZES)}, got {chunk_size}")
        self.d_model, self.heads, self.head_dim = d_model, heads, head_dim
        self.backend, self.chunk_size = backend, chunk_size
        width = heads * head_dim
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.b_proj = nn.Linear(d_model, heads)
        self.g_proj = nn.Linear(d_model, width, bias=False)
        nn.init.zeros_(self.g_proj.weight)  # a gate of 2 sigmoid(0) = 1 at first
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.heads}, head_dim={self.head_dim}, "
            f"backend={self.backend!r}"
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape [B, T, d_model = {self.d_model}], got {list(x.shape)}"
            )
        B, T, _ = x.shape
        H, D = self.heads, self.head_dim
        q = F.normalize(self.q_proj(x).view(B, T, H, D), dim=-1)
        k = F.normalize(self.k_proj(x).view(B, T, H, D), dim=-1)
        v = self.v_proj(x).view(B, T, H, D)
        beta = torch.sigmoid(self.b_proj(x))
        if resolve_backend(self.backend, x.device) == "fla":
            chunk_delta_rule, _ = fla_delta_rule()
            options = {"scale": 1.0}  # q and k are unit vectors already
            if "head_first" in inspect.signature(chunk_delta_rule).parameters:
                options["head_first"] = False  # [B, T, H, D], whatever the version's default
            # fla's chunk_delta_rule refuses float32 inputs: bfloat16 in, float32 inside.
            half = [t.to(torch.bfloat16) for t in (q, k, v, beta)]
            o = chunk_delta_rule(*half, **options)[0].to(x.dtype)
        else:
            if D > MAX_ENTRIES:
                raise ValueError(
                    f"head_dim {D} needs fla-core on a GPU: the full addressing writes at "
                    f"most {MAX_ENTRIES} slots a token"
                )
            slots = torch.arange(D, device=x.device).expand(B, T, H, D)
            state = x.new_zeros(H, D, D)
            o, _ = sparse_delta_memory(
                v, beta, slots, k, slots, q, state, chunk_size=self.chunk_size
            )
        gate = 2 * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o.reshape(B, T, H * D) * gate)


# ---------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------


def memory_layer(kind: str, cfg: Config) -> nn.Module:
    """The memory layer of model ``kind`` ("sdm" or "dense")."""
    if kind == "sdm":
        layer = SparseDeltaMemory(
            cfg.d_model,
            heads=cfg.heads,
            head_dim=cfg.head_dim,
            factors=cfg.factors,
            read_topk=cfg.topk,
            write_topk=cfg.topk,
            use_decay=False,
            chunk_size=cfg.chunk_size,
            key_dim=cfg.head_dim // len(cfg.factors),
        )
        layer.bank.requires_grad_(False)  # a zero initial state, as the dense layer's
        return layer
    if kind == "dense":
        return DenseDeltaRule(
            cfg.d_model,
            cfg.heads,
            cfg.head_dim,
            backend=cfg.dense_backend,
            chunk_size=cfg.chunk_size,
        )
    raise ValueError(f"kind must be one of {list(MODELS)}, got {kind!r}")


def trained_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def check_parameter_counts(cfg: Config) -> dict[str, int]:
    """The two memory layers' trained parameter counts; ValueError when they differ by more
    than ``PARAM_TOLERANCE``."""
    with torch.device("meta"):
        counts = {kind: trained_parameters(memory_layer(kind, cfg)) for kind in MODELS}
    a, b = counts.values()
    if abs(a - b) > PARAM_TOLERANCE * max(a, b):
        raise ValueError(
            f"the memory layers' parameter counts differ by more than "
            f"{PARAM_TOLERANCE:.0%} (sdm {counts['sdm']}, dense {counts['dense']}): choose "
            f"factors whose mean is near d_model ({cfg.d_model}), as in --factors "
            f"{cfg.d_model} {cfg.d_model}"
        )
    return counts


class RecallModel(nn.Module):
    """Token embedding -> ``layers`` blocks (``sdm_ops.examples.mqar.Block``: token shift, the
    memory layer, an MLP) -> RMSNorm -> logits. ``forward(tokens, last)`` gives the logits of the
    last ``last`` positions only (the queries), or of every position."""

    def __init__(self, vocab: int, d_model: int, layers: int, memory: Callable[[], nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(mqar.Block(d_model, memory()) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: Tensor, last: int | None = None) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if last is not None:
            x = x[:, -last:]
        return self.head(self.norm(x))


def build_model(kind: str, cfg: Config, task: mqar.MQARTask) -> RecallModel:
    """Model ``kind`` initialized from ``cfg.seed`` (the embedding, made first, is the same in
    both models)."""
    torch.manual_seed(cfg.seed)
    return RecallModel(task.vocab, cfg.d_model, cfg.layers, lambda: memory_layer(kind, cfg))


def eval_batch(task: mqar.MQARTask, sequences: int) -> tuple[Tensor, Tensor]:
    """The held-out sequences of ``task`` (tokens, labels; on the CPU), the same for every
    model: drawn from their own seed, apart from the training batches."""
    return task.batch(sequences, torch.Generator().manual_seed(EVAL_SEED))


@torch.no_grad()
def recall(
    model: RecallModel,
    tokens: Tensor,
    labels: Tensor,
    batch_size: int,
    device: torch.device | str,
) -> float:
    """The fraction of query positions (the last ``num_queries``, labels not -100) whose most
    likely token is the stored value."""
    was_training = model.training
    model.eval()
    queries = int((labels[0] != mqar.IGNORE).sum())
    hits = total = 0
    for start in range(0, tokens.shape[0], batch_size):
        t = tokens[start : start + batch_size].to(device)
        want = labels[start : start + batch_size, -queries:].to(device)
        hits += int((model(t, queries).argmax(-1) == want).sum())
        total += want.numel()
    model.train(was_training)
    return hits / total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Trained:
    """One model trained at one number of pairs."""

    kind: str
    pairs: int
    seq_len: int
    batch: int
    queries: int
    steps: int
    recall: float
    train_s: float
    final_loss: float
    model: RecallModel = field(repr=False)

    def as_json(self) -> dict:
        d = dataclasses.asdict(self)
        del d["model"]
        d["model"] = d.pop("kind")
        return d


def train_point(
    kind: str,
    pairs: int,
    cfg: Config,
    device: torch.device | str,
    *,
    model: RecallModel | None = None,
    log: Callable[[str], None] = print,
    log_interval: float = 5.0,
    status: Callable[[int], str] | None = None,
) -> Trained:
    """Train model ``kind`` on ``pairs`` pairs (AdamW, linear warmup, cosine decay; batches
    drawn from ``cfg.seed`` and ``pairs``, the same for both models) and evaluate it on
    :func:`eval_batch`. ``model`` continues training a model of this kind (updated in place)
    for ``cfg.steps`` steps; without it, a new one (:func:`build_model`) trains
    ``cfg.new_model_steps``. Progress lines go to ``log``, each prefixed with the model and
    the pairs, and end with ``status(step)`` where given (see :class:`mqar.Progress`)."""
    device = torch.device(device)
    task = cfg.task(pairs)
    B, Q = cfg.batch_size(task.seq_len), task.num_queries
    steps = cfg.steps if model is not None else cfg.new_model_steps
    if model is None:
        model = build_model(kind, cfg, task)
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    warmup = cfg.warmup
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
        ),
    )
    g = torch.Generator().manual_seed(cfg.seed * 65537 + pairs)
    prefix = f"  {kind} {pairs} pairs: "
    progress = mqar.Progress(
        steps, interval=log_interval, log=lambda s: log(prefix + s), status=status
    )
    _sync(device)
    progress.begin()
    loss_value = float("nan")
    for step in range(1, steps + 1):
        tokens, labels = task.batch(B, g, device)
        want = labels[:, -Q:]
        logits = model(tokens, Q)
        loss = F.cross_entropy(logits.flatten(0, 1), want.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        progress.update(step, loss_value, int((logits.argmax(-1) == want).sum()), want.numel())
    _sync(device)
    train_s = progress.elapsed()
    tokens, labels = eval_batch(task, cfg.eval_sequences)
    acc = recall(model, tokens, labels, B, device)
    return Trained(kind, pairs, task.seq_len, B, Q, steps, acc, train_s, loss_value, model)


class SweepProgress:
    """The whole sweep's progress, for the lines of each run (:meth:`status`): the steps done
    of the sweep's total, the time elapsed and an estimate of the time left, each model's steps
    left at its mean time a step so far (evaluations included; a model that has not run yet
    at the mean of the steps so far). :meth:`begin` and :meth:`end` bracket each run."""

    def __init__(
        self, runs: Sequence[tuple[str, int]], clock: Callable[[], float] = time.perf_counter
    ):
        self.clock = clock
        self.todo: dict[str, int] = {}  # the sweep's steps of each model
        for kind, steps in runs:
            self.todo[kind] = self.todo.get(kind, 0) + steps
        self.total = sum(self.todo.values())
        self.done = dict.fromkeys(self.todo, 0)
        self.spent = dict.fromkeys(self.todo, 0.0)
        self.kind = runs[0][0] if runs else ""
        self.start = self.run_start = clock()

    def begin(self, kind: str) -> None:
        self.kind, self.run_start = kind, self.clock()

    def end(self, steps: int) -> None:
        self.done[self.kind] += steps
        self.spent[self.kind] += self.clock() - self.run_start

    def status(self, step: int) -> str:
        """``sweep D/N steps  elapsed E s  about L s left``, ``step`` steps into the run."""
        now = self.clock()
        done, spent = dict(self.done), dict(self.spent)
        done[self.kind] += step
        spent[self.kind] += now - self.run_start
        mean = sum(spent.values()) / max(sum(done.values()), 1)
        left = sum(
            (self.todo[k] - done[k]) * (spent[k] / done[k] if done[k] else mean) for k in self.todo
        )
        return (
            f"sweep {sum(done.values())}/{self.total} steps  elapsed {now - self.start:.0f} s  "
            f"about {left:.0f} s left"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def sweep(
    cfg: Config,
    device: torch.device | str,
    *,
    log: Callable[[str], None] = print,
    log_interval: float = 5.0,
    argv: Sequence[str] = (),
) -> tuple[dict, list[Trained]]:
    """Train and evaluate both models at each number of pairs, in the order given: (results,
    trained), the results as ``--json`` writes them, the trained models in the order run
    (for each number of pairs, sdm then dense). With ``cfg.warm_start`` each model starts
    from a copy of itself as trained at the previous number of pairs (a curriculum: from
    scratch, training at thousands of pairs finds no signal in a few hundred steps)."""
    import triton

    cfg.check()
    device = torch.device(device)
    counts = check_parameter_counts(cfg)
    backend = resolve_backend(cfg.dense_backend, device)
    S = cfg.slots
    models = {
        "sdm": {
            "label": f"SDM, {S} slots x {cfg.head_dim} per head, top-{cfg.topk}",
            "memory_params": counts["sdm"],
            "state_per_head": S * cfg.head_dim,
        },
        "dense": {
            "label": f"dense delta rule, {cfg.head_dim} x {cfg.head_dim} per head",
            "backend": BACKEND_NAMES[backend],
            "memory_params": counts["dense"],
            "state_per_head": cfg.head_dim * cfg.head_dim,
        },
    }
    log(
        f"capacity: multi-query associative recall at {', '.join(map(str, cfg.pairs))} pairs "
        f"({cfg.keys_per_pair} keys a pair, {cfg.values} values, up to {cfg.max_queries} "
        f"queries) on {device}; d_model {cfg.d_model}, {cfg.heads} heads of {cfg.head_dim}, "
        f"{cfg.layers} blocks; {training_summary(dataclasses.asdict(cfg))}"
    )
    log(f"  sdm:   {models['sdm']['label']}; {counts['sdm']} parameters in the memory layer")
    log(
        f"  dense: {models['dense']['label']} ({BACKEND_NAMES[backend]}); "
        f"{counts['dense']} parameters in the memory layer"
    )
    trained: list[Trained] = []
    last: dict[str, Trained] = {}
    start = time.perf_counter()
    runs = [(p, kind) for p in cfg.pairs for kind in MODELS]
    steps = [
        cfg.new_model_steps if i < len(MODELS) or not cfg.warm_start else cfg.steps
        for i in range(len(runs))
    ]
    progress = SweepProgress([(kind, n) for (_, kind), n in zip(runs, steps)])
    for i, (pairs, kind) in enumerate(runs, 1):
        task = cfg.task(pairs)
        previous = last.get(kind) if cfg.warm_start else None
        origin = "new" if previous is None else f"from {previous.pairs} pairs"
        log(
            f"[{i}/{len(runs)}] {kind} at {pairs} pairs ({origin}, {steps[i - 1]} steps): "
            f"T = {task.seq_len}, batch {cfg.batch_size(task.seq_len)} "
            f"({time.perf_counter() - start:.0f} s so far)"
        )
        start_from = None if previous is None else copy.deepcopy(previous.model)
        progress.begin(kind)
        t = train_point(
            kind,
            pairs,
            cfg,
            device,
            model=start_from,
            log=log,
            log_interval=log_interval,
            status=progress.status,
        )
        progress.end(t.steps)
        last[kind] = t
        log(f"  {kind} {pairs} pairs: recall {t.recall:.4f}, trained in {t.train_s:.1f} s")
        trained.append(t)
    log(f"swept in {time.perf_counter() - start:.0f} s")
    results = {
        "command": PROG,
        "argv": list(argv),
        "device": _device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "config": dataclasses.asdict(cfg),
        "models": models,
        "points": [t.as_json() for t in trained],
    }
    results["sections"] = [table_section(results)]
    return results, trained


def training_summary(cfg: dict) -> str:
    """How the models were trained, from a config as ``dataclasses.asdict`` gives it."""
    first = cfg["first_steps"] if cfg.get("first_steps") is not None else 2 * cfg["steps"]
    if cfg.get("warm_start", True):
        return (
            f"{first} steps at the first number of pairs, then {cfg['steps']} at each next "
            f"one, continuing"
        )
    return f"{first} steps from scratch at each number of pairs"


def _by_pairs(results: dict) -> dict[int, dict[str, dict]]:
    rows: dict[int, dict[str, dict]] = {}
    for p in results["points"]:
        rows.setdefault(p["pairs"], {})[p["model"]] = p
    return dict(sorted(rows.items()))


def table_section(results: dict) -> dict:
    """The results as one section of ``benchmarks/table.py``'s format (title, columns, rows
    keyed by the columns, notes)."""
    models = results["models"]
    columns = [{"key": "seq_len", "header": "T", "format": "d"}]
    columns += [{"key": f"{m}_recall", "header": f"{m} recall", "format": ".3f"} for m in MODELS]
    columns += [{"key": f"{m}_train_s", "header": f"{m} train s", "format": ".1f"} for m in MODELS]
    rows = []
    for pairs, by_model in _by_pairs(results).items():
        row = {"case": f"{pairs} pairs"}
        for m, p in by_model.items():
            row["seq_len"] = p["seq_len"]
            row[f"{m}_recall"] = p["recall"]
            row[f"{m}_train_s"] = p["train_s"]
        rows.append(row)
    cfg = results["config"]
    return {
        "name": "capacity",
        "title": (
            f"recall against stored pairs, d_model {cfg['d_model']}, {cfg['heads']} heads; "
            f"{training_summary(cfg)}"
        ),
        "columns": columns,
        "rows": rows,
        "notes": [
            f"sdm: {models['sdm']['label']}, {models['sdm']['memory_params']} parameters",
            f"dense: {models['dense']['label']} ({models['dense']['backend']}), "
            f"{models['dense']['memory_params']} parameters",
        ],
    }


def format_table(results: dict) -> str:
    """The results table as text: pairs, T, each model's recall and training time."""
    section = table_section(results)
    headers = ["pairs"] + [c["header"] for c in section["columns"]]
    lines = [[r["case"].split()[0]] for r in section["rows"]]
    for line, row in zip(lines, section["rows"]):
        for c in section["columns"]:
            v = row.get(c["key"])
            line.append("" if v is None else format(v, c["format"]))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def plot_recall(results: dict, path: str) -> str:
    """A PNG of recall against pairs (log2 axis), one line per model; returns ``path``.
    ImportError when matplotlib is missing."""
    fig = _plot.new_figure()
    ax = fig.add_subplot()
    by_pairs = _by_pairs(results)
    for m in MODELS:
        xs = [p for p, by in by_pairs.items() if m in by]
        ys = [by_pairs[p][m]["recall"] for p in xs]
        label = results["models"][m]["label"]
        ax.plot(xs, ys, marker="o", label=label)
    chance = 1 / results["config"]["values"]
    ax.axhline(
        chance, color="gray", linestyle=":", label=f"chance (1/{results['config']['values']})"
    )
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("key-value pairs stored (log2)")
    ax.set_ylabel("recall")
    cfg = results["config"]
    ax.set_title(
        f"Recall against stored pairs: d_model {cfg['d_model']}, {cfg['heads']} heads\n"
        f"{training_summary(cfg)}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _plot.save(fig, path)


# ---------------------------------------------------------------------------
# Outputs and main
# ---------------------------------------------------------------------------


def write_outputs(results: dict, args: argparse.Namespace, log=print) -> None:
    """The table, then the plot (or how to get it) and the JSON file."""
    log("")
    log(format_table(results))
    if args.json and not args.from_json:
        folder = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(folder, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
        log(f"results written to {args.json}")
    if args.no_plot:
        return
    if not _plot.available():
        log(f"no plot written: it needs matplotlib ({_plot.INSTALL_HINT})")
        return
    plot_recall(results, args.plot)
    log(f"plot written to {args.plot}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.json and os.path.isdir(args.json):
        parser.error(f"--json takes a file path, not the folder {args.json}")
    if args.from_json:
        with open(args.from_json) as f:
            write_outputs(json.load(f), args)
        return 0
    cfg = config_from_args(args)
    args.device = args.device or mqar.default_device()
    try:
        cfg.check()
        check_parameter_counts(cfg)
        resolve_backend(cfg.dense_backend, args.device)
    except ValueError as e:
        parser.error(str(e))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls, for both models alike
    results, _ = sweep(cfg, args.device, log_interval=args.log_interval, argv=argv)
    write_outputs(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
