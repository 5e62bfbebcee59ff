"""Every Triton kernel compiles for the H200 (sm_90), in the configurations ``_launches`` runs:
chunk sizes 16, 32 and 128 (and 64 in the in-place forward), head dims 16, 32, 64 and 256,
float32 and bfloat16 values and banks, every snapshot mode, the one-tile and tiled phase 2,
packed batches, the in-place and decode forwards, product-key top-k in float32 and bfloat16
and the WY solve. Triton's interpreter runs kernels without compiling them, so a kernel can
pass every CPU test and still fail to compile for a GPU; this test compiles them here, with
no GPU, through Triton's own compiler (down to PTX and machine code with the bundled ptxas).
It covers a configuration only if ``_launches`` reaches it: a kernel's constexprs (the chunk
size, D, W and R rounded up to powers of two, the snapshot mode, the dtypes) pick what it
compiles, so a new kind of launch belongs there. (On a GPU the kernel tests compile every
kernel they run, and the compile test below is skipped.)

And Inductor sees each kernel write only its outputs. ``torch.compile`` decides which tensors a
user-defined Triton kernel mutates by analysing its Triton IR; a tensor it wrongly counts as
written (an index tensor, say) is cloned before every launch and copied back afterwards, into
the caller's own inputs when they are graph inputs. The analysis runs here on every launch."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import pytest
import torch

import sdm_ops
from sdm_ops.kernels import recurrence_fwd
from tests.helpers import (
    HAS_CUDA,
    KERNEL_DEVICE,
    kernel_modules,
    make_packed_sdm_inputs,
    make_sdm_inputs,
    on_kernels,
    requires_kernels,
)

triton = pytest.importorskip("triton")

pytestmark = requires_kernels

_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
    torch.float8_e4m3fn: "*fp8e4nv",
}


@contextlib.contextmanager
def _recording(calls: list, run: bool = True):
    """Record every (kernel, positional args, keyword args) launched through wrap_triton, and
    launch it unless ``run`` is False (``tools/ptxas_report.py`` only records)."""
    import torch.library

    modules = kernel_modules()
    real = torch.library.wrap_triton

    def wrap(kernel):
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    calls.append((kernel, args, kwargs))
                    return launcher[grid](*args, **kwargs) if run else None

                return launch

        return Grid()

    saved = [(m, m.wrap_triton) for m in modules if hasattr(m, "wrap_triton")]
    for m, _ in saved:
        m.wrap_triton = wrap
    try:
        yield
    finally:
        for m, f in saved:
            m.wrap_triton = f


def python_function(kernel):
    """The Python function behind a launched kernel: through an autotuner to its JITFunction,
    and through that to the function it compiles."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _signature(kernel, args, kwargs):
    """(module, name, signature, constexprs, options) of one launch, as JSON-able values."""
    fn = python_function(kernel)
    code = fn.__code__
    names = list(code.co_varnames[: code.co_argcount])
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    for config in getattr(kernel, "configs", ()):  # a one-config autotuner: its launch options
        options.update(num_warps=config.num_warps, maxnreg=config.maxnreg)
    constexpr = {n for n, ann in fn.__annotations__.items() if "constexpr" in str(ann)}
    sig, consts = {}, {}
    for name in names:
        value = bound[name]
        if name in constexpr or value is None:
            sig[name] = "constexpr"
            consts[name] = value
        elif isinstance(value, torch.Tensor):
            sig[name] = _TYPES[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return fn.__module__, fn.__name__, sig, consts, options


# Runs in a fresh interpreter without TRITON_INTERPRET, where triton.jit makes real kernels.
_COMPILER = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failures = []
for module, name, sig, consts, options in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    index = {n: i for i, n in enumerate(kernel.arg_names)}
    try:
        constexprs = {(index[k],): v for k, v in consts.items()}
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as e:
        failures.append(f"{name} {consts}: {str(e).strip().splitlines()[-1][:400]}")
print(json.dumps(failures))
"""


def _launches():
    """Run the forward and backward over configurations that cover the kernels' branches."""
    calls: list = []
    cases = [
        dict(T=20, W=3, R=2, D=16),
        dict(T=20, W=2, R=5, D=32, decay=False),
        dict(T=9, W=0, R=2, D=64),
        dict(T=40, W=8, R=8, D=16),
    ]
    tiles = [None] * len(cases) + [128]  # the last case: phase 2 over tiles of 2 tokens
    cases.append(dict(T=20, W=3, R=2, D=16))
    # _out_kernel's launches: the walk leaves out to it whatever the device's SM count (the
    # walk that forms out itself is run below).
    with _recording(calls), on_kernels(), mock.patch.object(recurrence_fwd, "_WALK_SMS", 0):
        for i, (case, tile) in enumerate(zip(cases, tiles)):
            with mock.patch.object(recurrence_fwd, "_TILE", tile or recurrence_fwd._TILE):
                a = make_sdm_inputs(B=1, H=1, S=9, seed=i, device=KERNEL_DEVICE, **case)
                for name in ("v", "beta", "write_w", "read_w", "bank", "decay"):
                    if name in a:
                        a[name].requires_grad_()
                for c, mode in ((16, "none"), (32, "fp8"), (16, "int4"), (16, "bf16")):
                    out, bank = sdm_ops.sparse_delta_memory(
                        **a, chunk_size=c, snapshot=mode, output_final_state=True
                    )
                    (out.sum() + bank.sum()).backward()
                # A loss on the bank alone: the backward without an output gradient.
                sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)[
                    1
                ].sum().backward()
                with torch.no_grad():
                    state = a["bank"].detach().clone()
                    rest = {k: v.detach() for k, v in a.items() if k != "bank"}
                    sdm_ops.sparse_delta_memory_(bank=state, **rest)
                    sdm_ops.sparse_delta_memory_(
                        bank=state, **{k: v[:, :1] for k, v in rest.items()}
                    )
        # The largest chunk (two chunks of 128), the widest rows and bfloat16 values and banks,
        # each through the forward with a quantized snapshot, the backward and the in-place
        # forward.
        for i, (case, c) in enumerate(
            (
                (dict(T=130, W=2, R=2, D=16), 128),
                (dict(T=20, W=3, R=2, D=256), 16),
                (dict(T=20, W=3, R=2, D=16, dtype=torch.bfloat16), 16),
                (dict(T=20, W=3, R=2, D=16, bank_dtype=torch.bfloat16), 16),
            )
        ):
            a = make_sdm_inputs(B=1, H=1, S=9, seed=20 + i, device=KERNEL_DEVICE, **case)
            for name in ("v", "beta", "write_w", "read_w", "bank", "decay"):
                a[name].requires_grad_()
            out, bank = sdm_ops.sparse_delta_memory(
                **a, chunk_size=c, snapshot="int4", output_final_state=True
            )
            (out.float().sum() + bank.float().sum()).backward()
            with torch.no_grad():
                state = a["bank"].detach().clone()
                rest = {k: v.detach() for k, v in a.items() if k != "bank"}
                sdm_ops.sparse_delta_memory_(bank=state, **rest, chunk_size=c)
                sdm_ops.sparse_delta_memory_(bank=state, **{k: v[:, :1] for k, v in rest.items()})
        # A packed batch: the chunk tables and every phase's VARLEN branch.
        a = make_packed_sdm_inputs(
            [0, 7, 20, 3], H=1, D=16, S=9, W=3, R=2, seed=9, device=KERNEL_DEVICE
        )
        for name in ("v", "beta", "write_w", "read_w", "bank", "decay"):
            a[name].requires_grad_()
        out, bank = sdm_ops.sparse_delta_memory(**a, chunk_size=16, output_final_state=True)
        (out.sum() + bank.sum()).backward()
        with torch.no_grad():
            sdm_ops.sparse_delta_memory_(
                bank=a["bank"].detach().clone(),
                **{k: v.detach() for k, v in a.items() if k != "bank"},
            )
        # The walk that forms out itself (where its programs are no more than the SMs).
        with mock.patch.object(recurrence_fwd, "_WALK_SMS", 1 << 20), torch.no_grad():
            sdm_ops.sparse_delta_memory_(
                bank=a["bank"].detach().clone(),
                **{k: v.detach() for k, v in a.items() if k != "bank"},
            )
            d = make_sdm_inputs(B=1, H=1, S=9, T=20, W=3, R=2, D=16, seed=5, device=KERNEL_DEVICE)
            sdm_ops.sparse_delta_memory_(bank=d.pop("bank"), **d)
        # The inference forward's bounded bank copy (a GPU runs it beside phase 1).
        sdm_ops.ops.bank_copy(torch.randn(1, 9, 16, device=KERNEL_DEVICE), 2, 1)
        for dtype in (torch.float32, torch.bfloat16):
            raw = torch.randn(3, 4 + 5 + 3, dtype=dtype, device=KERNEL_DEVICE, requires_grad=True)
            sdm_ops.product_key_topk(raw, (4, 5, 3), 7).val.sum().backward()
            # The backward's scatter form, with its slots loaded a slot at a time (k = 5) and
            # as tiles (k = 16).
            raw = torch.randn(3, 40 + 2, dtype=dtype, device=KERNEL_DEVICE, requires_grad=True)
            for k in (5, 16):
                sdm_ops.product_key_topk(raw, (40, 2), k).val.sum().backward()
            # A factor merged chunk by chunk (three chunks) with a short list.
            with torch.no_grad():
                sdm_ops.product_key_topk(
                    torch.randn(2, 1100 + 2, dtype=dtype, device=KERNEL_DEVICE), (1100, 2), 3
                )
        A, QK = torch.randn(2, 2, 40, 40, device=KERNEL_DEVICE).unbind(0)
        beta = torch.rand(2, 40, device=KERNEL_DEVICE, requires_grad=True)
        X, QX = sdm_ops.wy_solve(A.requires_grad_(), beta, QK.requires_grad_())
        (X.sum() + QX.sum()).backward()
    seen, unique = set(), []
    for kernel, args, kwargs in calls:
        key = (
            kernel,
            tuple(
                type(a).__name__ if not isinstance(a, torch.Tensor) else str(a.dtype) for a in args
            ),
            tuple(sorted((k, v) for k, v in kwargs.items())),
        )
        if key not in seen:
            seen.add(key)
            unique.append((kernel, args, kwargs))
    return unique


# Inductor's analysis of which tensor arguments a kernel writes, per launch; a fresh interpreter
# without TRITON_INTERPRET (the analysis generates Triton IR), targeting sm_90 without a GPU.
_WRITES = r"""
import importlib, json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
if not torch.cuda.is_available():
    class _Sm90:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
    triton.runtime.driver.set_active(_Sm90())
from torch._higher_order_ops import triton_kernel_wrap as tkw
dtypes = json.loads(sys.argv[1])
result = []
for module, name, sig, consts, options in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    kwargs = {n: torch.empty(2, dtype=getattr(torch, dtypes[t])) if t in dtypes else 2
              for n, t in sig.items() if t != "constexpr"}
    kwargs.update(consts)
    if hasattr(tkw, "identify_accessed_tensors"):
        deps = tkw.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes
        written = [d.name for d in deps]
    else:
        written = tkw.identify_mutated_tensors(kernel, kwargs, {})
    result.append([name, sorted(n for n in written if torch.is_tensor(kwargs.get(n)))])
print(json.dumps(result))
"""

# Phase 1's per-entry outputs (``Prepared`` after A and QK): gather and scatter weights, row
# decays and ranks.
_LAYOUT = ("gather_w", "gather_r", "scatter_w", "row_decay", "rank", "read_rank")
# What each kernel writes (its outputs and scratch); every other tensor argument is read only.
_OUTPUTS = {
    "_bank_copy_kernel": {"dst"},
    "_first_writes_kernel": {"first"},
    "_finite_select_kernel": {
        "beta_out",
        "beta_walk",
        "write_w_out",
        "read_w_out",
        "decay_out",
        "bad_reads",
        "kept_beta",
        "kept_write_w",
        "kept_read_w",
        "kept_decay",
    },
    "_chunk_prepare_kernel": {"A", "QK", *_LAYOUT},
    "_chunk_prepare_bwd_kernel": {"d_write_w", "d_decay", "d_read_w"},
    "_chunk_sort_kernel": {*_LAYOUT, "shared_count", "compact"},
    "_chunk_pairs_kernel": {"A", "QK", *_LAYOUT},
    "_chunk_lone_bwd_kernel": {"d_write_w", "d_decay", "d_read_w"},
    "_chunk_pairs_bwd_kernel": {"d_write_w", "d_decay", "d_read_w"},
    "_recurrence_fwd_kernel": {
        "bank",
        "out",
        "res",
        "delta",
        "scratch",
        "snap",
        "snap_scale",
        "inter_buf",
    },
    "_out_kernel": {"out"},
    "_qx_dout_kernel": {"du"},
    "_recurrence_bwd_kernel": {"dbank", "ddelta", "du", "dv", "p_gw", "p_gr", "p_sw", "p_rd"},
    "_dual_matmul_bwd_kernel": {"dA", "dQK", "dbeta", "dgw", "dgr", "dsw", "drd"},
    "_decode_step_kernel": {"bank", "out"},
    "_varlen_chunks_kernel": {"chunks", "seq_chunks"},
    "_fwd_diag_kernel": {"X"},
    "_fwd_panel_kernel": {"X", "QX"},
    "_pairs_solve_kernel": {"X", "QX"},
    "_bwd_panel_kernel": {"G", "W"},
    "_bwd_row_kernel": {"dA", "dBeta", "dQK"},
    "_product_key_topk_fwd": {"val_ptr", "lin_ptr"},
    "_product_key_topk_bwd": {"grad_ptr"},
}


@functools.cache
def _launch_signatures() -> list:
    """The signatures of every distinct launch, recorded once for both tests below (running
    the launches under the interpreter takes over a minute)."""
    return [_signature(*launch) for launch in _launches()]


def _run_fresh(script: str, payload, *argv: str) -> list:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", script, *argv],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(HAS_CUDA, reason="on CUDA the kernel tests compile every kernel")
def test_every_launched_kernel_configuration_compiles_for_sm90():
    launches = _launch_signatures()
    names = {name for _, name, _, _, _ in launches}
    assert set(_OUTPUTS) <= names, f"kernels never launched: {set(_OUTPUTS) - names}"
    failures = _run_fresh(_COMPILER, launches)
    assert not failures, "kernels that do not compile for sm_90:\n" + "\n".join(failures)


# On CUDA the launches run natively, so recording them compiles every configuration above cold,
# one after another: about 7 minutes on an H100 before the analysis's 50 s. A slow test there.
@(pytest.mark.slow if HAS_CUDA else lambda test: test)
def test_inductor_counts_only_each_kernels_outputs_as_written():
    import json

    launches = _launch_signatures()
    dtypes = {t: str(d).removeprefix("torch.") for d, t in _TYPES.items()}
    seen = set()
    for name, written in _run_fresh(_WRITES, launches, json.dumps(dtypes)):
        seen.add(name)
        assert written, f"{name}: the analysis found no tensor written"
        extra = set(written) - _OUTPUTS[name]
        assert not extra, (
            f"{name}: Inductor counts read-only arguments {sorted(extra)} as "
            f"written, so compiled graphs clone them around every launch"
        )
    assert seen == set(_OUTPUTS), f"kernels not analysed: {set(_OUTPUTS) - seen}"
