"""engine.kind=fsdp's payload: a torch.distributed.checkpoint with "model" and "optim" entries, which
reshards on load."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from pretrain.checkpoint.layout import MODEL_PREFIX, CheckpointError


def save_dcp_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Sharded through torch.distributed.checkpoint, and reshardable on load."""
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


def holds(engine_dir: Path) -> bool:
    """Whether `engine_dir` is in this format (DCP's own metadata file)."""
    return (engine_dir / ".metadata").is_file()


def read_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    """The "model" tensors of a DCP checkpoint, read without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    except Exception as err:  # a missing or unreadable .metadata file
        raise CheckpointError(f"{engine_dir}: not a torch.distributed.checkpoint directory: {err}") from err
    wanted = {}
    prefix = "model." + MODEL_PREFIX  # the DCP entry "model", then TrainModule's attribute
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            wanted[key[len(prefix) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted:
        raise CheckpointError(f"{engine_dir}: the checkpoint holds no 'model' tensors")
    try:
        with warnings.catch_warnings():  # torch warns that no process group is initialised: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": {MODEL_PREFIX + k: v for k, v in wanted.items()}}, checkpoint_id=str(engine_dir),
                     no_dist=True)
    except Exception as err:
        raise CheckpointError(f"{engine_dir}: cannot read the model tensors: {err}") from err
    return wanted
