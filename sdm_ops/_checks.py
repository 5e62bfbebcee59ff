"""Argument checks shared by the public functions: each raises ``TypeError`` or ``ValueError``
naming the argument, before anything is computed or written."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    name: str,
    t,
    *,
    ndim: int | tuple[int, ...] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
) -> Tensor:
    """``t`` is a tensor with one of ``dtypes`` and ``ndim`` dimensions."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {_names(dtypes)}, got {t.dtype}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in dims:
            want = " or ".join(str(d) for d in dims)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    return t


def check_shape(name: str, t: Tensor, shape: tuple[int, ...], what: str) -> None:
    """``t.shape == shape``; ``what`` describes the expected shape, e.g. "[B, T, H]"."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(t.shape)}")


def check_same_device(named: dict[str, Tensor | None]) -> torch.device:
    """All given tensors live on one device; returns it."""
    device = None
    first = None
    for name, t in named.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(
                f"{name} is on {t.device} but {first} is on {device}; "
                "all tensors must be on one device"
            )
    return device


def check_int(
    name: str,
    value,
    *,
    low: int | None = None,
    high: int | None = None,
    choices: Iterable[int] | None = None,
) -> int:
    """``value`` is an int (not a bool) within [low, high] or one of ``choices``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if choices is not None and value not in tuple(choices):
        raise ValueError(f"{name} must be one of {list(choices)}, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def data_checks_enabled() -> bool:
    """Checks that read tensor data (a host sync) run in eager mode only: never while
    compiling or capturing a CUDA graph, where the kernels mask bad indices instead."""
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True
