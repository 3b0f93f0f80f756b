"""A training step of one of this project's configs, predicted: its Triton launches by the launch model, its aten
ops by the step model's rules, beside fla's chunk retention on the same work.

`predict_step` captures the step (benchmarks.predict.step.capture_step_ops), prices it and splits out the
scans: their launches and the aten ops their autograd Functions make (kernels and ops whose source is in
kernels/ but not kernels/features/, norm/, swiglu/ or order/: the fused feature map, norm, gate and order
coefficients are part of the step, not of the scans). "compiled" is
the same step with its memory ops fused as torch.compile fuses them (benchmarks.predict.price.fused_memory, a
first-order model of inductor). fla's retention runs the same layers
on the same tokens with every SOE term of a head as a head of its own (B, T, heads x terms, features; values
as wide as the head).
"""

from __future__ import annotations

from typing import Any

from benchmarks.predict.capture import Captured
from benchmarks.predict.gpu import Gpu
from benchmarks.predict.launch_model import Constants
from benchmarks.predict.price import cost
from benchmarks.predict.step import capture_step_ops
from model import build_model, family
from model.config import ModelConfig


def fla_retention_seconds(cfg: ModelConfig, batch: int, tokens: int, gpu: Gpu, c: Constants) -> float | None:
    """fla's chunk retention, forward + backward, for every scan layer of ``cfg``; None without a scan."""
    from benchmarks.predict.fla_ops import capture_op

    scan = family(cfg.kind).scan_shape(cfg)
    if scan is None or scan.kernel != "soe":
        return None
    heads, terms, features, width, _chunk = scan.sizes
    captured = capture_op("retention", (batch, tokens, heads * terms, features), True, gpu.capability,
                          value_width=width)
    return cost(captured, gpu).seconds(c) * cfg.n_layers


def predict_step(cfg: ModelConfig, batch: int, tokens: int, checkpointing: bool | str, gpu: Gpu,
                 breakdown: bool = False, c: Constants | None = None) -> dict[str, Any]:
    """{"scan_ms", "step_ms", "scan_share", "mfu", "fla_retention_ms"} of one training step."""
    c = c or Constants()
    step = capture_step_ops(cfg, batch, tokens, checkpointing, gpu.capability)
    whole = cost(Captured(step.launches, step.ops), gpu)
    scans = cost(Captured([launch for launch in step.launches if launch.origin == "kernels"],
                          [op for op in step.ops if op.origin == "kernels"]), gpu)
    step_s, scan_s = whole.seconds(c), scans.seconds(c)
    flops = build_model(cfg).flops_per_token(tokens) * batch * tokens
    fla = fla_retention_seconds(cfg, batch, tokens, gpu, c)
    compiled_s = whole.compiled_seconds(c)
    out: dict[str, Any] = {
        "scan_ms": round(scan_s * 1e3, 3), "step_ms": round(step_s * 1e3, 3),
        "scan_share": round(scan_s / step_s, 4), "mfu": round(flops / step_s / gpu.bf16_peak, 4),
        "fla_retention_ms": None if fla is None else round(fla * 1e3, 3),
        "compiled": {"step_ms": round(compiled_s * 1e3, 3), "scan_share": round(scan_s / compiled_s, 4),
                     "mfu": round(flops / compiled_s / gpu.bf16_peak, 4)},
    }
    if breakdown:
        out["launches"] = [vars(r) | {"seconds": round(r.seconds * 1e3, 4)} for r in whole.breakdown(c)]
        out["scan_kernels"] = sorted({launch.name for launch in step.launches if launch.origin == "kernels"})
    return out
