"""The measured side of `python -m benchmarks.predict ... --measure`: the same work the model prices, run
and timed on the CUDA device.

- fla ops: `triton.testing.do_bench` medians of the forward and of forward + backward, inputs and the
  output gradient made ahead, after a warm-up that lets fla's autotuner settle (as fla's benchmark).
- training steps: the step `benchmarks.predict.step.capture_step_ops` captures (the model's loss,
  backward with its activation checkpointing, gradient clipping, AdamW over fp32 master weights),
  timed with CUDA events over REPS steps after WARMUP; the scans' share from the profiler's kernel
  times of the step's Triton kernels.

`plan_seconds` is the model's own estimate of a measurement's wall time (autotuning, warm-up and timed
repetitions), which the CLI prints before it starts so that a run can be sized to the device budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from model.config import ModelConfig

WARMUP, REPS = 3, 10
DO_BENCH_MS = (25, 100)  # do_bench's warm-up and repetition budgets, in milliseconds of device time


def require_cuda() -> torch.device:
    """The CUDA device, or a clear error: --measure runs the work on a GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("--measure needs a CUDA device (torch.cuda.is_available() is False); the predicted "
                           "numbers need none")
    return torch.device("cuda")


def measure_fla(op: str, shape: tuple[int, int, int, int]) -> dict[str, float]:
    """Measured {"fwd_ms", "fwdbwd_ms"} of fla's chunk ``op`` at ``shape``."""
    import triton

    from benchmarks.predict.fla_ops import call, chunk_function, inputs

    device = require_cuda()
    chunk_function.cache_clear()  # import fla for the real device, not the pretended one
    args = inputs(op, shape, str(device))
    out = {}
    for mode, backward in (("fwd", False), ("fwdbwd", True)):
        fn = call(op, args, backward)
        for _ in range(WARMUP):
            fn()
        out[f"{mode}_ms"] = round(triton.testing.do_bench(fn, warmup=DO_BENCH_MS[0], rep=DO_BENCH_MS[1]), 4)
    return out


def training_step(cfg: ModelConfig, batch: int, tokens: int, checkpointing: bool | str,
                  device: torch.device) -> Callable[[], None]:
    """One training step of ``cfg`` on ``device`` as the step model captures it, as a function."""
    from model import build_model

    model = build_model(cfg).to(device=device, dtype=torch.bfloat16)
    model.train()
    model.activation_checkpointing = checkpointing
    params = [p for p in model.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(master, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens), device=device)

    def step() -> None:
        loss, _state = model.loss(ids, ids)
        loss.backward()
        for p, m in zip(params, master):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)

    return step


def measure_step(cfg: ModelConfig, batch: int, tokens: int, checkpointing: bool | str,
                 scan_kernels: set[str]) -> dict[str, Any]:
    """Measured {"step_ms", "scan_ms", "scan_share"} of one training step of ``cfg`` on the GPU; the
    scans are the kernels named in ``scan_kernels`` (the Triton launches the step model captured)."""
    device = require_cuda()
    step = training_step(cfg, batch, tokens, checkpointing, device)
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        step()
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / REPS
    scan_ms = _kernel_ms(step, scan_kernels)
    return {"step_ms": round(step_ms, 3), "scan_ms": round(scan_ms, 3), "scan_share": round(scan_ms / step_ms, 4)}


def _kernel_ms(step: Callable[[], None], names: set[str]) -> float:
    """Device time of the kernels called ``names`` in one step, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.key in names) / 1e3


def plan_seconds(predicted_ms: float, calls: int, autotune_configs: int = 0) -> float:
    """The model's estimate of a measurement's wall time: warm-up and timed calls of ``predicted_ms``
    each, do_bench's budgets, and ``autotune_configs`` configurations benchmarked once each by
    triton's autotuner (its own warm-up and repetitions: 25 and 100 ms of device time by default),
    plus one second per configuration to compile it."""
    timed = (WARMUP + REPS) * predicted_ms / 1e3 * calls
    bench = sum(DO_BENCH_MS) / 1e3 * calls
    return timed + bench + autotune_configs * (1.0 + sum(DO_BENCH_MS) / 1e3)
