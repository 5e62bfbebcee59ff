"""matplotlib, an optional extra (``pip install 'sdm_ops[plot]'``), for the PNG figures of
``python -m benchmarks.capacity`` and ``python -m benchmarks.bench --plot``.

Figures are drawn on a ``matplotlib.figure.Figure`` of their own (no pyplot, no global
backend), so plotting changes nothing in the caller's matplotlib state.
"""

from __future__ import annotations

import importlib.util
import os

INSTALL_HINT = "pip install 'sdm_ops[plot]'"


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules: import blocked
        return False


def new_figure(width: float = 7.0, height: float = 4.5):
    """A ``matplotlib.figure.Figure``; ImportError naming the extra when matplotlib is
    missing."""
    try:
        import matplotlib  # noqa: F401  (first: a submodule imported before would pass)
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plotting needs matplotlib: {INSTALL_HINT}") from e
    return Figure(figsize=(width, height), layout="constrained")


def save(fig, path: str) -> str:
    """Write ``fig`` as a PNG to ``path`` (its folder made if missing); returns ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, format="png", dpi=120)
    return path
