"""Registers and spills of every kernel the reference workload launches, on a machine without
a GPU: what ptxas (the one bundled with Triton, for sm_90a) makes of each configuration.

The forward and backward of the reference workload's configuration (W = R = 8, D = 64, chunk
64, bfloat16 values; float32 and bfloat16 banks; every snapshot mode; the in-place forward) run
at a small B and T with every launch recorded instead of run, then each distinct launch is
compiled as the launcher would specialize it (which arguments are divisible by 16).
Usage, from the repository root: ``PYTHONPATH=. python tools/ptxas_report.py [CHUNK_SIZE]``
(without TRITON_INTERPRET; a few minutes; the chunk size defaults to the reference workload's
64). The GPU's own Triton, if another version, may allocate registers differently.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="PYTHONPATH=. python tools/ptxas_report.py",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "chunk_size",
        nargs="?",
        type=int,
        default=64,
        metavar="CHUNK_SIZE",
        help="the recurrence's chunk (default 64, the reference workload's)",
    )
    return parser


if __name__ == "__main__":
    build_parser().parse_args()  # --help and malformed options end here, before torch loads

import torch

import sdm_ops
from sdm_ops import bench
from sdm_ops.kernels._common import _ON_CPU
from tests.test_kernels_compile_sm90 import _recording, _signature

_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for module, name, sig, consts, options, divisible in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(module), name)
    index = {n: i for i, n in enumerate(kernel.arg_names)}
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in divisible if sig[n] != "constexpr"}
    consts = {(index[k],): v for k, v in consts.items()}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    print(json.dumps([name, out.asm["ptx"]]))
"""


def _launches(chunk_size: int = 64) -> list:
    """Signatures of the distinct launches of the reference workload's configuration."""
    calls: list = []
    _ON_CPU.set(True)  # the operators take the kernel path on CPU tensors; nothing runs
    with _recording(calls, run=False):
        for bank_dtype in (torch.float32, torch.bfloat16):
            a = bench.make_workload(
                1, 128, 2, 64, 4096, 8, 8, decay=True, bank_dtype=bank_dtype, dev="cpu"
            )
            for name in ("v", "beta", "write_w", "read_w", "bank", "decay"):
                a[name].requires_grad_()
            for mode in ("none", "bf16", "fp8", "int4"):
                out, bank = sdm_ops.sparse_delta_memory(
                    **a, snapshot=mode, chunk_size=chunk_size, output_final_state=True
                )
                loss = out.float().sum() + bank.float().sum()
                torch.autograd.grad(loss, [t for t in a.values() if t.requires_grad])
            with torch.no_grad():
                sdm_ops.sparse_delta_memory(**a, chunk_size=chunk_size, output_final_state=True)
    seen, unique = set(), []
    for launch in calls:
        sig = _signature(*launch) + (_divisible(*launch),)
        key = json.dumps(sig[1:], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            unique.append(sig)
    return unique


def _divisible(kernel, args, kwargs) -> list:
    """The arguments Triton's launcher specializes as divisible by 16 (pointers 16-byte
    aligned, integers multiples of 16): without them a kernel compiles to other code (scalar
    instead of vector loads, and other register counts) than it runs as."""
    fn = kernel.fn if hasattr(kernel, "fn") else kernel
    names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})  # not num_warps
    return [
        n
        for n, v in bound.items()
        if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0)
        or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0)
    ]


def main() -> None:
    chunk_size = build_parser().parse_args().chunk_size
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
    launches = _launches(chunk_size)
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        input=json.dumps(launches),
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    print(f"{'kernel':<26}{'regs':>5}{'spill B':>8}  constexprs")
    for line, (_, _, sig, consts, options, _) in zip(done.stdout.strip().splitlines(), launches):
        name, ptx = json.loads(line)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            info = subprocess.run(
                [ptxas, "-v", "--gpu-name=sm_90a", path, "-o", os.path.join(tmp, "k.cubin")],
                capture_output=True,
                text=True,
            ).stderr
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores", info)
        shown = {k: v for k, v in consts.items() if v is not None and k not in ("D",)}
        types = ",".join(f"{k}={v}" for k, v in sig.items() if k in ("bank", "snap"))
        print(
            f"{name:<26}{regs.group(1) if regs else '?':>5}{spill.group(1) if spill else '?':>8}"
            f"  {shown} {types} warps={options.get('num_warps')}"
        )


if __name__ == "__main__":
    main()
