"""Registers and spills of every kernel the reference workload launches, on a machine without
a GPU: what ptxas (the one bundled with Triton, for sm_90a) makes of each configuration.

The forward and backward of the reference workload's configuration (W = R = 8, D = 64, chunk
64, bfloat16 values; float32 and bfloat16 banks; every snapshot mode; the in-place forward) run
at a small B and T with every launch recorded instead of run, then each distinct launch is
compiled as the launcher would specialize it (which arguments are divisible by 16).
Usage, from the repository root: ``PYTHONPATH=. python tools/ptxas_report.py [CHUNK_SIZE]
[--triton DIR]`` (without TRITON_INTERPRET; a few minutes; the chunk size defaults to the
reference workload's 64). The GPU's own Triton, if another version, allocates registers
differently: ``pip install --target DIR triton==3.6.0`` and ``--triton DIR`` compile with it.
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
        prog="PYTHONPATH=. python tools/ptxas_report.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--triton",
        metavar="DIR",
        help="compile with the Triton installed in DIR (pip install --target DIR triton==X), "
        "and its ptxas: the GPU's own compiler where it differs from this one",
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

import torch  # noqa: E402

import sdm_ops
from benchmarks import bench
from sdm_ops.kernels._common import _ON_CPU
from tests.test_kernels_compile_sm90 import _recording, _signature, python_function

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


def _record_walks(calls: list, chunk_size: int) -> None:
    """Run every call of ``_launches`` with its launches recorded in ``calls``, not run."""
    floats = ("v", "beta", "write_w", "read_w", "bank", "decay")
    with _recording(calls, run=False):
        for bank_dtype in (torch.float32, torch.bfloat16):
            # S = 4096 > T (W + R): a numbered working set; S = 1024: the slots themselves.
            for S in (4096, 1024):
                a = bench.make_workload(
                    1, 128, 2, 64, S, 8, 8, decay=True, bank_dtype=bank_dtype, dev="cpu"
                )
                for name in floats:
                    a[name].requires_grad_()
                for mode in ("none", "bf16", "fp8", "int4") if S == 4096 else ("none",):
                    for final in (True, False):
                        out, bank = sdm_ops.sparse_delta_memory(
                            **a, snapshot=mode, chunk_size=chunk_size, output_final_state=final
                        )
                        loss = out.float().sum() + (bank.float().sum() if final else 0)
                        torch.autograd.grad(loss, [t for t in a.values() if t.requires_grad])
                with torch.no_grad():
                    for final in (True, False):
                        sdm_ops.sparse_delta_memory(
                            **a, chunk_size=chunk_size, output_final_state=final
                        )
                    state = a["bank"].expand(1, *a["bank"].shape[-3:]).clone()
                    rest = {k: x for k, x in a.items() if k != "bank"}
                    sdm_ops.sparse_delta_memory_(**rest, bank=state, chunk_size=chunk_size)
                    sdm_ops.sparse_delta_memory_(
                        **{k: x[:, :1] for k, x in rest.items()}, bank=state
                    )


def _launches(chunk_size: int = 64) -> list:
    """Signatures of the distinct launches of the reference workload's configuration: every
    variant of phase 2's walks the operators launch (with the final state in every snapshot
    mode, the default call without it on a numbered working set and on the slots themselves,
    each with and without autograd, the in-place forward and the decode step)."""
    calls: list = []
    # The operators take the kernel path on CPU tensors (nothing runs), in this call only: the
    # flag is reset however the call ends, so that later calls in the same process (the other
    # tests of a pytest run) take the CPU reference again.
    token = _ON_CPU.set(True)
    try:
        _record_walks(calls, chunk_size)
    finally:
        _ON_CPU.reset(token)
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
    fn = python_function(kernel)
    names = list(fn.__code__.co_varnames[: fn.__code__.co_argcount])
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})  # not num_warps
    return [
        n
        for n, v in bound.items()
        if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0)
        or (isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0)
    ]


def registers(launches: list, triton_dir: str | None = None) -> list[dict]:
    """Each launch's registers and spilled bytes a thread, compiled for sm_90a by this Triton
    and its ptxas, or by the Triton installed in ``triton_dir`` (``pip install --target``) and
    the ptxas it carries: ``[{"name", "regs", "spill", "consts", "types", "warps"}]``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root] + ([os.path.abspath(triton_dir)] if triton_dir else [])
    env["PYTHONPATH"] = os.pathsep.join(paths[::-1] + [env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE],
        input=json.dumps(launches),
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    if triton_dir:
        ptxas = os.path.join(triton_dir, "triton", "backends", "nvidia", "bin", "ptxas")
    else:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90)
        ptxas = getattr(ptxas, "path", ptxas)
    rows = []
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
        rows.append(
            dict(
                name=name,
                regs=int(regs.group(1)) if regs else None,
                spill=int(spill.group(1)) if spill else None,
                consts={k: v for k, v in consts.items() if v is not None and k != "D"},
                types={k: v for k, v in sig.items() if k in ("bank", "snap")},
                warps=options.get("num_warps"),
                cap=options.get("maxnreg"),
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("run without TRITON_INTERPRET: the kernels are compiled, not interpreted")
    rows = registers(_launches(args.chunk_size), args.triton)
    print(f"{'kernel':<26}{'regs':>5}{'spill B':>8}  constexprs")
    for r in rows:
        types = ",".join(f"{k}={v}" for k, v in r["types"].items())
        spill = "?" if r["spill"] is None else r["spill"]
        print(
            f"{r['name']:<26}{r['regs'] or '?':>5}{spill:>8}"
            f"  {r['consts']} {types} warps={r['warps']}" + (f" cap={r['cap']}" if r["cap"] else "")
        )


if __name__ == "__main__":
    main()
