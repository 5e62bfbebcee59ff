"""What the A/B scripts (``ab_phase2.py``, ``ab_wy.py``, ``ab_forward.py``) share: their
arguments, running a worker in a fresh process against each package copy, round after round,
and comparing sampled outputs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def run_variant(variant: str, worker: str, argv: list[str], path: str):
    """Run ``worker`` (Python source) with ``argv`` in a fresh process whose ``sdm_ops`` is
    the copy in directory ``variant``; return what the worker saved at ``path``.

    The process runs from the copy's own directory: ``python -c`` puts the working directory
    first on sys.path, ahead of PYTHONPATH, so from the repository root every variant would
    import the working tree's package."""
    import torch
    here = os.path.abspath(variant)
    subprocess.run([sys.executable, "-c", worker, *argv], env=dict(os.environ, PYTHONPATH=here),
                   cwd=here, check=True)
    return torch.load(path)


def largest_difference(want: dict, got: dict) -> float:
    """The largest difference between two variants' samples (name -> tensor) over every name,
    relative to the largest magnitude of ``want``'s sample of that name."""
    return max(((got[k] - x).abs().max() / x.abs().max().clamp(min=1e-30)).item()
               for k, x in want.items())


def print_differences(results: dict, variants: list[str]) -> None:
    """For every variant after the first, its largest sampled difference from the first's
    (``results[variant]["samples"]``, name -> tensor)."""
    first = results[variants[0]]["samples"]
    for v in variants[1:]:
        worst = largest_difference(first, results[v]["samples"])
        print(f"{v}: largest sampled difference from {variants[0]}: {worst:.2e} of the "
              "largest sampled value")


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every A/B script takes: the variants and the number of rounds."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("variants", nargs="+", help="directories holding an sdm_ops copy")
    p.add_argument("--rounds", type=int, default=1, help="time every variant this often")
    return p


def each_run(variants: list[str], rounds: int, worker: str, argv: list[str] = ()):
    """``(variant, result)`` for every variant, ``rounds`` times over: ``worker`` run by
    ``run_variant`` with the path it saves its result to, then ``argv``."""
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for v in variants:
                path = os.path.join(tmp, f"{r}-{os.path.basename(v.rstrip('/'))}.pt")
                yield v, run_variant(v, worker, [path, *argv], path)
