"""engine.kind=fsdp's payload: a torch.distributed.checkpoint with "model" and "optim" entries, which
reshards on load.

Nothing here unpickles code. DCP's own reader unpickles `.metadata` with plain pickle and its
planner reads non-tensor items (the optimizer's hyperparameters) with torch.load(weights_only=False);
`SafeReader` admits only DCP's metadata classes, torch.Size, dtypes and layouts, and `SafePlanner`
reads those items weights-only. Tensors DCP already reads weights-only.

Loading is all or nothing: the names, global shapes and dtypes in `.metadata` are checked against the
model and optimizer first (pretrain/checkpoint/fit.py), and DCP then reads into copies of this rank's
shards, which replace the live ones only once every rank has read everything. (DCP reads in place into
the tensors it is given; a read failing midway would leave some of them overwritten.) The copies cost
a second set of this rank's weights and optimizer state while the load runs.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from pretrain.checkpoint.fit import Spec, check_fit, specs
from pretrain.checkpoint.layout import MODEL_PREFIX, CheckpointError, cause

METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a layout up by name among torch's own
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}
"""What a DCP `.metadata` pickle may name: plain data holders (and torch's dtypes, checked apart)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only METADATA_CLASSES and torch dtypes; anything else (os.system,
    builtins.eval, ...) is refused before it could be called."""

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a torch.distributed.checkpoint metadata type")


def one_line(err: BaseException) -> str:
    """The cause of `err` in one line: DCP wraps each rank's exception, traceback and all."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        failure = next(iter(err.failures.values()))
        err = failure[0] if isinstance(failure, tuple) else failure
    return cause(err)


def safe_load(state: dict[str, Any], path: str, no_dist: bool = False) -> None:
    """dcp.load of `state` from `path` through SafeReader and SafePlanner; raises CheckpointError
    naming `path` with the cause in one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # torch warns that no process group is initialised: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner(), no_dist=no_dist)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # every rank's failure, gathered (a BaseException)
        raise CheckpointError(f"{path}: cannot read the torch.distributed.checkpoint: {one_line(err)}") from err


def read_metadata_file(path: Path) -> Metadata:
    """DCP's metadata from `path`, through the restricted unpickler; raises naming the file."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as err:  # unpickling raises many types for a bad or hostile file
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint metadata file: {one_line(err)}") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items weights-only."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:  # torch names the refused global; the item is named here
            raise CheckpointError(f"item {fqn!r}: not plain data (refused to unpickle it): {one_line(err)}") from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def save_dcp_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Sharded through torch.distributed.checkpoint, and reshardable on load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_dcp_state(path: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: model and optimizer from the DCP checkpoint at `path`, resharded to this world
    size; a checkpoint that does not fit, or fails to read, changes neither (module docstring)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    fresh_optimizer = not optimizer.state  # get_state_dict gives it zero moments to have a shape to load into
    try:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        check_fit(path, _saved_specs(Path(path)), _tensor_specs(state), "this run's model and optimizer")
        copies = _copied(state)
        safe_load(copies, path)
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()
        raise
    set_state_dict(module, optimizer, model_state_dict=copies["model"], optim_state_dict=copies["optim"])


def _tensor_specs(state: dict[str, Any]) -> dict[str, Spec]:
    """Name (as DCP flattens it into the checkpoint) -> global shape and dtype of every tensor of `state`."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return specs(flatten_state_dict(state)[0])


def _saved_specs(path: Path) -> dict[str, Spec]:
    """Name -> global shape and dtype of every tensor a DCP checkpoint holds, from its `.metadata`."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_metadata_file(path / ".metadata")
    return {key: (tuple(meta.size), meta.properties.dtype) for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)}


def _copied(value: Any) -> Any:
    """`value` with every container rebuilt and every tensor (sharded DTensors included) cloned, so
    that DCP can read into it without touching the model's or the optimizer's own tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value


def holds(engine_dir: Path) -> bool:
    """Whether `engine_dir` is in this format (DCP's own metadata file)."""
    return (engine_dir / ".metadata").is_file()


def read_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    """The "model" tensors of a DCP checkpoint, read without a process group."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (engine_dir / ".metadata").is_file():
        raise CheckpointError(f"{engine_dir}: not a torch.distributed.checkpoint directory (no .metadata)")
    metadata = read_metadata_file(engine_dir / ".metadata")
    wanted = {}
    prefix = "model." + MODEL_PREFIX  # the DCP entry "model", then TrainModule's attribute
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            wanted[key[len(prefix) :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted:
        raise CheckpointError(f"{engine_dir}: the checkpoint holds no 'model' tensors")
    safe_load({"model": {MODEL_PREFIX + k: v for k, v in wanted.items()}}, str(engine_dir), no_dist=True)
    return wanted
