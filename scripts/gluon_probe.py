"""Whether a Gluon kernel (Triton's explicit-layout language, ``triton.experimental.gluon``) can
be one of sdm_ops' operators as the Triton kernels are: launched through ``wrap_triton`` inside
a ``torch.library.triton_op``, compiled by ``torch.compile(fullgraph=True)`` with Inductor
splicing it into its output as a user-defined kernel, and captured in a CUDA graph
(PERF_NOTES 58; the question behind entry 36's "a different kernel").

The kernel is a row gather (out[i] = src[idx[i]]) with its layout written out. Each step
prints ok or the exception it raised; the compiled step also says whether Inductor's output
code holds the kernel's definition and under which decorator. On a GPU machine:
``PYTHONPATH=. python scripts/gluon_probe.py``. (On the CPU the kernel compiles for sm_90 but
does not run under ``TRITON_INTERPRET=1``: Triton's interpreter asks for a GPU driver.)
"""

from __future__ import annotations

import re
import traceback

import torch
import triton
from torch.library import triton_op, wrap_triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _gluon_gather_rows(src, idx, out, D: gl.constexpr, BR: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8],
                                            warps_per_cta=[4, 1], order=[1, 0])
    rows = gl.program_id(0) * BR + gl.arange(0, BR, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    i = gl.load(idx + rows)
    x = gl.load(src + i[:, None] * D + cols[None, :])
    gl.store(out + rows[:, None] * D + cols[None, :], x)


@triton_op("sdm_probe::gluon_gather_rows", mutates_args=())
def gluon_gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    out = src.new_empty((idx.shape[0], src.shape[1]))
    wrap_triton(_gluon_gather_rows)[(idx.shape[0] // 32,)](src, idx, out, D=src.shape[1], BR=32,
                                                           num_warps=4)
    return out


def _step(name, fn):
    try:
        print(f"{name}: {fn()}")
    except Exception as e:  # noqa: BLE001 - a probe reports whatever fails
        print(f"{name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        traceback.print_exc(limit=3)


def main() -> None:
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}")
    src = torch.randn(4096, 64, device="cuda")
    idx = torch.randint(0, 4096, (1024,), device="cuda")
    want = src[idx]

    def eager():
        return "ok" if torch.equal(gluon_gather_rows(src, idx), want) else "WRONG"

    def compiled():
        from torch._inductor.utils import run_and_get_code
        fn = torch.compile(lambda s, i: gluon_gather_rows(s, i) * 2, fullgraph=True)
        got, codes = run_and_get_code(fn, src, idx)
        code = "\n".join(codes)
        at = code.find("def _gluon_gather_rows(")
        decorator = re.findall(r"@[\w.]+", code[max(0, at - 200):at]) if at >= 0 else []
        return (f"{'ok' if torch.equal(got, want * 2) else 'WRONG'}; kernel in output code: "
                f"{at >= 0}; decorator before it: {decorator[-1:] or None}")

    def graph():
        out = gluon_gather_rows(src, idx)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = gluon_gather_rows(src, idx)
        src.mul_(3)
        g.replay()
        torch.cuda.synchronize()
        return "ok" if torch.equal(out, src[idx]) else "WRONG"

    _step("eager (triton_op + wrap_triton)", eager)
    _step("torch.compile(fullgraph=True)", compiled)
    _step("CUDA graph capture and replay", graph)


if __name__ == "__main__":
    main()
