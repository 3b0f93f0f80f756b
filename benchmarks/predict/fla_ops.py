"""flash-linear-attention's chunk ops as the model sees them: what `fla.ops.<op>.chunk_<op>` launches on
an H100 for a shape, captured from fla's own code (fla-core, the `bench` extra) on meta tensors.

The inputs follow fla's benchmark registry (benchmarks/ops/registry.py of fla): q, k, v of [B, T, H, D]
in bf16 (D = DV), plus each op's own inputs (`EXTRA`): log decays for the gated ops, betas for the delta
rules, all requiring gradients. Forward alone, or forward and backward from an output gradient made
ahead, as fla's benchmark times them (triton.testing.do_bench of the call).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.predict.capture import Captured, capture, pretend_gpu

# extra inputs per op: name -> (shape as a function of B, T, H, D; dtype)
_BTH = (lambda b, t, h, d: (b, t, h), torch.float32)
_BTHD = (lambda b, t, h, d: (b, t, h, d), torch.float32)
EXTRA: dict[str, dict[str, tuple[Callable[..., tuple[int, ...]], torch.dtype]]] = {
    "linear_attn": {},
    "retention": {},
    "simple_gla": {"g": _BTH},
    "gla": {"g": _BTHD},
    "delta_rule": {"beta": (_BTH[0], torch.bfloat16)},
    "gated_delta_rule": {"g": _BTH, "beta": (_BTH[0], torch.bfloat16)},
}
OPS = tuple(EXTRA)
CALL_KWARGS = {"linear_attn": {"normalize": False}}
"""linear_attn is priced without its output normalisation (fla's default since 0.1 is to normalise). The
published times it is calibrated on cannot include it: at B1 T8192 H96 D128 the normalisation alone
moves about 1.6 GB through HBM in extra aten ops (0.48 ms at the H100's peak) on top of the 2.0 GB of
the chunk kernels, while the measured forward is 0.726 ms, i.e. 2.0 GB at 83% of the peak."""


@functools.cache
def chunk_function(op: str, target: int = 90) -> Callable[..., Any]:
    """fla's ``chunk_<op>``, imported as on a GPU of compute capability ``target`` (fla picks block sizes
    from the GPU it finds at import)."""
    if op not in EXTRA:
        raise ValueError(f"unknown fla op {op!r}; expected one of {', '.join(OPS)}")
    try:
        with pretend_gpu(target):
            module = importlib.import_module(f"fla.ops.{op}")
    except ImportError as err:
        raise RuntimeError("fla-core is not installed: pip install -e '.[bench]'") from err
    return getattr(module, f"chunk_{op}")


def inputs(op: str, shape: tuple[int, int, int, int], device: str = "meta",
           value_width: int | None = None) -> dict[str, torch.Tensor]:
    """The inputs of ``op`` at ``shape`` (B, T, H, D), requiring gradients as in fla's benchmark; values
    ``value_width`` wide (D unless given)."""
    b, t, h, d = shape
    kw = {"device": device, "requires_grad": True}
    widths = {"q": d, "k": d, "v": value_width or d}
    out = {name: torch.randn(b, t, h, w, dtype=torch.bfloat16, **kw) for name, w in widths.items()}
    for name, (make, dtype) in EXTRA[op].items():
        x = torch.rand(make(b, t, h, d), dtype=dtype, device=device)
        out[name] = (-x if name == "g" else x).requires_grad_(True)  # g: log decays, < 0
    return out


def call(op: str, args: dict[str, torch.Tensor], backward: bool, target: int = 90) -> Callable[[], None]:
    """A function that runs fla's chunk ``op`` on ``args``, forward and, if ``backward``, backward from
    an output gradient (made ahead, as fla's benchmark does)."""
    fn = chunk_function(op, target)
    kwargs = CALL_KWARGS.get(op, {})
    grad = torch.ones_like(args["v"]) if backward else None  # every op here outputs v's shape

    def once() -> None:
        out = fn(**args, **kwargs)
        if backward:
            (out[0] if isinstance(out, tuple) else out).backward(grad)

    return once


def capture_op(op: str, shape: tuple[int, int, int, int], backward: bool, target: int = 90,
               value_width: int | None = None) -> Captured:
    """What fla's chunk ``op`` launches at ``shape``, forward (and backward), inputs made ahead."""
    return capture(call(op, inputs(op, shape, "meta", value_width), backward, target), target)
