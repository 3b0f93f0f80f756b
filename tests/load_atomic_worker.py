"""A failed load changes nothing, checked on a real engine (run by tests/test_atomic_load.py under the
launcher the engine needs). Each engine is the tiny config's with the given overrides, trained one step:

- "other": an engine of another model (`--saved-with`) saves its checkpoint;
- "damaged": an engine of the same model but another seed saves one, and the files matching
  `--damage` (globs in the payload) are cut to half their size, as if rewritten by someone who also
  resealed the manifest;
- the engine under test (`--loaded-into`) saves itself, is asked to load each of the two, must refuse
  both with a CheckpointError, and saves itself again: the second payload must hold exactly the tensors
  of the first.

Rank 0 prints one JSON line: the two errors, the tensors compared, the ones that changed.

    python tests/load_atomic_worker.py OUT --saved-with KEY=VALUE ... --loaded-into KEY=VALUE ... --damage GLOB
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import build_model
from pretrain.checkpoint.layout import CheckpointError
from pretrain.config import load_config
from pretrain.distributed.process_group import barrier, rank
from pretrain.engines import build_engine, join_process_group
from pretrain.preflight import check_start
from pretrain.protocols import Engine

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def trained_engine(overrides: list[str]) -> Engine:
    """The tiny config's engine with `overrides`, after one step on a fixed batch."""
    cfg = load_config(TINY, ["model.d_model=32", "train.global_batch=4", *overrides])
    _, world = join_process_group(cfg)
    dims, gas = check_start(cfg, world)
    torch.manual_seed(cfg.run.seed)
    engine = build_engine(cfg, build_model(cfg.model), gas, dims.build(rank(), cfg.data.seq_len))
    fixed = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, 33), generator=fixed)
    engine.train_step([(batch[:, :-1], batch[:, 1:])] * gas, lr=1e-2)
    return engine


def tensors(value: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside nested dicts and lists, by path."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else []
    return {k: v for key, item in items for k, v in tensors(item, f"{prefix}/{key}").items()}


def payload(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor an engine's save wrote under `directory`, read weights-only, by file and path."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from pretrain.checkpoint.dcp_format import read_metadata_file, safe_load
    from pretrain.checkpoint.deepspeed_format import deepspeed_weights_only

    found: dict[str, torch.Tensor] = {}
    if (directory / ".metadata").is_file():  # DCP: every tensor read whole, by this process alone
        entries = read_metadata_file(directory / ".metadata").state_dict_metadata.items()
        wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries
                  if isinstance(meta, TensorStorageMetadata)}
        safe_load(wanted, str(directory), no_dist=True)
        return {f"dcp/{k}": v for k, v in wanted.items()}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.suffix == ".safetensors":
            found.update({f"{name}/{k}": v for k, v in load_file(path).items()})
        elif path.suffix == ".pt":
            with deepspeed_weights_only():
                found.update(tensors(torch.load(path, map_location="cpu"), name))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--saved-with", nargs="*", default=[])
    parser.add_argument("--loaded-into", nargs="*", default=[])
    parser.add_argument("--damage", nargs="+", required=True)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args()
    trained_engine(args.saved_with).save(str(args.out / "other"))
    trained_engine([*args.loaded_into, "run.seed=7"]).save(str(args.out / "damaged"))
    barrier()
    if rank() == 0:
        for pattern in args.damage:
            for path in (args.out / "damaged").glob(pattern):
                with open(path, "r+b") as f:
                    f.truncate(path.stat().st_size // 2)
    barrier()
    engine = trained_engine(args.loaded_into)
    engine.save(str(args.out / "before"))
    errors = {}
    for name in ("other", "damaged"):
        try:
            engine.load(str(args.out / name), args.out / "scratch")
            errors[name] = "loaded"
        except Exception as err:  # the test requires a CheckpointError; anything else is reported as it is
            errors[name] = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
    engine.save(str(args.out / "after"))
    barrier()
    if rank() == 0:
        before, after = payload(args.out / "before"), payload(args.out / "after")
        changed = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))
        print(json.dumps({"errors": errors, "tensors": len(before), "changed": changed,
                          "same_names": sorted(before) == sorted(after)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
