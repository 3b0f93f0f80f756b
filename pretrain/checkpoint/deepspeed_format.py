"""engine.kind=deepspeed's payload: DeepSpeed's checkpoint under the tag "ds" and format.json (the ZeRO
stage and the data-parallel size that wrote it). Loaded at another size or stage, it is first converted
to DeepSpeed's universal format in a scratch directory, then loaded from there (ZeRO 1-3 at another
size; stage changes between ZeRO-1 and ZeRO-2).

Nothing here unpickles code: DeepSpeed's own loaders are run with torch.load forced to
weights_only=True and the plain data classes its files hold allow-listed.

DeepSpeed copies the module's weights before it reads the optimizer's partition, and its strict load
copies every matching tensor before it raises for the rest. So before DeepSpeed is called, the saved
module's names, shapes (ZeRO's recorded parameter shapes) and dtypes are checked against the engine's
(pretrain/checkpoint/fit.py), and the optimizer partition this rank will read is read once,
weights-only: a checkpoint that does not fit or does not read changes nothing.
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

from pretrain.checkpoint.fit import Spec, check_fit
from pretrain.checkpoint.layout import CheckpointError, cause, strip_model_prefix
from pretrain.distributed import process_group as distributed
from pretrain.telemetry.log import get_logger

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


def deepspeed_layout_problem(path: Path, zero_stage: int, world: int) -> str | None:
    """Why the checkpoint at `path` cannot load at this ZeRO stage and size (None when it can,
    directly or through the universal format): asked at start-up, before an engine is built."""
    try:
        _needs_universal(path, zero_stage, world)
    except CheckpointError as err:
        return str(err)
    return None


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
    problem = ""
    try:
        _check_fit(engine, source, read_partition=not universal)
    except CheckpointError as err:
        problem = str(err)
    if distributed.all_reduce_sum([1.0 if problem else 0.0])[0]:  # all ranks stop, or none: the load is collective
        raise CheckpointError(problem or f"{path}: another rank's part does not read (its log names the file)")
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


def _load_file(path: Path) -> Any:
    """One of DeepSpeed's files, weights-only; raises CheckpointError naming it."""
    try:
        with deepspeed_weights_only():
            return torch.load(path, map_location="cpu")
    except Exception as err:  # torch.load raises many types, weights-only refusals among them
        raise CheckpointError(f"{path}: cannot read it (weights-only): {cause(err)}") from err


def _module_specs(engine: Any) -> dict[str, Spec]:
    """The engine's module as its checkpoint records it: name -> (shape, dtype); under ZeRO-3 a
    parameter's shape is its whole shape (`ds_shape`), not the empty placeholder the module holds."""
    named = engine.module.named_parameters(remove_duplicate=False)  # tied weights under each of their names
    shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in named}
    return {name: (shapes.get(name, tuple(t.shape)), t.dtype) for name, t in engine.module.state_dict().items()}


def _saved_module_specs(states: dict[str, Any], source: Path) -> dict[str, Spec]:
    """The module a DeepSpeed model-states file holds: its tensors' names and dtypes, with the
    parameters' whole shapes from ZeRO's recorded `param_shapes` and `shared_params` (its tensors are
    placeholders at ZeRO-3)."""
    module = states.get("module") if isinstance(states, dict) else None
    if not isinstance(module, dict):
        raise CheckpointError(f"{source}: holds no DeepSpeed module state")
    recorded = states.get("param_shapes") or []
    shapes = {name: tuple(shape) for group in recorded for name, shape in dict(group).items()}
    for name, twin in dict(states.get("shared_params") or {}).items():  # a tied weight is recorded once
        if twin in shapes:
            shapes.setdefault(name, shapes[twin])
    return {name: (shapes.get(name, tuple(t.shape)), t.dtype) for name, t in module.items()
            if isinstance(t, torch.Tensor)}


def _check_fit(engine: Any, path: Path, read_partition: bool) -> None:
    """Before DeepSpeed copies anything: the saved module must have the engine module's names, shapes
    and dtypes, and (when loading at the saved size and stage) this rank's optimizer partition must
    read. Raises CheckpointError naming the file."""
    tag_dir = path / DEEPSPEED_TAG
    states_files = sorted(tag_dir.glob("*mp_rank_00_model_states.pt"))
    if not states_files:
        raise CheckpointError(f"{tag_dir}: no DeepSpeed model states (mp_rank_00_model_states.pt)")
    states = _load_file(states_files[0])
    check_fit(states_files[0], _saved_module_specs(states, states_files[0]), _module_specs(engine),
              "this run's model")
    group = getattr(engine.optimizer, "dp_process_group", None)
    if read_partition and group is not None:  # ZeRO 1-3 keep the optimizer in one file per data-parallel rank
        import torch.distributed as dist

        dp_rank = dist.get_rank(group=group) if dist.is_initialized() else 0
        for partition in sorted(tag_dir.glob(f"*zero_pp_rank_{dp_rank}_mp_rank_*optim_states.pt")):
            _load_file(partition)


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
