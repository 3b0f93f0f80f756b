"""Parameter counts and training FLOPs per token of model configs.

    python -m model.summary configs/model/vort-125m.yaml configs/model/pl-125m.yaml ... [--seq-len N]

Reads each file's `model:` section (following `extends`, as the run config loader does), builds the
model on the CPU and prints one Markdown table row per config: total parameters, parameters without
the embedding, and training FLOPs per token (forward + backward, the number the trainer divides by
for MFU) at the given context length (default: each config's max_seq_len).
model/ does not import the trainer, so this module reads the YAML itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from model import build_model
from model.config import ModelConfig


def model_tree(path: Path) -> dict[str, Any]:
    """The merged `model:` mapping of a YAML file and the files it extends (later keys win)."""
    data = yaml.safe_load(path.read_text()) or {}
    parents = data.get("extends", [])
    tree: dict[str, Any] = {}
    for parent in [parents] if isinstance(parents, str) else parents:
        tree = _merge(tree, model_tree(path.parent / parent))
    return _merge(tree, data.get("model", {}))


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


def _build(cls: type, tree: dict[str, Any]) -> Any:
    """Instantiate a config dataclass, turning nested mappings into their section dataclasses."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in tree.items():
        kind = hints.get(key)
        kwargs[key] = _build(kind, value) if dataclasses.is_dataclass(kind) and isinstance(value, dict) else value
    return cls(**kwargs)


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig from a YAML file's `model:` section (the trainer's loader validates types too)."""
    return _build(ModelConfig, model_tree(Path(path)))


def summarize(config: ModelConfig, seq_len: int | None = None) -> dict[str, Any]:
    """kind, parameters (all / without embedding) and training FLOPs per token at `seq_len`."""
    model = build_model(config)
    context = seq_len or config.max_seq_len
    return {
        "kind": config.kind,
        "params": model.num_parameters(),
        "params_no_embed": model.num_parameters(exclude_embeddings=True),
        "seq_len": context,
        "flops_per_token": model.flops_per_token(context),
    }


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Markdown table of (name, summary) rows."""
    lines = [
        "| config | kind | params | params w/o embedding | seq len | train FLOPs/token |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['kind']} | {s['params']:,} | {s['params_no_embed']:,} "
            f"| {s['seq_len']} | {s['flops_per_token']:.4g} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", type=Path, help="YAML files with a model: section")
    parser.add_argument("--seq-len", type=int, default=None, help="context length for FLOPs (default: max_seq_len)")
    args = parser.parse_args(argv)
    rows = [(path.stem, summarize(load_model_config(path), args.seq_len)) for path in args.configs]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
