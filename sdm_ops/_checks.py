"""Argument checks shared by the public functions: each raises ``TypeError`` or ``ValueError``
naming the argument, before anything is computed or written."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

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
    """Checks that read tensor data run in eager mode only: never while compiling or capturing
    a CUDA graph, where the kernels mask bad indices instead."""
    if torch.compiler.is_compiling():
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return True


# Strict checks: the index ranges and cu_seqlens checked on every device, which on a GPU makes
# the host wait for the check's values. Off unless SDM_OPS_STRICT asks (read once, at import).
STRICT_ENV = "SDM_OPS_STRICT"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def strict_from_env(value: str | None) -> bool:
    """The strict setting that the environment variable ``SDM_OPS_STRICT`` holding ``value``
    asks for (None: unset, off); any other word than 1/0, true/false, yes/no, on/off is a
    ``ValueError`` naming the variable."""
    word = (value or "").strip().lower()
    if word in _ON:
        return True
    if word in _OFF:
        return False
    words = ", ".join(_ON + _OFF[1:])
    raise ValueError(f"{STRICT_ENV} must be one of {words} (or empty), got {value!r}")


_strict = strict_from_env(os.environ.get(STRICT_ENV))


def set_strict_checks(enabled: bool) -> None:
    """Turn strict checks on or off for the whole process (the default comes from the
    environment variable ``SDM_OPS_STRICT``, off when unset).

    Strict: an eager call on a GPU checks that every index is -1 or in ``[0, S)`` and that
    ``cu_seqlens`` is well formed, and raises ``ValueError`` naming the argument; to read the
    values it waits on an event recorded behind the checks' reductions (and so behind all the
    work queued before them), so the host cannot run ahead of the GPU. Not strict (the
    default): a call on a GPU reads no data and never waits; an index outside ``[0, S)`` acts
    as padding (-1) and malformed offsets are made well formed, as in compiled code. On the
    CPU the checks always run (the values are at hand); compiled code and CUDA-graph captures
    never run them.

    Example::

        >>> before = sdm_ops.strict_checks_enabled()
        >>> sdm_ops.set_strict_checks(True)
        >>> sdm_ops.strict_checks_enabled()
        True
        >>> sdm_ops.set_strict_checks(before)
    """
    global _strict
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _strict = enabled


def strict_checks_enabled() -> bool:
    """Whether strict checks are on (see :func:`set_strict_checks`)."""
    return _strict


@contextlib.contextmanager
def strict_checks(enabled: bool = True) -> Iterator[None]:
    """A context in which strict checks are ``enabled`` (see :func:`set_strict_checks`); the
    previous setting comes back on exit. The setting is process-wide, not per thread.

    Example::

        >>> with sdm_ops.strict_checks():  # eager GPU calls check the indices, and wait
        ...     sdm_ops.strict_checks_enabled()
        True
        >>> with sdm_ops.strict_checks(False):  # GPU calls read no data (the default)
        ...     sdm_ops.strict_checks_enabled()
        False
    """
    global _strict
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    before, _strict = _strict, enabled
    try:
        yield
    finally:
        _strict = before


def data_checks_wanted(device: torch.device) -> bool:
    """Whether an eager call on ``device`` reads its data to check it: always on the CPU (the
    values are in host memory, nothing waits), on any other device only in strict mode
    (reading them there makes the host wait for the device)."""
    return device.type == "cpu" or _strict
