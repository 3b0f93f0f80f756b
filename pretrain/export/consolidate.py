"""Consolidation: any engine's verified checkpoint -> one fp32 CausalLM on the CPU.

Whatever engine wrote the checkpoint (single process, DeepSpeed ZeRO 0-3, FSDP2 through
torch.distributed.checkpoint), the weights are gathered into one state dict under the CausalLM's
own parameter names and loaded into a freshly built model, so that a missing or unexpected key
fails here, not in a user's notebook. Loading never unpickles code: safetensors, YAML through
safe_load, and torch.load with weights_only=True (DeepSpeed's files need a few of its classes
allow-listed; see `_deepspeed_state`).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file

from model import CausalLM, build_model
from pretrain import checkpoint as ckpt
from pretrain.config import ConfigError, RunConfig, config_from_dict
from pretrain.export.layout import ExportError

# How the engines lay out a checkpoint's engine/ directory: the export reads these names here and
# nowhere else, so that they can follow the engines' own definitions from one place.
ENGINE_PREFIX = "model."  # engines wrap the CausalLM in TrainModule as `.model`
SINGLE_WEIGHTS = "model.safetensors"  # engine.kind=single
DEEPSPEED_TAG = "ds"  # engine.kind=deepspeed saves with this tag
DCP_MODEL_KEY = "model"  # engine.kind=fsdp: the entry of the torch.distributed.checkpoint holding the weights


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory meant by `path`: a step directory itself, or a checkpoints directory or
    run directory, in which case its `latest` pointer (or else the newest step) is taken."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such checkpoint or run directory")
    if (path / "config.yaml").is_file() and (path / "engine").is_dir():
        return path
    for root in (path, path / "checkpoints"):
        latest = root / ckpt.LATEST
        if latest.is_file():
            step = root / latest.read_text().strip()
            if step.is_dir():
                return step
        steps = ckpt.committed_steps(str(root)) if root.is_dir() else []
        if steps:
            return root / steps[0]
    raise ExportError(f"{path}: not a checkpoint (no engine/ and config.yaml) and holds no step_* checkpoints")


def read_run_config(step_dir: Path) -> RunConfig:
    """The resolved RunConfig saved beside the weights."""
    path = step_dir / "config.yaml"
    try:
        return config_from_dict(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError, ConfigError) as err:
        raise ExportError(f"{path}: cannot read the run config: {err}") from err


def _strip_engine_prefix(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    if not all(k.startswith(ENGINE_PREFIX) for k in state):
        odd = next(k for k in state if not k.startswith(ENGINE_PREFIX))
        raise ExportError(f"{source}: parameter {odd!r} is not under the engine's {ENGINE_PREFIX!r} prefix")
    return {k[len(ENGINE_PREFIX) :]: v for k, v in state.items()}


def _single_state(engine_dir: Path) -> dict[str, torch.Tensor]:
    path = engine_dir / SINGLE_WEIGHTS
    if not path.is_file():
        raise ExportError(f"{path}: missing (engine.kind=single writes the weights there)")
    return load_file(str(path))


class _WeightsOnlyTorch:
    """Stands in for the `torch` module inside deepspeed.utils.zero_to_fp32 so that each of its
    torch.load calls (which ask for weights_only=False) runs with weights_only=True."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return torch.load(f, *args, **kwargs)


@contextlib.contextmanager
def _deepspeed_weights_only() -> Iterator[None]:
    from deepspeed.utils import zero_to_fp32

    saved = zero_to_fp32.torch
    zero_to_fp32.torch = _WeightsOnlyTorch()
    try:
        with torch.serialization.safe_globals(ckpt.deepspeed_safe_globals()):
            yield
    finally:
        zero_to_fp32.torch = saved


def _deepspeed_state(engine_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """ZeRO 1-3: the fp32 master weights from the optimizer partitions, merged by DeepSpeed's own
    zero_to_fp32. Stage 0 has no partitions: the module weights in mp_rank_00_model_states.pt."""
    tag_dir = engine_dir / DEEPSPEED_TAG
    if not tag_dir.is_dir():
        raise ExportError(f"{tag_dir}: missing (engine.kind=deepspeed saves with tag {DEEPSPEED_TAG!r})")
    try:
        if zero_stage == 0:
            model_file = tag_dir / "mp_rank_00_model_states.pt"
            with torch.serialization.safe_globals(ckpt.deepspeed_safe_globals()):
                saved = torch.load(model_file, map_location="cpu", weights_only=True)
            state = dict(saved["module"])
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with _deepspeed_weights_only(), contextlib.redirect_stdout(sys.stderr):
                state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=DEEPSPEED_TAG)
    except ExportError:
        raise
    except Exception as err:  # DeepSpeed and torch.load raise many types; all mean "unusable checkpoint"
        raise ExportError(f"{tag_dir}: cannot consolidate the DeepSpeed ZeRO-{zero_stage} checkpoint: {err}") from err
    return _strip_engine_prefix(state, tag_dir)


def _fsdp_state(engine_dir: Path) -> dict[str, torch.Tensor]:
    """torch.distributed.checkpoint: read the "model" entries without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    except Exception as err:  # a missing or unreadable .metadata file
        raise ExportError(f"{engine_dir}: not a torch.distributed.checkpoint directory: {err}") from err
    wanted = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(ENGINE_PREFIX) and isinstance(meta, TensorStorageMetadata):
            wanted[key[len(ENGINE_PREFIX) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted:
        raise ExportError(f"{engine_dir}: the checkpoint holds no {DCP_MODEL_KEY!r} tensors")
    try:
        with warnings.catch_warnings():  # torch warns that no process group is initialised: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({DCP_MODEL_KEY: wanted}, checkpoint_id=str(engine_dir), no_dist=True)
    except Exception as err:
        raise ExportError(f"{engine_dir}: cannot read the model tensors: {err}") from err
    return _strip_engine_prefix(wanted, engine_dir)


def consolidate(step_dir: Path, cfg: RunConfig) -> CausalLM:
    """The trained model of a verified step directory, on CPU in fp32, whatever engine saved it."""
    engine_dir = step_dir / "engine"
    kind = cfg.engine.kind
    if kind == "single":
        state = _single_state(engine_dir)
    elif kind == "deepspeed":
        state = _deepspeed_state(engine_dir, cfg.engine.zero_stage)
    else:
        state = _fsdp_state(engine_dir)
    model = build_model(cfg.model)
    names = model.state_dict(keep_vars=True)  # persistent entries only, tied aliases included
    aliases = _tied_aliases(model)
    state = {k: v for k, v in state.items() if k not in aliases}
    missing = sorted(set(names) - set(state) - set(aliases))
    unexpected = sorted(set(state) - set(names))
    if missing or unexpected:
        raise ExportError(
            f"{engine_dir}: weights do not match model.kind={cfg.model.kind!r} from config.yaml "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(names[key].shape):
            expected = tuple(names[key].shape)
            raise ExportError(f"{engine_dir}: {key} has shape {tuple(value.shape)}, the model expects {expected}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.eval()


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (the tied LM head)."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases
