"""Predicted (and, with a GPU, measured) times of fla's chunk ops and of this project's training steps.

    python -m benchmarks.predict fla:<op> --shape B,T,H,D [--gpu h100|h200] [--json] [--measure]
    python -m benchmarks.predict step --config <name> --tokens N [--batch 1] [--gpu h100] [--json] [--measure]

`fla:<op>` prices fla's chunk form of <op> (benchmarks.predict.fla_ops.OPS) at one shape, forward and
forward + backward: {"fwd_ms", "fwdbwd_ms"}. `step` prices one training step of a config
(configs/<name>.yaml, a run config, or configs/model/<name>.yaml with configs/base/pretrain.yaml's
training settings) at N tokens per rank: the scans' share, the step, the MFU (the model's own FLOPs per
token, 6N plus the scans', over the step time at the bf16 peak) and fla's chunk retention forward +
backward for the same layers on the same tokens, the terms of each head as that many more heads:
{"scan_ms", "step_ms", "scan_share", "mfu", "fla_retention_ms"}. `--breakdown` adds the per-launch table.
`--measure` (CUDA only) runs the same work on the device and prints the measured times beside.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.predict.gpu import GPUS, gpu
from benchmarks.predict.launch_model import Constants

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shape takes four positive integers B,T,H,D, got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def predict_fla(op: str, shape: tuple[int, int, int, int], gpu_name: str, breakdown: bool = False) -> dict[str, Any]:
    """{"fwd_ms", "fwdbwd_ms"} of fla's chunk ``op`` at ``shape`` on ``gpu_name``."""
    from benchmarks.predict.fla_ops import capture_op
    from benchmarks.predict.price import cost

    g, c = gpu(gpu_name), Constants()
    out: dict[str, Any] = {}
    for mode, backward in (("fwd", False), ("fwdbwd", True)):
        costed = cost(capture_op(op, shape, backward, g.capability), g)
        out[f"{mode}_ms"] = round(costed.seconds(c) * 1e3, 4)
        if breakdown:
            out[f"{mode}_launches"] = [vars(r) | {"seconds": round(r.seconds * 1e3, 4)} for r in costed.breakdown(c)]
    return out


def resolve_config(name: str) -> tuple[Any, bool | str]:
    """(model config, activation checkpointing mode) of a run config or a model config called ``name`` (a
    model config trains with configs/base/pretrain.yaml's mode)."""
    from model.config import load_model_config
    from model.config_loader import read_tree
    from pretrain.config import load_config

    run = CONFIGS / f"{name}.yaml"
    if run.is_file():
        cfg = load_config(run)
        return cfg.model, cfg.train.activation_checkpointing
    model = CONFIGS / "model" / f"{name}.yaml"
    if model.is_file():
        tree, _sources = read_tree(CONFIGS / "base" / "pretrain.yaml")
        return load_model_config(model), tree.get("train", {}).get("activation_checkpointing", False)
    raise SystemExit(f"error: no config {name!r}: neither {run} nor {model} exists")


def _announce(seconds: float) -> None:
    """Say before measuring how long the model expects it to take."""
    print(f"measuring: about {seconds:.0f} s by the model's own estimate", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", help="fla:<op> or step")
    parser.add_argument("--shape", type=_shape, help="B,T,H,D for fla:<op>")
    parser.add_argument("--config", help="config name for step (configs/<name>.yaml or configs/model/<name>.yaml)")
    parser.add_argument("--tokens", type=int, help="tokens per rank for step")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank for step")
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--json", action="store_true", help="print JSON only")
    parser.add_argument("--breakdown", action="store_true", help="add the per-launch predicted times")
    parser.add_argument("--measure", action="store_true", help="also run it on the CUDA device and time it")
    args = parser.parse_args(argv)
    if args.what.startswith("fla:"):
        if args.shape is None:
            parser.error("fla:<op> needs --shape B,T,H,D")
        out = predict_fla(args.what[4:], args.shape, args.gpu, args.breakdown or args.measure)
        if args.measure:
            from benchmarks.predict.measure import measure_fla, plan_seconds

            configs = sum(r["alternatives"] for r in out["fwdbwd_launches"] if r["alternatives"] > 1)
            _announce(plan_seconds(out["fwd_ms"] + out["fwdbwd_ms"], 2, configs))
            out["measured"] = measure_fla(args.what[4:], args.shape)
    elif args.what == "step":
        if not args.config or not args.tokens or args.tokens <= 0:
            parser.error("step needs --config <name> and --tokens N > 0")
        from benchmarks.predict.step_model import predict_step

        cfg, checkpointing = resolve_config(args.config)
        out = predict_step(cfg, args.batch, args.tokens, checkpointing, gpu(args.gpu), args.breakdown or args.measure)
        if args.measure:
            from benchmarks.predict.measure import measure_step, plan_seconds

            _announce(plan_seconds(out["step_ms"], 2))
            # the scans' kernels as scan_ms counts them (not the fused feature map, norm, gate or order kernels)
            out["measured"] = measure_step(cfg, args.batch, args.tokens, checkpointing, set(out["scan_kernels"]))
    else:
        parser.error(f"unknown target {args.what!r}: expected fla:<op> or step")
    print(json.dumps(out, indent=None if args.json else 1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
