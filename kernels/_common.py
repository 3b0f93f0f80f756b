"""Helpers shared by the scans: backend selection and angle wrapping."""

from __future__ import annotations

import math

import torch

TWO_PI = 2.0 * math.pi
BACKENDS = ("auto", "reference", "torch", "triton")


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """Map ``backend`` to a concrete one: "auto" is Triton for CUDA tensors and chunked PyTorch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    return backend


def wrap_angle(x: torch.Tensor) -> torch.Tensor:
    """Map angles to [0, 2*pi); the gradient passes through unchanged (d wrap(x)/dx = 1)."""
    return torch.remainder(x, TWO_PI)
