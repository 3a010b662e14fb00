"""Launcher helpers shared by the kernel modules: interpreter detection and dot-product settings."""

from __future__ import annotations

import os

import torch

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for a kernel whose tl.dot inputs have this dtype.

    The interpreter's tl.dot multiplies bfloat16 operands as their raw uint16 bits (triton 3.x), so
    under the interpreter bfloat16 tiles are upcast to float32 first. On a GPU float32 dots default
    to TF32 (10-bit mantissa), which would break float32 agreement with the reference; "ieee" keeps
    them exact, and half-precision inputs ignore the setting.
    """
    upcast = interpreting() and dtype == torch.bfloat16
    return upcast, "ieee" if dtype == torch.float32 else "tf32"


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(
            f"tensors must share one device, got {', '.join(f'{k}={v.device}' for k, v in tensors.items())}"
        )
