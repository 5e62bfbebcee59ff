"""Benchmarks of sdm_ops on a CUDA GPU: ``python -m benchmarks.bench [--only SECTIONS]``.

The reference workload: B=8, T=4096, H=8, D=64, S=65536, W=R=8, chunk 64, bfloat16 values.
Sections (``--only``, comma-separated; the first five run by default):

- ``main``: per bank case (float32 with and without decay, bfloat16 with decay) the forward
  without autograd (eager, replayed from a CUDA graph, the host's time until an eager call
  returns), its CUDA operations, the in-place forward ``sparse_delta_memory_`` replayed, the
  forward+backward eager and replayed with its peak memory, each against its bytes floor at
  the copy bandwidth measured in the same run, and the stock-PyTorch reference forward.
- ``snapshots``: forward+backward per snapshot mode (float32 bank, decay).
- ``decode``: one decode step (T=1, every stream) of ``sparse_delta_memory_``, replayed.
- ``host``: eager calls' host cost (decode, the layer's ``step_`` and forward) beside their
  CUDA-graph replay and fla-core's ``fused_recurrent_delta_rule`` at T=1, and the share of a
  layer training step the GPU is busy.
- ``peers``: fla-core's ``chunk_delta_rule`` and ``chunk_kda`` at the same B, T, H and
  K = V = D, when fla-core is installed.
- ``packed``: a packed batch of B sequences of mixed lengths (``cu_seqlens``) against the same
  sequences padded to [B, T].
- ``addressing``: chunk sizes 32 to 128, and hot sets of S/16 and S/256 slots.
- ``scaling``: forward+backward with a shared bank requiring grad (the layer's case) over S
  from 2^16 to 2^20, with and without the final state, time and peak memory.
- ``topk``: ``product_key_topk`` on 262144 rows, factors (256, 256), k 8 and 32, against the
  brute force.
- ``profile``: the CUDA time of each kernel of one forward+backward.
- ``snapshot-errors``: each snapshot mode's gradient error against the exact one (the only
  section that also runs on the CPU).
- ``state``: time per token against the state's size per head: the SDM forward, in-place
  forward and forward+backward for S = 2^12 to 2^22 slots (B x T tokens a call, B lowered
  where a bank would pass 8 GiB; float32 bank, no decay), beside fla-core's
  ``chunk_delta_rule`` (a K x D state per head) for K = 64 to 256. ``--plot PATH`` runs it
  and draws it as a PNG (matplotlib, ``pip install 'sdm_ops[plot]'``); ``--plot PATH
  --from-json FILE`` draws a results file's section without a GPU.

Times are medians of ``triton.testing.do_bench`` (``benchmarks._timing``); "graph" columns are
the call replayed from a CUDA graph, "x floor" the graph time over the floor.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
from functools import partial

from benchmarks._cli import command_parser
from sdm_ops.layout import CHUNK_SIZES, HEAD_DIMS

PROG = "python -m benchmarks.bench"
SECTIONS = (
    "main",
    "snapshots",
    "decode",
    "peers",
    "packed",
    "addressing",
    "scaling",
    "topk",
    "profile",
    "snapshot-errors",
    "state",
    "host",
)
DEFAULT_SECTIONS = SECTIONS[:5]
SNAPSHOTS = ("none", "bf16", "fp8", "int4")
FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or text!r}; choose from {', '.join(SECTIONS)}"
        )
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive integer, not {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    epilog = (
        "Output: one table per section on stdout, each row printed once measured,\n"
        "and a progress line per case on stderr. Figures are milliseconds unless a\n"
        "column says otherwise. --json writes every figure with the device and the\n"
        "versions; benchmarks/table.py in the repository renders such a file as\n"
        "Markdown tables. --plot PATH writes the state section as a PNG. Without a\n"
        "CUDA GPU it exits with status 2 (unless --only snapshot-errors, or --plot\n"
        "with --from-json)."
    )
    parser = command_parser(PROG, __doc__, epilog)
    shape = parser.add_argument_group("workload (the reference workload by default)")
    for name, default, what in (
        ("B", 8, "sequences in the batch"),
        ("T", 4096, "tokens each"),
        ("H", 8, "heads"),
        ("S", 65536, "bank slots per head"),
        ("W", 8, "write entries per token and head"),
        ("R", 8, "read entries per token and head"),
    ):
        shape.add_argument(
            f"--{name}",
            type=_positive,
            default=default,
            metavar="N",
            help=f"{what} (default {default})",
        )
    shape.add_argument(
        "--D",
        type=int,
        default=64,
        choices=HEAD_DIMS,
        metavar="N",
        help=f"value width, one of {', '.join(map(str, HEAD_DIMS))} (default 64)",
    )
    shape.add_argument(
        "--chunk-size",
        type=int,
        default=64,
        choices=CHUNK_SIZES,
        metavar="N",
        help="tokens per chunk of the recurrence, one of "
        f"{', '.join(map(str, CHUNK_SIZES))} (default 64)",
    )
    parser.add_argument(
        "--only",
        type=_sections,
        default=None,
        metavar="SECTIONS",
        help="comma-separated sections to run, in the order given, of: "
        f"{', '.join(SECTIONS)} (default {','.join(DEFAULT_SECTIONS)}; with --plot "
        "alone: state)",
    )
    parser.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the stock-PyTorch reference forward in the main section",
    )
    parser.add_argument(
        "--rep-ms",
        type=float,
        default=100.0,
        metavar="MS",
        help="milliseconds of repeated calls per measurement, do_bench's rep "
        "(default 100; at least one call)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON to PATH (rewritten after each "
        "section), e.g. benchmarks/results/NAME.json",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of the state section (time per token against state size) to "
        "PATH, running that section too (needs matplotlib: pip install 'sdm_ops[plot]')",
    )
    parser.add_argument(
        "--from-json",
        metavar="FILE",
        help="with --plot: measure nothing, plot the state section of FILE (a --json "
        "file); needs no GPU",
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch

import sdm_ops
from benchmarks import _plot, _timing
from sdm_ops import reference as ref

# ---------------------------------------------------------------------------
# Workloads and their bytes floors
# ---------------------------------------------------------------------------


def make_workload(
    B,
    T,
    H,
    D,
    S,
    W,
    R,
    *,
    decay: bool,
    bank_dtype,
    seed: int = 0,
    dev: str = "cuda",
    hot: int | None = None,
):
    """Random inputs of the recurrence; every index uniform over the S slots, or with ``hot``
    over a fixed random set of ``hot`` of them (addressing that favours some slots, as a
    trained model's may)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    slots = None if hot is None else torch.randperm(S, device=dev, generator=g)[:hot]

    def idx(*shape):
        if slots is None:
            return torch.randint(0, S, shape, device=dev, generator=g)
        return slots[torch.randint(0, hot, shape, device=dev, generator=g)]

    args = {
        "v": torch.randn(B, T, H, D, device=dev, generator=g).to(torch.bfloat16),
        "beta": torch.rand(B, T, H, device=dev, generator=g),
        "write_idx": idx(B, T, H, W),
        "write_w": torch.rand(B, T, H, W, device=dev, generator=g) / W**0.5,
        "read_idx": idx(B, T, H, R),
        "read_w": torch.rand(B, T, H, R, device=dev, generator=g) / R**0.5,
        "bank": (torch.randn(B, H, S, D, device=dev, generator=g) * 0.1).to(bank_dtype),
    }
    if decay:
        args["decay"] = 0.9 + 0.1 * torch.rand(B, T, H, W, device=dev, generator=g)
    return args


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def floor_bytes(a: dict, in_place: bool = False, final: bool = False) -> int:
    """Bytes a forward without autograd must move at least: its inputs once, out, the returned
    bank with ``final`` (read and written), each entry's bank row gathered once and each
    written row written once (it keeps no snapshot). ``in_place`` updates the bank it is
    given."""
    B, T, H, D = a["v"].shape
    W, R = a["write_idx"].shape[-1], a["read_idx"].shape[-1]
    bank = a["bank"]
    row = D * bank.element_size()
    inputs = sum(_size(t) for t in a.values()) - _size(bank)
    entries = B * T * H
    copy = 2 * _size(bank) if final and not in_place else 0
    return inputs + _size(a["v"]) + copy + entries * (W + R) * row + entries * W * row


def floor_bytes_fwd_bwd(a: dict, final: bool = False) -> int:
    """Bytes a forward+backward must move at least: the forward's floor (``floor_bytes``), the
    output's gradient (and with ``final`` the final bank's) read, a gradient of every float
    input written (its size and dtype), the indices read again and each entry's bank row read
    again (the backward needs every entry's row as it was at its chunk's start, from a
    snapshot or recomputed)."""
    B, T, H, D = a["v"].shape
    W, R = a["write_idx"].shape[-1], a["read_idx"].shape[-1]
    grads_in = _size(a["v"]) + (_size(a["bank"]) if final else 0)
    grads_out = sum(_size(a[k]) for k in FLOATS if k in a)
    indices = _size(a["write_idx"]) + _size(a["read_idx"])
    return (
        floor_bytes(a, final=final)
        + grads_in
        + grads_out
        + indices
        + B * T * H * (W + R) * D * a["bank"].element_size()
    )


def packed_workload(B, T, H, D, S, W, R) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(workload, cu_seqlens on the GPU, lengths on the CPU) of B sequences of mixed lengths
    packed into one [1, B * T / 2] batch (lengths from T / 8 to T), float32 bank with decay,
    one bank per sequence."""
    lengths = torch.linspace(T // 8, T, B).round().long()
    lengths = (lengths * (B * T // 2) / lengths.sum()).long().clamp(1, T)
    packed = make_workload(
        1, int(lengths.sum()), H, D, S, W, R, decay=True, bank_dtype=torch.float32
    )
    packed["bank"] = packed["bank"].expand(B, -1, -1, -1).contiguous()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to("cuda")
    return packed, cu, lengths


def shared_entries(a: dict, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk ([B, H, N] each): how many of its entries (write and read, padding aside)
    name a slot that another entry of the chunk names too (the entries phase 1 must pair), and
    the most entries on one slot. A chunk with more than ``chunk_prepare_sparse.COMPACT``
    entries in one hash bucket (on one slot, unless two slots share a hash) takes phase 1's
    dense kernels."""
    idx = torch.cat([a["write_idx"], a["read_idx"]], dim=-1)  # [B, T, H, E]
    B, T, H, E = idx.shape
    C = chunk_size
    N = -(-T // C)
    idx = torch.nn.functional.pad(idx, (0, 0, 0, 0, 0, N * C - T), value=-1)
    idx = idx.view(B, N, C, H, E).permute(0, 3, 1, 2, 4).reshape(B, H, N, C * E)
    s = idx.sort(dim=-1).values
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
    shared = torch.zeros_like(s, dtype=torch.bool)
    shared[..., 1:] |= dup
    shared[..., :-1] |= dup
    # An entry's place in its run of equal slots: its index less the index of the run's start.
    at = torch.arange(s.shape[-1], device=s.device).expand_as(s)
    start = torch.where(torch.nn.functional.pad(dup, (1, 0), value=False), 0, at)
    run = at - start.cummax(-1).values + 1
    return shared.sum(-1), torch.where(s >= 0, run, 0).amax(-1)


# ---------------------------------------------------------------------------
# The calls timed
# ---------------------------------------------------------------------------


def forward_fn(a: dict, chunk_size: int, final: bool = False, **kw):
    """A call of the forward of ``sparse_delta_memory`` on ``a``, without autograd; with
    ``final`` it returns the final bank."""

    def fwd():
        with torch.no_grad():
            return sdm_ops.sparse_delta_memory(
                **a, chunk_size=chunk_size, **kw, output_final_state=final
            )

    return fwd


def train_forward_fn(a: dict, chunk_size: int, **kw):
    """A call of the training forward of ``sparse_delta_memory`` on ``a``: every float input
    requires grad, so it keeps what the backward needs (no final bank)."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if k in a}
    return lambda: sdm_ops.sparse_delta_memory(**dict(a, **leaves), chunk_size=chunk_size, **kw)


def in_place_fn(a: dict, chunk_size: int):
    """A call of ``sparse_delta_memory_`` on ``a``: the inference forward, which updates a bank
    in place and copies nothing (its own copy of ``a``'s bank, made once and updated by every
    call; the time does not depend on the values)."""
    bank = a["bank"].clone()
    rest = {k: t for k, t in a.items() if k != "bank"}
    return lambda: sdm_ops.sparse_delta_memory_(bank=bank, **rest, chunk_size=chunk_size)


def forward_backward_fn(a: dict, chunk_size: int, final: bool = False, **kw):
    """A call of the forward and backward of ``sparse_delta_memory`` on ``a``: the gradients of
    every float input (its own leaves, made once) for an output gradient of ones and, with
    ``final``, a final bank's gradient of ones (made once too, outside the call, as a
    downstream loss would hand them over). The gradients are returned, not accumulated into
    ``.grad``, so the call times the operator alone."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if k in a}
    B, H = a["v"].shape[0], a["v"].shape[2]
    bank = a["bank"]
    cu_seqlens = kw.get("cu_seqlens")
    banks = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    g_out = torch.ones_like(a["v"])
    g_bank = torch.ones((banks, H) + tuple(bank.shape[-2:]), dtype=bank.dtype, device=bank.device)

    def fwd_bwd():
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(a, **leaves), chunk_size=chunk_size, **kw, output_final_state=final
        )
        if not final:
            return torch.autograd.grad(out, list(leaves.values()), g_out)
        return torch.autograd.grad((out, bank), list(leaves.values()), (g_out, g_bank))

    return fwd_bwd


def timed(prefix: str, fn) -> dict:
    """``{prefix}_ms`` (eager) and ``{prefix}_graph_ms`` (replayed) of ``fn``."""
    return {f"{prefix}_ms": _timing.eager_ms(fn), f"{prefix}_graph_ms": _timing.graph_ms(fn)}


# The table columns of ``timed("fwd", ...)`` and ``timed("fwd_bwd", ...)``.
FWD_COLUMNS = (("fwd_ms", "fwd ms", ".3f"), ("fwd_graph_ms", "graph", ".3f"))
FWD_BWD_COLUMNS = (("fwd_bwd_ms", "fwd+bwd ms", ".3f"), ("fwd_bwd_graph_ms", "graph", ".3f"))


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# Tables: printed row by row as measured, kept for --json
# ---------------------------------------------------------------------------


class Section:
    """One table: a title, columns ``(key, header, format)`` after the ``case`` column, and
    rows (dicts keyed by ``case`` and the columns' keys; a missing or None figure prints
    blank). Columns whose key ends in ``_ms`` or ``_us`` and holds no ``floor`` are timings:
    what ``benchmarks/ab.py`` compares between revisions."""

    def __init__(self, run: Run, name: str, title: str, columns, case_width: int = 26):
        self.run, self.name, self.title = run, name, title
        self.columns = list(columns)
        self.case_width = case_width
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.widths = [max(len(h) + 2, 8) for _, h, _ in self.columns]
        print(f"\n{name}: {title}")
        head = f"{'case':<{case_width}}" + "".join(
            f"{h:>{w}}" for (_, h, _), w in zip(self.columns, self.widths)
        )
        print(head)
        print("-" * len(head), flush=True)
        run.sections.append(self)

    def progress(self, i: int, n: int, case: str) -> None:
        """A line on stderr before a case is measured (a cut run still says where it was)."""
        took = time.perf_counter() - self.run.start
        print(f"bench: {self.name} {i}/{n}: {case} ({took:.0f} s)", file=sys.stderr, flush=True)

    def add(self, case: str, **figures) -> None:
        row = {"case": case}
        row.update({k: _plain(v) for k, v in figures.items()})
        self.rows.append(row)
        cells = []
        for (key, _, fmt), w in zip(self.columns, self.widths):
            v = row.get(key)
            cells.append(f"{'' if v is None else format(v, fmt):>{w}}")
        print(f"{case:<{self.case_width}}" + "".join(cells), flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text, flush=True)

    def as_json(self) -> dict:
        return {
            "name": self.name,
            "title": self.title,
            "columns": [{"key": k, "header": h, "format": f} for k, h, f in self.columns],
            "rows": self.rows,
            "notes": self.notes,
        }


def _plain(v):
    """A JSON-safe figure: a Python number, None for NaN."""
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


class Run:
    """What one bench run measured, written to ``--json`` after every section."""

    def __init__(self, args, argv: list[str]):
        self.args, self.argv = args, argv
        self.start = time.perf_counter()
        self.sections: list[Section] = []
        self.bandwidth: float | None = None  # bytes per second

    @property
    def shape(self) -> tuple:
        a = self.args
        return a.B, a.T, a.H, a.D, a.S, a.W, a.R

    def as_json(self) -> dict:
        import triton

        a = self.args
        cuda = torch.cuda.is_available()
        return {
            "bench": PROG,
            "argv": self.argv,
            "workload": {
                "B": a.B,
                "T": a.T,
                "H": a.H,
                "D": a.D,
                "S": a.S,
                "W": a.W,
                "R": a.R,
                "chunk_size": a.chunk_size,
                "values": "bfloat16",
            },
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "sdm_ops_path": sdm_ops.__file__,
            "copy_bandwidth_bytes_per_s": self.bandwidth,
            "timer": {"do_bench_rep_ms": a.rep_ms, "statistic": "median"},
            "sections": [s.as_json() for s in self.sections],
        }

    def save(self) -> None:
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump(self.as_json(), f, indent=1)
                f.write("\n")

    def floor_ms(self, nbytes: int) -> float:
        return nbytes / self.bandwidth * 1e3


# ---------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------


def section_main(run: Run) -> None:
    C = run.args.chunk_size
    t = Section(
        run,
        "main",
        "reference workload: forward, in place, forward+backward",
        [
            *FWD_COLUMNS,
            ("fwd_host_ms", "host ms", ".3f"),
            ("launches", "launches", "d"),
            ("fwd_floor_ms", "floor ms", ".3f"),
            ("fwd_x_floor", "x floor", ".2f"),
            ("train_fwd_graph_ms", "train fwd", ".3f"),
            ("in_place_graph_ms", "in place", ".3f"),
            ("in_place_floor_ms", "floor ms", ".3f"),
            ("in_place_x_floor", "x floor", ".2f"),
            *FWD_BWD_COLUMNS,
            ("fwd_bwd_floor_ms", "floor ms", ".3f"),
            ("fwd_bwd_x_floor", "x floor", ".2f"),
            ("peak_gib", "peak GiB", ".2f"),
            ("fwd_bwd_final_graph_ms", "final state", ".3f"),
            ("reference_ms", "reference ms", ".1f"),
        ],
    )
    cases = [
        ("float32 bank, decay", True, torch.float32),
        ("float32 bank, no decay", False, torch.float32),
        ("bfloat16 bank, decay", True, torch.bfloat16),
    ]
    for i, (name, decay, bank_dtype) in enumerate(cases, 1):
        t.progress(i, len(cases), name)
        a = make_workload(*run.shape, decay=decay, bank_dtype=bank_dtype)
        fwd = forward_fn(a, C)
        row = timed("fwd", fwd)
        row["fwd_host_ms"] = _timing.host_ms(fwd)
        row["launches"] = sum(calls for _, calls in _timing.cuda_ops(fwd).values())
        row["train_fwd_graph_ms"] = _timing.graph_ms(train_forward_fn(a, C))
        row["in_place_graph_ms"] = _timing.graph_ms(in_place_fn(a, C))
        fwd_bwd = forward_backward_fn(a, C)
        row["peak_gib"] = _timing.peak_gib(fwd_bwd)
        row.update(timed("fwd_bwd", fwd_bwd))
        del fwd_bwd
        row["fwd_bwd_final_graph_ms"] = _timing.graph_ms(forward_backward_fn(a, C, final=True))
        _free()
        for key, nbytes in (
            ("fwd", floor_bytes(a)),
            ("in_place", floor_bytes(a, in_place=True)),
            ("fwd_bwd", floor_bytes_fwd_bwd(a)),
        ):
            row[f"{key}_floor_ms"] = run.floor_ms(nbytes)
            row[f"{key}_x_floor"] = row[f"{key}_graph_ms"] / row[f"{key}_floor_ms"]
        if not run.args.no_reference:

            def ref_fwd(a=a):
                with torch.no_grad():
                    return ref.sdm_chunked_reference(**a, chunk_size=C)

            row["reference_ms"] = _timing.eager_ms(ref_fwd)
        t.add(name, **row)
        del a, fwd
        _free()


def section_snapshots(run: Run) -> None:
    D, W, R = run.args.D, run.args.W, run.args.R
    t = Section(
        run,
        "snapshots",
        "forward+backward by snapshot mode, float32 bank, decay",
        [
            ("bytes_per_token", "bytes/token", "d"),
            *FWD_BWD_COLUMNS,
        ],
    )
    a = make_workload(*run.shape, decay=True, bank_dtype=torch.float32)
    for i, mode in enumerate(SNAPSHOTS, 1):
        t.progress(i, len(SNAPSHOTS), mode)
        fwd_bwd = forward_backward_fn(a, run.args.chunk_size, snapshot=mode)
        t.add(
            mode,
            bytes_per_token=snapshot_row_bytes(mode, D, torch.float32) * (W + R),
            **timed("fwd_bwd", fwd_bwd),
        )
        del fwd_bwd
        _free()


def snapshot_row_bytes(mode: str, D: int, bank_dtype) -> int:
    """Bytes a snapshot mode keeps per bank row (``none``: the bank's own dtype)."""
    return {
        "none": D * torch.empty((), dtype=bank_dtype).element_size(),
        "bf16": D * 2,
        "fp8": D + D // 4,
        "int4": D // 2 + D // 4,
    }[mode]


def section_decode(run: Run) -> None:
    B, _, H, D, S, W, R = run.shape
    steps = 32
    t = Section(
        run,
        "decode",
        f"one decode step (T=1, B*H={B * H} streams) of "
        f"sparse_delta_memory_, replayed from a CUDA graph",
        [
            ("step_graph_us", "replay us", ".1f"),
            ("step_in_graph_us", f"in {steps} steps us", ".1f"),
        ],
    )
    cases = (("float32 bank", torch.float32), ("bfloat16 bank", torch.bfloat16))
    for i, (name, bank_dtype) in enumerate(cases, 1):
        t.progress(i, len(cases), name)
        step = in_place_fn(
            make_workload(B, 1, H, D, S, W, R, decay=True, bank_dtype=bank_dtype),
            run.args.chunk_size,
        )
        t.add(
            name,
            step_graph_us=_timing.graph_ms(step) * 1e3,
            step_in_graph_us=_timing.graph_ms(step, calls=steps) * 1e3,
        )
        del step
        _free()


def fla_inputs(B: int, T: int, H: int, D: int, g: torch.Generator):
    """fla's ``q, k, v [B, T, H, D]`` (unit keys) and ``beta [B, T, H]``, bfloat16 on the GPU,
    drawn from ``g``."""
    q, k, v = (
        torch.randn(B, T, H, D, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3)
    )
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)
    return q, k, v, beta


def section_host(run: Run) -> None:
    B, _, H, D, S, W, R = run.shape
    t = Section(
        run,
        "host",
        f"eager calls: the host's wall time until a call returns (the GPU idle before it), "
        f"the eager call's time, the same call replayed from a CUDA graph, and the share of "
        f"an eager call's span the GPU is busy (decode: B*H={B * H} streams, S={S})",
        [
            ("host_us", "host us", ".1f"),
            ("eager_us", "eager us", ".1f"),
            ("graph_us", "graph us", ".1f"),
            ("busy_pct", "GPU busy %", ".0f"),
        ],
        case_width=34,
    )
    from sdm_ops.nn import SparseDeltaMemory

    g = torch.Generator(device="cuda").manual_seed(0)
    decode = in_place_fn(
        make_workload(B, 1, H, D, S, W, R, decay=True, bank_dtype=torch.float32),
        run.args.chunk_size,
    )
    step_layer = SparseDeltaMemory(512, H, D, (256, 256), R, W).cuda()
    state = step_layer.initial_state(B)
    x1 = torch.randn(B, 1, 512, device="cuda", generator=g)
    fwd_layer = SparseDeltaMemory(512, H, D, (256, 256), R, W).cuda()
    x256 = torch.randn(1, 256, 512, device="cuda", generator=g)
    x_train = torch.randn(B, 4096, 512, device="cuda", generator=g)

    def step():
        return step_layer.step_(x1, state)

    def forward_no_grad():
        with torch.no_grad():
            return fwd_layer(x256)

    def forward_autograd():
        return fwd_layer(x256)

    def train_step():
        fwd_layer(x_train).sum().backward()

    cases = [
        ("sparse_delta_memory_ T=1", decode, True),
        ("layer step_ T=1 (d_model 512)", step, True),
        ("layer forward B=1 T=256, no grad", forward_no_grad, True),
        ("layer forward B=1 T=256, autograd", forward_autograd, False),
        (f"layer fwd+bwd B={B} T=4096", train_step, False),
    ]
    fused, why = _import_peer("fla.ops.delta_rule", "fused_recurrent_delta_rule")
    if fused is None:
        t.note(f"fla fused_recurrent_delta_rule skipped: {why} (pip install fla-core)")
    else:
        q, k, v, beta = fla_inputs(B, 1, H, D, g)
        h0 = torch.zeros(B, H, D, D, device="cuda")

        def fla_decode():
            with torch.no_grad():
                return fused(q, k, v, beta=beta, initial_state=h0, output_final_state=True)

        cases.insert(1, ("fla fused_recurrent_delta_rule T=1", fla_decode, True))
    for i, (name, fn, graphable) in enumerate(cases, 1):
        t.progress(i, len(cases), name)
        busy_ms, span_ms = _timing.gpu_busy(fn)
        graph_us = None
        if graphable:
            try:
                graph_us = _timing.graph_ms(fn) * 1e3
            except RuntimeError as e:  # reported, and the other figures still measured
                t.note(f"{name}: not captured in a CUDA graph: {str(e).splitlines()[0][:120]}")
        t.add(
            name,
            host_us=_timing.host_ms(fn) * 1e3,
            eager_us=_timing.eager_ms(fn) * 1e3,
            graph_us=graph_us,
            busy_pct=100 * busy_ms / span_ms if span_ms > 0 else None,
        )
        _free()
    t.note(
        "graph: blank for calls with autograd (captured whole only inside torch.compile). "
        "GPU busy: the union of kernel times over the span from the first kernel's start to "
        "the last one's end, three eager calls in a row."
    )


def _import_peer(module: str, name: str):
    """(function, None), or (None, why) when it cannot be imported."""
    try:
        return getattr(__import__(module, fromlist=[name]), name), None
    except Exception as e:  # noqa: BLE001 - a broken optional install is reported
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return None, f"{type(e).__name__}: {first}"


def section_peers(run: Run) -> None:
    B, T, H, D, S = run.shape[:5]
    t = Section(
        run,
        "peers",
        f"fla-core at B={B} T={T} H={H} K=V={D}, bfloat16 (a {D}x{D} "
        f"state per stream, {S // D} times smaller than the bank)",
        [
            *FWD_COLUMNS,
            *FWD_BWD_COLUMNS,
        ],
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, beta = fla_inputs(B, T, H, D, g)
    gate = -torch.rand(B, T, H, D, device="cuda", generator=g) * 0.1
    peers = (
        ("fla chunk_delta_rule", "fla.ops.delta_rule", "chunk_delta_rule", ()),
        ("fla chunk_kda", "fla.ops.kda", "chunk_kda", (gate,)),
    )
    for i, (name, module, attr, extra) in enumerate(peers, 1):
        fn, why = _import_peer(module, attr)
        if fn is None:
            t.note(f"{name} skipped: {why} (pip install fla-core)")
            continue
        t.progress(i, len(peers), name)

        def fwd(fn=fn, extra=extra):
            with torch.no_grad():
                return fn(q, k, v, *extra, beta)

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        g_o = torch.ones_like(v)

        def fwd_bwd(fn=fn, extra=extra, leaves=leaves, g_o=g_o):
            return torch.autograd.grad(fn(*leaves, *extra, beta)[0], leaves, g_o)

        t.add(name, **timed("fwd", fwd), **timed("fwd_bwd", fwd_bwd))
        _free()


def section_packed(run: Run) -> None:
    B, T, H, D, S, W, R = run.shape
    C = run.args.chunk_size
    packed, cu, lengths = packed_workload(B, T, H, D, S, W, R)
    t = Section(
        run,
        "packed",
        f"{B} sequences of {int(lengths.min())} to "
        f"{int(lengths.max())} tokens, packed (cu_seqlens) and padded to [B, T] "
        "(index -1, weight 0), float32 bank, decay",
        [
            ("tokens", "tokens", "d"),
            *FWD_COLUMNS,
            *FWD_BWD_COLUMNS,
        ],
    )
    padded = make_workload(B, T, H, D, S, W, R, decay=True, bank_dtype=torch.float32)
    pad = torch.arange(T, device="cuda")[None, :] >= lengths.to("cuda")[:, None]  # [B, T]
    for key in ("write_idx", "read_idx"):
        padded[key] = padded[key].masked_fill(pad[:, :, None, None], -1)
    cases = (
        ("packed (cu_seqlens)", packed, {"cu_seqlens": cu}, int(lengths.sum())),
        ("padded to [B, T]", padded, {}, B * T),
    )
    for i, (name, a, kw, tokens) in enumerate(cases, 1):
        t.progress(i, len(cases), name)
        fwd_bwd = forward_backward_fn(a, C, **kw)
        t.add(
            name, tokens=tokens, **timed("fwd", forward_fn(a, C, **kw)), **timed("fwd_bwd", fwd_bwd)
        )
        del fwd_bwd
        _free()


def section_addressing(run: Run) -> None:
    from sdm_ops.kernels.chunk_prepare_sparse import COMPACT

    S = run.args.S
    t = Section(
        run,
        "addressing",
        f"indices uniform over a hot set of slots, float32 bank, "
        f"decay; a chunk with more than {COMPACT} entries on one slot runs phase 1's "
        "dense kernels",
        [
            ("shared_per_chunk", "shared/chunk", ".1f"),
            ("dense_chunks", "dense chunks", ".1%"),
            *FWD_COLUMNS,
            *FWD_BWD_COLUMNS,
        ],
    )
    cases = ((S, 32), (S, 64), (S, 128), (S // 16, 64), (S // 256, 64))
    for i, (hot, C) in enumerate(cases, 1):
        name = f"{hot} slots, chunk {C}"
        t.progress(i, len(cases), name)
        a = make_workload(*run.shape, decay=True, bank_dtype=torch.float32, hot=hot)
        count, most = shared_entries(a, C)
        fwd_bwd = forward_backward_fn(a, C)
        t.add(
            name,
            shared_per_chunk=count.float().mean(),
            dense_chunks=(most > COMPACT).float().mean(),
            **timed("fwd", forward_fn(a, C)),
            **timed("fwd_bwd", fwd_bwd),
        )
        del fwd_bwd, a
        _free()


def section_scaling(run: Run) -> None:
    B, T, H, D, _, W, R = run.shape
    C = run.args.chunk_size
    t = Section(
        run,
        "scaling",
        f"forward+backward over S, the layer's case: B={B} T={T} H={H} D={D} W={W} R={R} "
        f"chunk {C}, a shared float32 bank [H, S, D] requiring grad, decay; graph times; peak: "
        "GiB above the inputs; dense grad: writing [H, S, D] float32 at the copy bandwidth",
        [
            ("fwd_bwd_graph_ms", "fwd+bwd ms", ".3f"),
            ("peak_gib", "peak GiB", ".2f"),
            ("final_graph_ms", "final state ms", ".3f"),
            ("final_peak_gib", "peak GiB", ".2f"),
            ("dense_grad_ms", "dense grad ms", ".3f"),
        ],
    )
    sizes = (2**16, 2**18, 2**20)
    for i, S in enumerate(sizes, 1):
        name = f"S=2^{S.bit_length() - 1}"
        t.progress(i, len(sizes), name)
        a = make_workload(B, T, H, D, S, W, R, decay=True, bank_dtype=torch.float32)
        a["bank"] = a["bank"][0].contiguous()
        _free()
        row = {"dense_grad_ms": run.floor_ms(_size(a["bank"]))}
        for key, final in (("", False), ("final_", True)):
            fwd_bwd = forward_backward_fn(a, C, final=final)
            row[f"{key}peak_gib"] = _timing.peak_gib(fwd_bwd)
            ms = _timing.graph_ms(fwd_bwd)
            row["fwd_bwd_graph_ms" if not final else "final_graph_ms"] = ms
            del fwd_bwd
            _free()
        t.add(name, **row)
        del a
        _free()


TOPK_ROWS = 262144
TOPK_FACTORS = (256, 256)
TOPK_KS = (8, 32)
BRUTE_CHUNK = 16384  # rows whose 65536 float32 sums (4 GiB) are held at once


def brute_force_topk(raw: torch.Tensor, k: int) -> None:
    """Every sum of a row's two factor scores in float32, chunk of rows by chunk, then
    ``torch.topk``: what ``product_key_topk`` avoids materializing."""
    a, b = TOPK_FACTORS
    for r0 in range(0, raw.shape[0], BRUTE_CHUNK):
        x = raw[r0 : r0 + BRUTE_CHUNK].float()
        sums = (x[:, :a, None] + x[:, None, a:]).reshape(x.shape[0], a * b)
        torch.topk(sums, k, dim=-1)


def section_topk(run: Run) -> None:
    t = Section(
        run,
        "topk",
        f"product_key_topk, {TOPK_ROWS} rows, factors {TOPK_FACTORS}; floor: the rows read once",
        [
            ("floor_ms", "floor ms", ".3f"),
            *FWD_COLUMNS,
            ("fwd_x_floor", "x floor", ".1f"),
            *FWD_BWD_COLUMNS,
            ("brute_force_ms", "brute force ms", ".1f"),
        ],
    )
    cases = [(dtype, k) for dtype in (torch.bfloat16, torch.float32) for k in TOPK_KS]
    for i, (dtype, k) in enumerate(cases, 1):
        name = f"{str(dtype).removeprefix('torch.')} rows, k={k}"
        t.progress(i, len(cases), name)
        raw, forward, forward_backward = topk_calls(dtype, k)
        row = {
            "floor_ms": run.floor_ms(_size(raw)),
            **timed("fwd", forward),
            **timed("fwd_bwd", forward_backward),
        }
        row["fwd_x_floor"] = row["fwd_graph_ms"] / row["floor_ms"]
        if dtype == torch.bfloat16:
            row["brute_force_ms"] = _timing.eager_ms(partial(brute_force_topk, raw, k))
        t.add(name, **row)
        del raw, forward, forward_backward
        _free()


def topk_calls(dtype, k: int):
    """(raw, forward, forward_backward): random rows of ``dtype`` and calls of
    ``product_key_topk`` on them, the backward's value gradient made once beforehand."""
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(TOPK_ROWS, sum(TOPK_FACTORS), device="cuda", generator=g).to(dtype)
    x = raw.detach().requires_grad_(True)
    grad_val = torch.randn(TOPK_ROWS, k, device="cuda", generator=g).to(dtype)

    def forward():
        return sdm_ops.product_key_topk(raw, TOPK_FACTORS, k)

    def forward_backward():
        val, _ = sdm_ops.product_key_topk(x, TOPK_FACTORS, k)
        return torch.autograd.grad(val, x, grad_val)

    return raw, forward, forward_backward


def section_profile(run: Run, top: int = 15) -> None:
    t = Section(
        run,
        "profile",
        f"CUDA time of one forward+backward by kernel, float32 bank, decay (the {top} longest)",
        [("ms", "ms", ".3f"), ("calls", "calls", "d")],
        case_width=64,
    )
    a = make_workload(*run.shape, decay=True, bank_dtype=torch.float32)
    t.progress(1, 1, "float32 bank, decay")
    totals = _timing.cuda_ops(forward_backward_fn(a, run.args.chunk_size))
    for name, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        t.add(name[:62], ms=ms, calls=calls)
    t.note(f"all {len(totals)} kernels: {sum(ms for ms, _ in totals.values()):.3f} ms")


def section_snapshot_errors(run: Run) -> None:
    """Per snapshot mode, the bytes kept per token and each gradient's error against the exact
    mode ("none"): max |g - g_none| / max |g_none|, on the GPU or else the CPU."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a = make_workload(*run.shape, decay=True, bank_dtype=torch.float32, dev=dev)
    names = [k for k in FLOATS if k in a]
    D, W, R = run.args.D, run.args.W, run.args.R
    t = Section(
        run,
        "snapshot-errors",
        f"each gradient's error against snapshot 'none' "
        f"(max |g - g_none| / max |g_none|), float32 bank, decay, on {dev}",
        [("bytes_per_token", "bytes/token", "d")] + [(f"err_{n}", f"d{n}", ".1e") for n in names],
    )
    grads = {}
    for i, mode in enumerate(SNAPSHOTS, 1):
        t.progress(i, len(SNAPSHOTS), mode)
        leaves = {k: a[k].detach().clone().requires_grad_() for k in names}
        out, bank = sdm_ops.sparse_delta_memory(
            **dict(a, **leaves),
            chunk_size=run.args.chunk_size,
            snapshot=mode,
            output_final_state=True,
        )
        g = torch.Generator(device=dev).manual_seed(1)
        g_out = torch.randn(out.shape, device=dev, generator=g)
        g_bank = torch.randn(bank.shape, device=dev, generator=g)
        loss = (out.float() * g_out).sum() + (bank.float() * g_bank).sum()
        grads[mode] = torch.autograd.grad(loss, [leaves[k] for k in names])
        errs = {
            f"err_{n}": ((x.float() - y.float()).abs().max() / y.float().abs().max()).item()
            for n, x, y in zip(names, grads[mode], grads["none"])
        }
        t.add(mode, bytes_per_token=snapshot_row_bytes(mode, D, torch.float32) * (W + R), **errs)


STATE_SLOTS = tuple(2**i for i in range(12, 23))
# fla-core's chunk_delta_rule at K = 16 and 32 (V = 64) stops with a CUDA illegal memory access
# on an H200 (fla-core 0.6.0, triton 3.6); that ends the process, so those widths are not run.
STATE_KEY_WIDTHS = (64, 128, 256)
STATE_BANK_BYTES = 8 * 2**30  # the largest [B, H, S, D] bank of the state section


def state_batch(B: int, T: int, H: int, S: int, D: int) -> tuple[int, int]:
    """(B, T) of the state section's SDM call at S slots: B x T tokens, B halved (T doubled)
    while the float32 bank [B, H, S, D] would pass ``STATE_BANK_BYTES``, down to B = 1."""
    while B > 1 and B * H * S * D * 4 > STATE_BANK_BYTES and B % 2 == 0:
        B, T = B // 2, T * 2
    return B, T


def section_state(run: Run) -> None:
    B0, T0, H, D, _, W, R = run.shape
    C = run.args.chunk_size
    t = Section(
        run,
        "state",
        f"time per token against the state per head: SDM (S x {D}, float32 bank, no "
        f"decay, W={W} R={R}) and fla chunk_delta_rule (K x {D}), {B0 * T0} tokens a call, "
        f"H={H}, bfloat16 values",
        [
            ("B", "B", "d"),
            ("T", "T", "d"),
            ("state", "state/head", "d"),
            *FWD_COLUMNS,
            ("in_place_graph_ms", "in place", ".3f"),
            *FWD_BWD_COLUMNS,
        ],
    )
    fla, why = _import_peer("fla.ops.delta_rule", "chunk_delta_rule")
    cases = [("sdm", S) for S in STATE_SLOTS]
    if fla is None:
        t.note(f"fla chunk_delta_rule skipped: {why} (pip install fla-core)")
    else:
        cases += [("fla", K) for K in STATE_KEY_WIDTHS]
    for i, (kind, size) in enumerate(cases, 1):
        name = f"sdm S={size}" if kind == "sdm" else f"fla K={size}"
        t.progress(i, len(cases), name)
        B, T = state_batch(B0, T0, H, size, D) if kind == "sdm" else (B0, T0)
        row, error = None, None
        try:
            if kind == "sdm":
                row = _sdm_state_row(B, T, H, D, size, W, R, C)
            else:
                row = _fla_state_row(fla, B, T, H, size, D)
        except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as e:
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"
        _free()  # after the except block, whose traceback holds the call's tensors
        if error is not None:
            t.note(f"{name} skipped: {error}")
            continue
        t.add(name, kind=kind, B=B, T=T, state=size * D, **row)


def _sdm_state_row(B: int, T: int, H: int, D: int, S: int, W: int, R: int, C: int) -> dict:
    """``sparse_delta_memory`` timed at S slots (float32 bank, no decay): forward, in-place
    forward and forward+backward."""
    a = make_workload(B, T, H, D, S, W, R, decay=False, bank_dtype=torch.float32)
    return {
        **timed("fwd", forward_fn(a, C)),
        "in_place_graph_ms": _timing.graph_ms(in_place_fn(a, C)),
        **timed("fwd_bwd", forward_backward_fn(a, C)),
    }


def _fla_state_row(fla, B: int, T: int, H: int, K: int, V: int) -> dict:
    """fla's ``chunk_delta_rule`` timed at key width K and value width V (bfloat16, unit
    keys), forward and forward+backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(B, T, H, K, device="cuda", generator=g) for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    v = torch.randn(B, T, H, V, device="cuda", generator=g).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda", generator=g).to(torch.bfloat16)

    def fwd():
        with torch.no_grad():
            return fla(q, k, v, beta)

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    g_o = torch.ones_like(v)

    def fwd_bwd():
        return torch.autograd.grad(fla(*leaves, beta)[0], leaves, g_o)

    return {**timed("fwd", fwd), **timed("fwd_bwd", fwd_bwd)}


STATE_LINES = (
    # (kind, figure, label, color, line style): a color per layer, a style per call
    ("sdm", "fwd", "SDM forward", "C0", "-"),
    ("sdm", "in_place", "SDM forward in place", "C0", ":"),
    ("sdm", "fwd_bwd", "SDM forward+backward", "C0", "--"),
    ("fla", "fwd", "fla chunk_delta_rule forward", "C3", "-"),
    ("fla", "fwd_bwd", "fla chunk_delta_rule forward+backward", "C3", "--"),
)


def plot_state(results: dict, path: str) -> str:
    """A PNG of the ``state`` section of bench results (``Run.as_json``, or a ``--json``
    file): nanoseconds per token against state elements per head, both axes logarithmic,
    one line per call (the graph replay's time, the eager one where the graph's is missing).
    Points measured with fewer sequences than the section's most (B lowered to keep the bank
    in memory: less parallel work a call) have open markers. ValueError when the results hold
    no state section with timings; ImportError without matplotlib. Returns ``path``."""
    section = next((s for s in results.get("sections", []) if s.get("name") == "state"), None)
    if section is None or not section.get("rows"):
        raise ValueError("the results hold no 'state' section with rows to plot")
    most = max(row["B"] for row in section["rows"])
    lines = []  # (label, color, style, [(state, ns per token, B lowered)])
    for kind, figure, label, color, style in STATE_LINES:
        points = []
        for row in section["rows"]:
            ms = row.get(f"{figure}_graph_ms")
            if ms is None:
                ms = row.get(f"{figure}_ms")
            if row.get("kind") == kind and ms is not None:
                ns = ms * 1e6 / (row["B"] * row["T"])
                points.append((row["state"], ns, row["B"] < most))
        if points:
            lines.append((label, color, style, sorted(points)))
    if not lines:
        raise ValueError("the 'state' section holds no timings to plot")
    fig = _plot.new_figure(7.5, 4.8)
    ax = fig.add_subplot()
    lowered = False
    for label, color, style, points in lines:
        xs, ys, _ = zip(*points)
        ax.plot(xs, ys, linestyle=style, color=color, label=label)
        for low, face in ((False, color), (True, "white")):
            pts = [(x, y) for x, y, b in points if b == low]
            if pts:
                ax.plot(
                    *zip(*pts),
                    linestyle="",
                    marker="o",
                    markersize=4,
                    color=color,
                    markerfacecolor=face,
                )
                lowered |= low
    if lowered:
        ax.plot(
            [],
            [],
            linestyle="",
            marker="o",
            markersize=4,
            color="gray",
            markerfacecolor="white",
            label=f"fewer than {most} sequences a call",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("state per head (elements, log2)")
    ax.set_ylabel("time per token (ns)")
    ax.set_title(f"{results.get('device', '')}: {section.get('title', '')}", fontsize=8, wrap=True)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _plot.save(fig, path)


RUNNERS = {
    "main": section_main,
    "snapshots": section_snapshots,
    "decode": section_decode,
    "host": section_host,
    "peers": section_peers,
    "packed": section_packed,
    "addressing": section_addressing,
    "scaling": section_scaling,
    "topk": section_topk,
    "profile": section_profile,
    "snapshot-errors": section_snapshot_errors,
    "state": section_state,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot and not _plot.available():
        parser.error(f"--plot needs matplotlib: {_plot.INSTALL_HINT}")
    if args.from_json:
        if not args.plot:
            parser.error("--from-json needs --plot PATH")
        with open(args.from_json) as f:
            results = json.load(f)
        try:
            plot_state(results, args.plot)
        except ValueError as e:
            parser.error(f"{args.from_json}: {e}")
        print(f"plot written to {args.plot}")
        return 0
    if args.only is None:
        args.only = ["state"] if args.plot else list(DEFAULT_SECTIONS)
    elif args.plot and "state" not in args.only:
        args.only.append("state")
    if not torch.cuda.is_available() and set(args.only) != {"snapshot-errors"}:
        parser.error(
            "needs a CUDA GPU (torch.cuda.is_available() is False); only "
            "--only snapshot-errors runs on the CPU"
        )
    if args.rep_ms <= 0:
        parser.error(f"--rep-ms must be positive, not {args.rep_ms:g}")
    if args.json:
        if os.path.isdir(args.json):
            parser.error(f"--json takes a file path, not the folder {args.json}")
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    _timing.set_budget(args.rep_ms)
    run = Run(args, argv)
    B, T, H, D, S, W, R = run.shape
    if torch.cuda.is_available():
        import triton

        run.bandwidth = _timing.copy_bandwidth()
        print(
            f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton "
            f"{triton.__version__}, copy bandwidth {run.bandwidth / 1e12:.2f} TB/s"
        )
    print(
        f"B={B} T={T} H={H} D={D} S={S} W={W} R={R} chunk {args.chunk_size}, bfloat16 "
        f"values; times in ms (median of do_bench), 'graph': replayed from a CUDA graph"
    )
    for name in args.only:
        RUNNERS[name](run)
        run.save()
    if args.json:
        print(f"\nresults written to {args.json}")
    if args.plot:
        plot_state(run.as_json(), args.plot)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
