"""Checkpoints: one directory per step holding everything needed to continue exactly.

Layout of `<checkpoint dir>/step_00000100/`:
  engine/                 model + optimizer, written by the engine (safetensors + weights-only
                          torch files, a DeepSpeed checkpoint, or a torch.distributed.checkpoint)
  trainer_state.json      step, tokens seen, skipped steps, the data loader's state
  rng/rank_<r>.json|.safetensors   every rank's python, numpy and torch (CPU, CUDA) RNG states
  config.yaml             the resolved run config
  manifest.json           sha256 and size of every file above; written last

A checkpoint is written under `step_XXXXXXXX.tmp`, committed by renaming it, and only then is
the `latest` pointer replaced. Loading reads nothing through pickle that could run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file, save_model

MANIFEST = "manifest.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete or corrupt."""


# ----------------------------------------------------------------------------- engine payloads


def save_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Single-process payload: model.safetensors and a tensors-only optimizer file."""
    os.makedirs(path, exist_ok=True)
    save_model(model, os.path.join(path, "model.safetensors"))
    torch.save(optimizer.state_dict(), os.path.join(path, "optimizer.pt"))


def load_torch_state(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    from safetensors.torch import load_model

    load_model(model, os.path.join(path, "model.safetensors"), strict=True)
    state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state)


def save_dcp_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """FSDP2 payload through torch.distributed.checkpoint: sharded, and reshardable on load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_dcp_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ----------------------------------------------------------------------------- RNG


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This process's RNG states as (JSON-able, tensors) so that neither needs pickle."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    plain = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_kind, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    return plain, tensors


def set_rng_state(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    py_version, py_state, py_gauss = plain["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = plain["numpy"]
    np.random.set_state((np_kind, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


# ----------------------------------------------------------------------------- directories


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(directory: Path, step: int) -> None:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"sha256": _sha256(path), "bytes": path.stat().st_size}
    manifest = {"step": step, "files": files}
    _write_synced(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def verify(directory: str | Path) -> dict[str, Any]:
    """Check a committed checkpoint against its manifest; returns the manifest or raises."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (incomplete checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{manifest_path}: not valid JSON: {err}") from err
    for rel, meta in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != meta["bytes"] or _sha256(path) != meta["sha256"]:
            raise CheckpointError(f"{path}: sha256 does not match the manifest (corrupt checkpoint)")
    return manifest


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(root: str | Path, step: int, engine: Any, trainer_state: dict[str, Any], config_yaml: str) -> Path:
    """Collective: every rank writes its part into a temporary directory; rank 0 commits it."""
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    engine.save(str(tmp / "engine"))
    plain, tensors = rng_state()
    _write_synced(tmp / "rng" / f"rank_{rank}.json", json.dumps(plain))
    save_file(tensors, str(tmp / "rng" / f"rank_{rank}.safetensors"))
    if rank == 0:
        _write_synced(tmp / "trainer_state.json", json.dumps(trainer_state, indent=1, sort_keys=True))
        _write_synced(tmp / "config.yaml", config_yaml)
    _barrier()
    if rank == 0:
        _write_manifest(tmp, step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_synced(root / (LATEST + ".tmp"), final.name)
        os.replace(root / (LATEST + ".tmp"), root / LATEST)
    _barrier()
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed step directories, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and not p.name.endswith(".tmp")]
    return sorted(steps, key=lambda p: p.name, reverse=True)


def load_checkpoint(directory: str | Path, engine: Any) -> dict[str, Any]:
    """Restore engine and this rank's RNG from a checkpoint; returns the trainer state."""
    directory = Path(directory)
    engine.load(str(directory / "engine"))
    rank = _rank()
    plain_path = directory / "rng" / f"rank_{rank}.json"
    if plain_path.is_file():
        tensors = load_file(str(directory / "rng" / f"rank_{rank}.safetensors"))
        set_rng_state(json.loads(plain_path.read_text()), tensors)
    return json.loads((directory / "trainer_state.json").read_text())


def _newest_valid(candidates: list[Path]) -> Path | None:
    from pretrain.log import get_logger

    for path in candidates:
        try:
            verify(path)
            return path
        except CheckpointError as err:
            get_logger().warning("skipping checkpoint %s: %s", path, err)
    return None


def resume(root: str | Path, mode: str, engine: Any) -> dict[str, Any] | None:
    """Restore according to `mode`: "none", "auto" (newest checkpoint that verifies; corrupt or
    partial ones are reported and skipped) or an explicit checkpoint directory.

    Rank 0 chooses; every rank loads the same directory. Returns the saved trainer state with the
    chosen "path", or None when starting fresh.
    """
    if mode == "none":
        return None
    if _rank() == 0:
        if mode == "auto":
            chosen = _newest_valid(list_checkpoints(root))
        else:
            verify(mode)
            chosen = Path(mode)
        choice = [str(chosen) if chosen else None]
    else:
        choice = [None]
    if dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    state = load_checkpoint(choice[0], engine)
    state["path"] = choice[0]
    return state


def prune(root: str | Path, keep_last: int, milestone_every: int) -> None:
    """Delete committed checkpoints beyond the newest `keep_last`, keeping every milestone."""
    if _rank() != 0:
        return
    for path in list_checkpoints(root)[keep_last:]:
        step = int(path.name.split("_")[1])
        if milestone_every and step % milestone_every == 0:
            continue
        shutil.rmtree(path, ignore_errors=True)
