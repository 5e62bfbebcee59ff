"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture(params=["one_tile", "tiled"])
def phase2_tiles(request, monkeypatch):
    """Phase 2 (forward and backward kernels) with each chunk as one tile in registers (what
    the tests' small W take by default), or in steps over tiles of a few tokens (what large W
    or C take)."""
    if request.param == "tiled":
        from sdm_ops.kernels import recurrence_fwd

        monkeypatch.setattr(recurrence_fwd, "_TILE", 128)
    return request.param
