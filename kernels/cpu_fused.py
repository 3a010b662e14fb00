"""Fused elementwise ops for the CPU forward, in C (kernels/cpu/fused_elementwise.c).

- ``rms_norm(x, weight, eps, residual_delta=None)``: with a delta, x += delta in place first (the
  decoder layer's residual update), then weight * x / rms(x), one pass over each row.
- ``silu_mul(gate_up)``: silu(gate) * up of a fused gate|up projection, written at half its width.

The plain-torch forms they replace are the references (engine.models.llama's RMSNorm and MLP);
`available()` is False where the library cannot be built, and callers keep to those forms.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import _cpu_build

_SIGNATURES = {
    "rms_norm": (
        None,
        [
            ctypes.c_void_p,  # x (updated in place when delta is given)
            ctypes.c_void_p,  # delta (nullable)
            ctypes.c_void_p,  # weight
            ctypes.c_void_p,  # out
            ctypes.c_int64,  # rows
            ctypes.c_int64,  # dim
            ctypes.c_float,  # eps
            ctypes.c_int,  # is_bf16
            ctypes.c_int,  # num_threads
        ],
    ),
    "silu_mul": (
        None,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int],
    ),
}
_DTYPES = (torch.float32, torch.bfloat16)


def _load() -> ctypes.CDLL | None:
    return _cpu_build.load("fused_elementwise", _SIGNATURES)


def available() -> bool:
    return _load() is not None


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2 and x.is_contiguous()


def rms_norm(
    x: torch.Tensor,  # (rows, dim), contiguous; updated in place when residual_delta is given
    weight: torch.Tensor,  # (dim,)
    eps: float,
    residual_delta: torch.Tensor | None = None,  # (rows, dim)
) -> torch.Tensor:
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available")
    if (
        not supports(x)
        or weight.dtype != x.dtype
        or weight.shape != (x.shape[1],)
        or not weight.is_contiguous()
    ):
        raise ValueError(f"rms_norm: unsupported x {tuple(x.shape)} {x.dtype} / weight {tuple(weight.shape)}")
    if residual_delta is not None:
        if residual_delta.shape != x.shape or residual_delta.dtype != x.dtype:
            raise ValueError("rms_norm: residual_delta must be shaped like x")
        residual_delta = residual_delta.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm(
        x.data_ptr(),
        None if residual_delta is None else residual_delta.data_ptr(),
        weight.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        x.shape[1],
        float(eps),
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # (rows, 2 * width) -> (rows, width)
    lib = _load()
    if lib is None:
        raise RuntimeError("the CPU fused kernels are not available")
    if not supports(gate_up) or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: unsupported input {tuple(gate_up.shape)} {gate_up.dtype}")
    width = gate_up.shape[1] // 2
    out = torch.empty((gate_up.shape[0], width), dtype=gate_up.dtype)
    lib.silu_mul(
        gate_up.data_ptr(),
        out.data_ptr(),
        gate_up.shape[0],
        width,
        int(gate_up.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out
