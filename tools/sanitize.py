"""Every Triton kernel of sdm_ops on out-of-range indices: ``python tools/sanitize.py``.

Written to run under ``compute-sanitizer --tool memcheck`` (``tools/sanitize.sh``): it
launches each kernel on small shapes with indices outside ``[0, S)`` (just past the bank, far
past it, the index dtype's extremes, negatives below -1) mixed with valid slots and -1
padding, and checks what the README promises: every kernel treats such an index exactly like
-1 padding. Each case runs a call twice, with the bad indices and with them replaced by -1,
and requires bitwise equal results (outputs, final bank, every gradient); the sanitizer
checks that no access left its tensor. Parts (``--parts``, comma-separated):

- ``eager``: ``sparse_delta_memory`` forward and backward with float32 and bfloat16 banks,
  every snapshot mode, decay on and off, shared and per-stream banks, int32 and int64
  indices, and packed variable-length batches (``cu_seqlens``, an empty sequence included);
  ``sparse_delta_memory_`` over several chunks; ``sparse_delta_memory`` without autograd
  (the inference forward: its bank copy on a second stream beside phase 1, then phase 2 in
  place on the copy). The public functions reject out-of-range
  indices in eager mode on the CPU and, with strict checks on, on a GPU (a ``ValueError``;
  checked once here, as is the GPU default, where an eager call reads no data and the bad
  indices reach the kernels), so the bad calls run inside :func:`unchecked`, which switches
  off the checks that read data, as compiled code and CUDA graph capture do; everything else
  is the public call.
- ``compiled``: the same calls inside ``torch.compile(fullgraph=True)`` (those checks are
  skipped while compiling), one compiled function reused for both calls of a case.
- ``graphs``: ``sparse_delta_memory_`` decode steps (also of packed sequences) captured in a
  ``torch.cuda.graph`` with bad indices in the static inputs, replayed token by token, against
  eager steps on the padded indices.
- ``ops``: ``product_key_topk`` and ``wy_solve`` forward and backward (they take no indices)
  on awkward shapes and values, against the reference.

Shapes: B = 1, H = 2, T = 40, D = 16, S = 32, W = 3, R = 2, chunk 16 (three chunks, the last
partial). One line is printed per case, then ``sanitize: N cases, ...``; the exit status is 0
when every case passed.

``--device cpu`` runs the same cases without a GPU: the Triton kernels run under Triton's
interpreter (the script re-executes itself with ``TRITON_INTERPRET=1``), the ``graphs`` part
is skipped, and the ``compiled`` part runs the operators' reference path (Inductor cannot
compile user-defined Triton kernels for CPU tensors).

Run it from the repository root with ``sdm_ops`` importable (installed, or ``PYTHONPATH=.``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from unittest import mock

PARTS = ("eager", "compiled", "graphs", "ops")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/sanitize.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (default), or cpu: the kernels under Triton's interpreter",
    )
    p.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, of {', '.join(PARTS)} (default: all)",
    )
    return p


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch
from torch import Tensor

from sdm_ops import recurrence, reference, strict_checks
from sdm_ops.kernels._common import interpreting, kernels_on_cpu
from sdm_ops.product_key import product_key_topk
from sdm_ops.recurrence import sparse_delta_memory, sparse_delta_memory_
from sdm_ops.wy import wy_solve

B, H, T, D, S, W, R = 1, 2, 40, 16, 32, 3, 2
CHUNK = 16
SNAPSHOTS = ("none", "bf16", "fp8", "int4")
FLOATS = ("v", "beta", "write_w", "read_w", "bank", "decay")
SEQUENCE = ("v", "beta", "write_idx", "write_w", "read_idx", "read_w", "decay")
CU_SEQLENS = (0, 7, 7, 23, 40)  # packed cases: 4 sequences of 7, 0, 16 and 17 tokens
BAD_FRACTION = 1 / 3

F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
DTYPE_NAMES = {F32: "float32", BF16: "bfloat16", I32: "int32", I64: "int64"}


# ---------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------


def make_inputs(
    *,
    dtype: torch.dtype,
    decay: bool,
    shared: bool,
    index_dtype: torch.dtype,
    seed: int,
    batch: int = B,
    steps: int = T,
    varlen: bool = False,
) -> dict[str, Tensor | None]:
    """Arguments of ``sparse_delta_memory`` on the CPU: indices in [0, S) with 15% -1
    padding (S is small, so tokens and chunks share slots), decays in [0, 1] with exact 0s and
    1s, random normals elsewhere; every float in ``dtype``. ``varlen``: one packed batch of
    the sequences of CU_SEQLENS (``batch`` 1, ``steps`` T), a bank per sequence."""
    g = torch.Generator().manual_seed(seed)
    banks = len(CU_SEQLENS) - 1 if varlen else batch

    def idx(n: int) -> Tensor:
        i = torch.randint(0, S, (batch, steps, H, n), generator=g)
        return torch.where(torch.rand(i.shape, generator=g) < 0.15, -1, i).to(index_dtype)

    def rnd(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    a = dict(
        v=rnd(batch, steps, H, D),
        beta=torch.rand(batch, steps, H, generator=g).to(dtype),
        write_idx=idx(W),
        write_w=rnd(batch, steps, H, W, scale=0.5),
        read_idx=idx(R),
        read_w=rnd(batch, steps, H, R, scale=0.5),
        bank=rnd(*(() if shared else (banks,)), H, S, D),
        decay=None,
        cu_seqlens=torch.tensor(CU_SEQLENS, dtype=index_dtype) if varlen else None,
    )
    if decay:
        d = torch.rand(batch, steps, H, W, generator=g)
        u = torch.rand(batch, steps, H, W, generator=g)
        a["decay"] = torch.where(u < 0.1, 0.0, torch.where(u > 0.9, 1.0, d)).to(dtype)
    return a


def out_of_range(idx: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """(bad, padded): about a third of ``idx``'s entries (valid or padding alike) set to
    indices outside [0, S), respectively to -1; the other entries unchanged."""
    info = torch.iinfo(idx.dtype)
    far = 2**40 if idx.dtype == I64 else 2**30
    values = torch.tensor(
        [S, S + 1, S + 1000, far, info.max, -2, -S - 1, -far, info.min], dtype=idx.dtype
    )
    pick = torch.rand(idx.shape, generator=g) < BAD_FRACTION
    choice = values[torch.randint(0, len(values), idx.shape, generator=g)]
    return torch.where(pick, choice, idx), torch.where(pick, torch.full_like(idx, -1), idx)


def with_out_of_range(a: dict, seed: int) -> tuple[dict, dict, int]:
    """(bad, padded, number of bad entries): ``a`` with out-of-range write and read indices,
    and the same with -1 in their place."""
    g = torch.Generator().manual_seed(10_000 + seed)
    bad, padded = dict(a), dict(a)
    count = 0
    for name in ("write_idx", "read_idx"):
        bad[name], padded[name] = out_of_range(a[name], g)
        count += int((bad[name] != padded[name]).sum())
    return bad, padded, count


def to_device(a: dict, device: torch.device) -> dict:
    return {k: None if t is None else t.to(device) for k, t in a.items()}


def describe(dtype, snapshot, decay, shared, index_dtype, varlen=False) -> str:
    mode = "" if snapshot is None else f", snapshot {snapshot}"
    packed = f", cu_seqlens {list(CU_SEQLENS)}" if varlen else ""
    return (
        f"{DTYPE_NAMES[dtype]} bank{mode}, {'decay' if decay else 'no decay'}, "
        f"{'shared' if shared else 'per-stream'} bank, {DTYPE_NAMES[index_dtype]} indices"
        f"{packed}"
    )


# ---------------------------------------------------------------------------
# Calls and comparisons
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Eager calls of ``sparse_delta_memory(_)`` inside skip the checks that read data (the
    index range and ``cu_seqlens`` checks, which ``recurrence.data_checks_enabled`` gates), as
    compiled code and CUDA graph capture do, so that out-of-range indices reach the kernels."""
    with mock.patch.object(recurrence, "data_checks_enabled", lambda: False):
        yield


def kernels(device: torch.device, eager: bool = True):
    """Operators inside launch their Triton kernels: on CUDA always; on CPU under the
    interpreter, in eager mode only (compiled CPU code runs the reference path)."""
    if device.type == "cpu" and eager:
        return kernels_on_cpu()
    return contextlib.nullcontext()


def sdm(**args):
    """``sparse_delta_memory`` of ``args`` (``make_inputs``' names, ``snapshot``) at chunk size
    CHUNK, with the final state: what the eager cases call and the compiled ones compile."""
    return sparse_delta_memory(**args, chunk_size=CHUNK, output_final_state=True)


def sdm_inplace(bank, *sequence, cu_seqlens=None):
    """``sparse_delta_memory_`` at chunk size CHUNK of ``bank``, then the tensors SEQUENCE
    names, in its order: what the in-place and CUDA graph cases call and compile."""
    return sparse_delta_memory_(
        **dict(zip(SEQUENCE, sequence)), bank=bank, chunk_size=CHUNK, cu_seqlens=cu_seqlens
    )


def forward_backward(
    fn: Callable, a: dict, snapshot: str, g_out: Tensor, g_bank: Tensor
) -> dict[str, Tensor]:
    """out, bank and the gradient of every float input of ``loss = <out, g_out> + <bank,
    g_bank>`` for ``fn`` (``sdm`` or a compiled ``sdm``)."""
    leaves = {k: a[k].detach().clone().requires_grad_() for k in FLOATS if a[k] is not None}
    out, bank = fn(**(a | leaves), snapshot=snapshot)
    loss = (out.float() * g_out).sum() + (bank.float() * g_bank).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"out": out.detach(), "bank": bank.detach()} | {
        f"d{k}": g for k, g in zip(leaves, grads)
    }


def inference(fn: Callable, a: dict) -> dict[str, Tensor]:
    """out and bank of ``fn`` (``sdm``) under ``torch.no_grad()``: the inference forward."""
    with torch.no_grad():
        out, bank = fn(**a)
    return {"out": out, "bank": bank}


def inplace(fn: Callable, a: dict) -> dict[str, Tensor]:
    bank = a["bank"].clone()
    out = fn(bank, *(a[k] for k in SEQUENCE), cu_seqlens=a["cu_seqlens"])
    return {"out": out, "bank": bank}


def assert_same(got: dict[str, Tensor], want: dict[str, Tensor], what: str) -> str:
    """Bitwise equal tensors under every name; returns the names compared."""
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            raise AssertionError(
                f"{name}: {g.dtype} {list(g.shape)} against {what}'s {w.dtype} {list(w.shape)}"
            )
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs()
            where = [
                int(i)
                for i in torch.unravel_index(diff.nan_to_num(float("inf")).argmax(), diff.shape)
            ]
            raise AssertionError(
                f"{name} differs from {what}: max abs diff "
                f"{diff.nan_to_num(float('inf')).max().item():.3e} at {where}"
            )
    return ", ".join(want)


def assert_close(got: Tensor, want: Tensor, rtol: float, name: str) -> None:
    """|got - want| <= rtol * max(max |want|, 1) everywhere (float64 comparison)."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    tol = rtol * max(w.abs().max().item() if w.numel() else 0.0, 1.0)
    err = (g - w).abs().nan_to_num(float("inf")).max().item() if w.numel() else 0.0
    if g.shape != w.shape or err > tol:
        raise AssertionError(
            f"{name}: max abs diff {err:.3e} > {tol:.3e} (shape "
            f"{list(g.shape)} against {list(w.shape)})"
        )


# ---------------------------------------------------------------------------
# The parts
# ---------------------------------------------------------------------------


def functional_configs() -> Iterator[tuple[torch.dtype, str, bool, bool, torch.dtype]]:
    """Every (bank dtype, snapshot, decay, shared, index dtype) of the eager part; int32 and
    int64 indices alternate so that each bank dtype and snapshot sees both."""
    for dtype in (F32, BF16):
        for snapshot in SNAPSHOTS:
            for decay in (True, False):
                for shared in (False, True):
                    yield dtype, snapshot, decay, shared, I32 if decay != shared else I64


COMPILED_CONFIGS = (  # each snapshot, both bank dtypes, decay and sharing both ways
    (F32, "none", True, False, I64),
    (BF16, "fp8", False, True, I32),
    (F32, "int4", True, True, I32),
    (BF16, "bf16", True, False, I64),
)
VARLEN_CONFIGS = ((F32, "none", True, False, I64), (BF16, "int4", False, True, I32))
INPLACE_CONFIGS = ((F32, True, I64), (BF16, False, I32))
INFERENCE_CONFIGS = ((F32, None, True, False, I64), (BF16, None, False, True, I32))


def padded_comparison(
    inputs: dict,
    seed: int,
    device: torch.device,
    eager: bool,
    call: Callable[[dict], dict[str, Tensor]],
) -> str:
    """``call`` on ``make_inputs(**inputs, seed=seed)`` with out-of-range indices mixed in
    (unchecked when ``eager``) and on the same indices padded with -1 instead; every result
    must be bitwise equal."""
    bad, padded, count = with_out_of_range(make_inputs(**inputs, seed=seed), seed)
    bad, padded = to_device(bad, device), to_device(padded, device)
    with kernels(device, eager):
        with unchecked() if eager else contextlib.nullcontext():
            got = call(bad)
        want = call(padded)
    names = assert_same(got, want, "the padded call")
    return f"{count} out-of-range indices; {names} equal the padded call"


def functional_case(
    fn: Callable, config: tuple, seed: int, device: torch.device, eager: bool, varlen: bool = False
) -> Callable[[], str]:
    """``fn`` (``sdm`` when ``eager``, else a compiled ``sdm``) forward and backward on bad
    indices and on the padded ones."""
    dtype, snapshot, decay, shared, index_dtype = config
    inputs = dict(dtype=dtype, decay=decay, shared=shared, index_dtype=index_dtype, varlen=varlen)

    def run() -> str:
        banks = len(CU_SEQLENS) - 1 if varlen else B
        g = torch.Generator().manual_seed(20_000 + seed)
        g_out = torch.randn(B, T, H, D, generator=g).to(device)
        g_bank = torch.randn(banks, H, S, D, generator=g).to(device)
        return padded_comparison(
            inputs, seed, device, eager, lambda x: forward_backward(fn, x, snapshot, g_out, g_bank)
        )

    return run


def inplace_case(
    fn: Callable, config: tuple, seed: int, device: torch.device, eager: bool, varlen: bool = False
) -> Callable[[], str]:
    """``fn`` (``sdm_inplace`` or a compiled one) on bad indices and on the padded ones."""
    dtype, decay, index_dtype = config
    inputs = dict(dtype=dtype, decay=decay, shared=False, index_dtype=index_dtype, varlen=varlen)

    def run() -> str:
        with torch.no_grad():
            return padded_comparison(inputs, seed, device, eager, lambda x: inplace(fn, x))

    return run


def inference_case(
    config: tuple, seed: int, device: torch.device, varlen: bool = False
) -> Callable[[], str]:
    """The eager ``sdm`` without autograd on bad indices and on the padded ones."""
    dtype, _, decay, shared, index_dtype = config
    inputs = dict(dtype=dtype, decay=decay, shared=shared, index_dtype=index_dtype, varlen=varlen)

    def run() -> str:
        return padded_comparison(inputs, seed, device, True, lambda x: inference(sdm, x))

    return run


def eager_check_rejects_bad_indices(device: torch.device) -> str:
    """Without :func:`unchecked` and with strict checks on, the eager public function refuses
    the bad indices: the eager cases reach the kernels only through it. On a GPU the default
    (no strict checks) reads no data: there the bad call equals the padded one bitwise."""
    a = make_inputs(dtype=F32, decay=True, shared=False, index_dtype=I64, seed=0)
    bad, padded, count = with_out_of_range(a, 0)
    bad, padded = to_device(bad, device), to_device(padded, device)
    default = ""
    if device.type == "cuda":
        got, want = inference(sdm, bad), inference(sdm, padded)
        names = assert_same(got, want, "the padded call")
        default = f"; by default {count} out-of-range indices: {names} equal the padded call"
    try:
        with kernels(device), torch.no_grad(), strict_checks():
            sdm(**bad)
    except ValueError as e:
        return f"strict: raises ValueError: {e}{default}; the eager cases below run unchecked()"
    raise AssertionError("sparse_delta_memory accepted out-of-range indices in strict mode")


def graph_case(
    config: tuple, seed: int, varlen: bool = False, steps: int = 6, batch: int = 2
) -> Callable[[], str]:
    """Decode steps of ``sparse_delta_memory_`` captured once with bad indices in the static
    inputs and replayed token by token, against eager steps on the padded indices. ``varlen``:
    the ``batch`` streams' tokens packed into one ``[1, batch, ...]`` step with ``cu_seqlens``
    ``0, 1, ..., batch``."""
    dtype, decay, index_dtype = config

    def token(src: Tensor | None, t: int) -> Tensor | None:
        if src is None:
            return None
        one = src[:, t : t + 1]
        return one.transpose(0, 1) if varlen else one

    def run() -> str:
        a = make_inputs(
            dtype=dtype,
            decay=decay,
            shared=False,
            index_dtype=index_dtype,
            seed=seed,
            batch=batch,
            steps=steps,
        )
        bad, padded, count = with_out_of_range(a, seed)
        bad, padded = to_device(bad, "cuda"), to_device(padded, "cuda")
        cu = torch.arange(batch + 1, dtype=index_dtype, device="cuda") if varlen else None
        tokens = [bad[k] for k in SEQUENCE]
        static = [
            None if t is None else token(t, 0).clone(memory_format=torch.contiguous_format)
            for t in tokens
        ]
        bank = bad["bank"].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), unchecked():  # warm up off the graph
            scratch = bank.clone()
            for _ in range(2):
                sdm_inplace(scratch, *static, cu_seqlens=cu)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # capture skips the index check
            static_out = sdm_inplace(bank, *static, cu_seqlens=cu)
        eager_bank = padded["bank"].clone()
        for t in range(steps):
            for buf, src in zip(static, tokens):
                if buf is not None:
                    buf.copy_(token(src, t))
            graph.replay()
            want = sdm_inplace(eager_bank, *(token(padded[k], t) for k in SEQUENCE), cu_seqlens=cu)
            torch.cuda.synchronize()
            assert_same(
                {"out": static_out, "bank": bank},
                {"out": want, "bank": eager_bank},
                f"eager step {t} on the padded indices",
            )
        return (
            f"{count} out-of-range indices over {steps} replays; out and bank equal "
            f"eager steps on the padded indices"
        )

    return run


# The last two: factors wider than one warp's loads (float32 over 128 columns, bfloat16 over
# 256), whose programs take one warp and at most 2048 bytes of rows (float32 (256, 256) at
# k = 8: 2 rows a program; bfloat16's 8), and a factor of two 512-column chunks.
# TOPK_LEAD's 7 rows leave the last program of every one of them partly masked but where a
# program takes one row.
TOPK_LEAD = (1, 7)
TOPK_CONFIGS = (
    ((4, 8), 3),
    ((3, 5, 2), 7),
    ((2, 3, 2, 2), 5),
    ((16,), 4),
    ((2, 3), 8),
    ((256, 256), 8),
    ((1024, 4), 16),
)


def make_raw(factors: tuple[int, ...], dtype: torch.dtype, special: bool, seed: int) -> Tensor:
    """raw [*TOPK_LEAD, sum(factors)] on the CPU: normals, or small integers (many ties) with
    NaN, +-inf and -0 sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    size = (*TOPK_LEAD, sum(factors))
    if not special:
        return torch.randn(size, generator=g).to(dtype)
    raw = torch.randint(0, 3, size, generator=g).to(F32)
    pick = torch.randint(0, 8, size, generator=g)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    return torch.where(pick < 4, specials[pick.clamp(max=3)], raw).to(dtype)


def topk_case(
    factors: tuple[int, ...],
    k: int,
    dtype: torch.dtype,
    special: bool,
    seed: int,
    device: torch.device,
) -> Callable[[], str]:
    def run() -> str:
        raw = make_raw(factors, dtype, special, seed)
        kk = min(k, torch.Size(factors).numel())
        g = torch.Generator().manual_seed(seed)
        grad_val = torch.randn(*TOPK_LEAD, kk, generator=g).to(dtype)
        leaf = raw.to(device).requires_grad_()
        with kernels(device):
            val, lin = product_key_topk(leaf, factors, k)
            (grad,) = torch.autograd.grad(val, leaf, grad_val.to(device))
        val, lin, grad = val.detach().cpu(), lin.cpu(), grad.cpu()
        rval, rlin = reference.product_key_topk_bruteforce(raw, factors, k)
        rgrad = reference.product_key_topk_backward_reference(rlin, grad_val, factors).to(dtype)
        if not torch.equal(lin, rlin):
            raise AssertionError(
                f"lin differs from the reference at {(lin != rlin).nonzero()[0].tolist()}"
            )
        bits = torch.int16 if dtype == BF16 else torch.int32
        same = (val.view(bits) == rval.view(bits)) | (val.isnan() & rval.isnan())
        if not bool(same.all()):
            raise AssertionError(
                f"val differs from the reference at {(~same).nonzero()[0].tolist()}"
            )
        assert_same({"grad": grad}, {"grad": rgrad}, "the reference")
        return "val, lin and the gradient equal the reference"

    return run


WY_CHUNKS = (1, 5, 16, 33, 128)


def wy_case(c: int, seed: int, device: torch.device, n: int = 3) -> Callable[[], str]:
    def run() -> str:
        g = torch.Generator().manual_seed(seed)
        A = torch.randn(n, c, c, generator=g) * (0.5 / c**0.5)
        beta = torch.rand(n, c, generator=g) * 0.98 + 0.01
        QK = torch.randn(n, c, c, generator=g) / c**0.5
        dX, dQX = torch.randn(n, c, c, generator=g), torch.randn(n, c, c, generator=g)
        leaves = [t.to(device).requires_grad_() for t in (A, beta, QK)]
        with kernels(device):
            X, QX = wy_solve(*leaves)
            grads = torch.autograd.grad((X, QX), leaves, (dX.to(device), dQX.to(device)))
        ref = [t.double().requires_grad_() for t in (A, beta, QK)]
        rX, rQX = reference.wy_solve_reference(*ref)
        rgrads = torch.autograd.grad((rX, rQX), ref, (dX.double(), dQX.double()))
        for name, got, want in zip(
            ("X", "QX", "dA", "dbeta", "dQK"), (X, QX, *grads), (rX, rQX, *rgrads)
        ):
            assert_close(got, want, 1e-5, name)
        return "X, QX, dA, dbeta, dQK equal the float64 reference to 1e-5"

    return run


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


class Cases:
    """Runs cases one by one, printing a line each; a failing case is reported and the run
    goes on."""

    def __init__(self):
        self.count = 0
        self.failed: list[str] = []
        self.start = time.perf_counter()

    def run(self, part: str, label: str, case: Callable[[], str]) -> None:
        self.count += 1
        t0 = time.perf_counter()
        try:
            detail = case()
        except Exception as e:  # noqa: BLE001  (report every case, then the summary)
            self.failed.append(f"{part} {label}")
            print(f"{part:<8} {label}: FAILED: {type(e).__name__}: {e}", flush=True)
        else:
            print(f"{part:<8} {label}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)


def run_parts(parts: list[str], device: torch.device) -> Cases:
    cases = Cases()
    seeds = iter(range(1, 1000))

    def functional(part: str, fn: Callable, config: tuple, varlen: bool = False) -> None:
        cases.run(
            part,
            describe(*config, varlen=varlen) + note,
            functional_case(fn, config, next(seeds), device, part == "eager", varlen),
        )

    def in_place(part: str, fn: Callable, config: tuple, varlen: bool = False) -> None:
        dtype, decay, index_dtype = config
        cases.run(
            part,
            "in place, " + describe(dtype, None, decay, False, index_dtype, varlen) + note,
            inplace_case(fn, config, next(seeds), device, part == "eager", varlen),
        )

    note = ""
    if "eager" in parts:
        cases.run(
            "eager",
            "sparse_delta_memory, index check on (strict)",
            lambda: eager_check_rejects_bad_indices(device),
        )
        for config in functional_configs():
            functional("eager", sdm, config)
        for config in VARLEN_CONFIGS:
            functional("eager", sdm, config, varlen=True)
        for config in INPLACE_CONFIGS:
            in_place("eager", sdm_inplace, config)
        in_place("eager", sdm_inplace, INPLACE_CONFIGS[1], varlen=True)
        for config, varlen in (
            (INFERENCE_CONFIGS[0], False),
            (INFERENCE_CONFIGS[1], False),
            (INFERENCE_CONFIGS[1], True),
        ):
            cases.run(
                "eager",
                "inference forward, " + describe(*config, varlen=varlen),
                inference_case(config, next(seeds), device, varlen),
            )
    if "compiled" in parts:
        compiled = torch.compile(sdm, fullgraph=True)
        compiled_inplace = torch.compile(sdm_inplace, fullgraph=True)
        note = " (reference path)" if device.type == "cpu" else ""
        for config in COMPILED_CONFIGS:
            functional("compiled", compiled, config)
        functional("compiled", compiled, VARLEN_CONFIGS[0], varlen=True)
        in_place("compiled", compiled_inplace, INPLACE_CONFIGS[0])
        note = ""
    if "graphs" in parts:
        for config, varlen in (
            (INPLACE_CONFIGS[0], False),
            (INPLACE_CONFIGS[1], False),
            (INPLACE_CONFIGS[1], True),
        ):
            dtype, decay, index_dtype = config
            packed = ", packed with cu_seqlens [0, 1, 2]" if varlen else ""
            cases.run(
                "graphs",
                "decode steps, " + describe(dtype, None, decay, False, index_dtype) + packed,
                graph_case(config, next(seeds), varlen),
            )
    if "ops" in parts:
        for factors, k in TOPK_CONFIGS:
            for dtype, special in ((F32, True), (BF16, False)):
                label = (
                    f"product_key_topk factors {list(factors)} k {k} {DTYPE_NAMES[dtype]}"
                    f"{' with ties, NaN, inf, -0' if special else ''}"
                )
                cases.run("ops", label, topk_case(factors, k, dtype, special, next(seeds), device))
        for c in WY_CHUNKS:
            cases.run("ops", f"wy_solve C {c}", wy_case(c, next(seeds), device))
    return cases


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser()
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"unknown parts {unknown}; choose from {list(PARTS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(
                "tools/sanitize.py: needs a CUDA GPU (or --device cpu, the Triton interpreter)",
                file=sys.stderr,
            )
            return 2
        if "graphs" in parts and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
            print(
                "tools/sanitize.py: CUDA graph capture needs PyTorch's caching allocator; run "
                "the graphs part without PYTORCH_NO_CUDA_MEMORY_CACHING=1",
                file=sys.stderr,
            )
            return 2
    else:
        if not interpreting():  # triton is imported already: start again with it set
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
        if "graphs" in parts:
            print("graphs   skipped: CUDA graphs need a GPU", flush=True)
            parts.remove("graphs")
        # The interpreter computes inf - inf (top-k scores with infinities) in numpy, which warns.
        warnings.filterwarnings("ignore", "invalid value encountered", RuntimeWarning)
    device = torch.device(args.device)
    print(
        f"sanitize: torch {torch.__version__}, parts {','.join(parts)} on {device}; "
        f"B={B} H={H} T={T} D={D} S={S} W={W} R={R} chunk {CHUNK}",
        flush=True,
    )
    cases = run_parts(parts, device)
    took = time.perf_counter() - cases.start
    if cases.failed:
        print(
            f"sanitize: {cases.count} cases, {len(cases.failed)} FAILED ({took:.0f} s): "
            f"{'; '.join(cases.failed)}"
        )
        return 1
    print(
        f"sanitize: {cases.count} cases, all outputs equal the padded equivalent"
        f"{' (product_key_topk and wy_solve: the reference)' if 'ops' in parts else ''}"
        f" ({took:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
