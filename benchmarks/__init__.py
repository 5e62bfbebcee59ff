"""The benchmarks and experiments of sdm_ops, run from the repository root: ``python -m
benchmarks.bench`` (times and memory on a CUDA GPU), ``python -m benchmarks.capacity`` (recall
against stored pairs beside a dense delta rule), ``python benchmarks/table.py`` (a results
file as Markdown tables) and ``python benchmarks/ab.py`` (two revisions side by side).
``_timing`` and ``_plot`` are their timer and figures; ``results/`` holds committed runs."""

# Imported here, while Python locates a `python -m benchmarks.<command>` (sys.argv[0] is then
# "-m"), sdm_ops loads only its light modules when --help is asked for (sdm_ops/__init__.py):
# the commands print their help before they import torch.
import sdm_ops  # noqa: F401
