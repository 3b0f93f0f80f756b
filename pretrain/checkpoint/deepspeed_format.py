"""engine.kind=deepspeed's payload: DeepSpeed's checkpoint under the tag "ds" and format.json (the ZeRO
stage and the data-parallel size that wrote it). Loaded at another size or stage, it is first converted
to DeepSpeed's universal format in a scratch directory, then loaded from there (ZeRO 1-3 at another
size; stage changes between ZeRO-1 and ZeRO-2).

Nothing here unpickles code: DeepSpeed's own loaders are run with torch.load forced to
weights_only=True and the plain data classes its files hold allow-listed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pretrain.checkpoint.layout import CheckpointError, cause, strip_model_prefix
from pretrain.distributed import process_group as distributed
from pretrain.log import get_logger

DEEPSPEED_TAG = "ds"
DEEPSPEED_FORMAT = "format.json"


def deepspeed_safe_globals() -> list[Any]:
    """The non-tensor classes DeepSpeed pickles into its checkpoint files (loss scaler, ZeRO stage
    enum, fragment addresses, ...): plain data holders, allow-listed so weights_only=True works."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [argparse.Namespace, LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def deepspeed_weights_only() -> Iterator[None]:
    """Within the block, every torch.load (DeepSpeed's loaders and converters ask for
    weights_only=False) runs with weights_only=True and DeepSpeed's data classes allow-listed.
    torch.load is swapped on the torch module itself because DeepSpeed calls it from a dozen
    modules; the block is entered only while loading, when no other thread loads anything."""
    unsafe_load = torch.load

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return unsafe_load(f, *args, **kwargs)

    torch.load = load
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            yield
    finally:
        torch.load = unsafe_load


def save_deepspeed(engine: Any, path: str, zero_stage: int) -> None:
    """Collective. DeepSpeed's checkpoint, with the (empty) universal-checkpoint info its converter
    looks for, and format.json recording what is needed to decide how to load it."""
    engine.save_checkpoint(path, tag=DEEPSPEED_TAG, client_state={"universal_checkpoint_info": {}})
    if distributed.rank() == 0:
        layout = {"zero_stage": zero_stage, "data_parallel_size": distributed.world_size()}
        Path(path, DEEPSPEED_FORMAT).write_text(json.dumps(layout))


def _needs_universal(path: Path, zero_stage: int, world: int) -> bool:
    """Whether the checkpoint at `path` was written at another data-parallel size or ZeRO stage
    (raises for a change DeepSpeed cannot load exactly). One without format.json (written before it
    existed) is taken to match, and DeepSpeed names the mismatch if it does not. Stage 0 keeps no
    partitions: it loads at any size as it is."""
    layout_file = path / DEEPSPEED_FORMAT
    if not layout_file.is_file():
        return False
    saved = json.loads(layout_file.read_text())
    if saved["zero_stage"] == zero_stage == 0:
        return False
    if saved["zero_stage"] != zero_stage and not {saved["zero_stage"], zero_stage} <= {1, 2}:
        raise CheckpointError(
            f"{path}: written by DeepSpeed ZeRO-{saved['zero_stage']}, this run is ZeRO-{zero_stage}: a checkpoint "
            "changes stage only between ZeRO-1 and ZeRO-2 (stage 0 keeps no partitions, and DeepSpeed's universal "
            f"checkpoints of ZeRO-3 load only into ZeRO-3); set engine.zero_stage={saved['zero_stage']}"
        )
    return saved["zero_stage"] != zero_stage or saved["data_parallel_size"] != world


def to_universal(path: Path, out: Path) -> None:
    """Convert the DeepSpeed checkpoint under `path` into the universal format in `out/ds`
    (DeepSpeed's ds_to_universal, run in this process, serially, weights-only)."""
    from deepspeed.checkpoint import ds_to_universal

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = argparse.Namespace(
        input_folder=str(path / DEEPSPEED_TAG), output_folder=str(out / DEEPSPEED_TAG), num_extract_workers=1,
        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True,
    )
    with deepspeed_weights_only(), contextlib.redirect_stdout(sys.stderr):
        ds_to_universal.main(args)


def load_deepspeed(engine: Any, path: str, zero_stage: int, scratch: Path) -> None:
    """Collective. Load `path` into the DeepSpeed `engine` as saved when the data-parallel size
    and ZeRO stage are those of this run; otherwise rank 0 converts it to the universal format
    under `scratch` (a directory every rank sees) and every rank loads its own partition of that."""
    source = Path(path)
    universal = _needs_universal(source, zero_stage, distributed.world_size())
    load_dir = scratch if universal else source
    if universal:
        get_logger().info("%s: another ZeRO stage or data-parallel size: loading through a universal checkpoint", path)
        if distributed.rank() == 0:
            to_universal(source, scratch)
        distributed.barrier()
    # DeepSpeed reads this flag only while loading, so it is set for this one load.
    engine._config.load_universal_checkpoint = universal
    hyperparameters = [{k: v for k, v in group.items() if k != "params"} for group in engine.optimizer.param_groups]
    try:
        with deepspeed_weights_only():
            loaded, _ = engine.load_checkpoint(str(load_dir), tag=DEEPSPEED_TAG, load_module_strict=True)
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded is None:
        raise CheckpointError(f"{path}: no DeepSpeed checkpoint found")
    if universal and zero_stage == 3:
        _repair_zero3_universal_load(engine.optimizer, hyperparameters)
    if universal:
        distributed.barrier()
        if distributed.rank() == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def _repair_zero3_universal_load(optimizer: Any, hyperparameters: list[dict[str, Any]]) -> None:
    """Undo two faults of DeepSpeed's (0.19.8) ZeRO-3 universal loader, which otherwise restores the
    weights and AdamW moments exactly:

    - it copies the first parameter group's hyperparameters into every group, so the no-decay group
      (norms, biases, embeddings) got weight decay; the run's own, from its config, go back;
    - it gives every flat fp32 group the *same* step tensor, which AdamW increments in place once per
      group, so the bias correction ran ahead by one per extra group each step (the first update
      after a move was 1.3e-3 off in loss, even when resuming at the same size through this path).
    """
    for group, values in zip(optimizer.param_groups, hyperparameters, strict=True):
        group.update(values)
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[flat]
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def holds(engine_dir: Path) -> bool:
    """Whether `engine_dir` is in this format."""
    return (engine_dir / DEEPSPEED_TAG).is_dir()


def _saved_stage(engine_dir: Path) -> int:
    """The ZeRO stage recorded in format.json."""
    path = engine_dir / DEEPSPEED_FORMAT
    try:
        return int(json.loads(path.read_text())["zero_stage"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: cannot read the ZeRO stage the checkpoint was written with: {err}") from err


def read_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    """ZeRO 1-3: the fp32 master weights merged from the optimizer partitions by DeepSpeed's own
    zero_to_fp32. Stage 0 has no partitions: the module weights in mp_rank_00_model_states.pt."""
    tag_dir = engine_dir / DEEPSPEED_TAG
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir}: missing (engine.kind=deepspeed saves with tag {DEEPSPEED_TAG!r})")
    zero_stage = _saved_stage(engine_dir)
    try:
        with deepspeed_weights_only(), contextlib.redirect_stdout(sys.stderr):
            if zero_stage == 0:
                state = dict(torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu")["module"])
            else:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag=DEEPSPEED_TAG)
    except Exception as err:  # DeepSpeed and torch.load raise many types; all mean "unusable checkpoint"
        raise CheckpointError(f"{tag_dir}: cannot consolidate the ZeRO-{zero_stage} checkpoint: {cause(err)}") from err
    return strip_model_prefix(state, tag_dir)
