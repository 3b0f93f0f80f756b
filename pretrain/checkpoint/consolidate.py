"""Consolidation: any engine's verified checkpoint -> one fp32 CausalLM on the CPU.

Whatever engine wrote the checkpoint (single process, DeepSpeed ZeRO 0-3, FSDP2 through
torch.distributed.checkpoint), the weights are gathered into one state dict under the CausalLM's
own parameter names and loaded into a freshly built model, so that a missing or unexpected key
fails here, not in a user's notebook. Loading never unpickles code: safetensors, YAML through
safe_load, and torch.load with weights_only=True (the format modules beside this one read each
engine's payload).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from data_pipeline.storage import is_remote
from model import CausalLM, build_model
from pretrain.checkpoint import dcp_format, deepspeed_format, torch_format
from pretrain.checkpoint.layout import DELETING_SUFFIX, TMP_SUFFIX, CheckpointError
from pretrain.checkpoint.manifest import committed_steps, fetch, verify_local
from pretrain.config import ConfigError, RunConfig, config_from_dict, read_saved_config
from pretrain.telemetry.log import get_logger


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory meant by `path`: a committed step directory itself, or a checkpoints or
    run directory, in which case the newest of its committed steps that verifies (older ones are
    tried when newer ones fail, with a warning). The `latest` pointer is not followed: a file
    anyone can edit must not send a reader outside the run, into a `.tmp`, or past a newer step."""
    return next(iter_checkpoints(path))


def iter_checkpoints(path: str | Path) -> Iterator[Path]:
    """The step directories `path` may mean, best first: `path` itself when it is a committed step
    directory, else the committed steps under it (or its checkpoints/) that verify, newest first,
    each failing one reported. Raises CheckpointError when there is none at all. On an object store
    (an s3:// URL...) each is first copied here by its manifest (`remote_checkpoints`)."""
    if is_remote(str(path)):
        yield from remote_checkpoints(str(path))
        return
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run directory")
    if (path / "config.yaml").is_file() and (path / "engine").is_dir():
        if path.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            raise CheckpointError(f"{path}: an uncommitted checkpoint (being written or deleted)")
        yield path
        return
    for root in (path, path / "checkpoints"):
        steps = committed_steps(str(root)) if root.is_dir() else []
        if steps:
            yield from _verified(root, steps)
            return
    raise CheckpointError(f"{path}: not a checkpoint (no engine/ and config.yaml) and holds no step_* checkpoints")


_downloads: tempfile.TemporaryDirectory | None = None
_origins: dict[Path, str] = {}


def origin(step_dir: Path) -> str:
    """Where a step directory came from: its URL for a local copy of a remote one, else its path."""
    return _origins.get(step_dir, str(step_dir.resolve()))


def remote_checkpoints(url: str) -> Iterator[Path]:
    """Local, verified copies of the step directories the URL `url` means, best first, as
    `iter_checkpoints`: the step itself when `url/manifest.json` exists, else the committed steps
    under `url` or `url/checkpoints`. The copies live in a temporary directory until the process ends."""
    global _downloads
    if _downloads is None:
        _downloads = tempfile.TemporaryDirectory(prefix="remote-checkpoints-")
    url = url.rstrip("/")
    parent, _, name = url.rpartition("/")
    if "/" in url.split("://", 1)[-1] and name in committed_steps(parent):
        candidates = [(parent, name)]
    else:
        candidates = next(([(root, n) for n in steps] for root in (url, f"{url}/checkpoints")
                           if (steps := committed_steps(root))), [])
    if not candidates:
        raise CheckpointError(f"{url}: not a committed checkpoint (no manifest.json) and holds no committed step_*")
    first_error = None
    for i, (root, step) in enumerate(candidates):
        into = Path(_downloads.name) / str(len(_origins)) / str(i)
        try:
            local = fetch(f"{root}/{step}", into)
            verify_local(local)
        except CheckpointError as err:
            get_logger().warning("skipping checkpoint %s/%s: %s", root, step, err)
            first_error = first_error or err
            continue
        _origins[local] = f"{root}/{step}"
        yield local
    if first_error is not None:
        raise CheckpointError(f"{url}: no committed checkpoint verifies (the newest: {first_error})")


def _verified(root: Path, steps: list[str]) -> Iterator[Path]:
    """Those of `steps` (names under `root`, newest first) that verify against their manifest."""
    first_error = None
    for name in steps:
        try:
            verify_local(root / name)
        except CheckpointError as err:
            get_logger().warning("skipping checkpoint %s: %s", root / name, err)
            first_error = first_error or err
            continue
        yield root / name
    if first_error is not None:
        raise CheckpointError(f"{root}: no committed checkpoint verifies (the newest: {first_error})")


def load_newest(path: str | Path, reader: str) -> tuple[Path, RunConfig, CausalLM]:
    """(step directory, its run config, its consolidated model) for the newest checkpoint `path`
    means that verifies and loads; one that verifies but does not load is reported (as `reader`'s
    warning) and the next older one tried. A step directory named directly is not replaced."""
    first_error = None
    for step_dir in iter_checkpoints(path):
        try:
            if step_dir == Path(path):  # iter_checkpoints verified the others; this one it only named
                try:
                    verify_local(step_dir)
                except CheckpointError as err:
                    raise CheckpointError(f"{step_dir}: checkpoint failed verification: {err}") from err
            cfg = read_run_config(step_dir)
            return step_dir, cfg, consolidate(step_dir, cfg)
        except CheckpointError as err:
            if step_dir == Path(path):  # named directly: there is nothing to fall back to
                raise
            get_logger().warning("%s: skipping checkpoint %s: %s", reader, step_dir, err)
            first_error = first_error or err
    raise CheckpointError(f"{path}: no checkpoint there loads (the newest: {first_error})")


def read_run_config(step_dir: Path) -> RunConfig:
    """The resolved RunConfig saved beside the weights."""
    path = step_dir / "config.yaml"
    try:
        return config_from_dict(read_saved_config(path))
    except ConfigError as err:
        raise CheckpointError(f"{path}: cannot read the run config: {err}") from err


def consolidate(step_dir: Path, cfg: RunConfig) -> CausalLM:
    """The trained model of a verified step directory, on CPU in fp32, whatever engine saved it."""
    engine_dir = step_dir / "engine"
    state = read_engine_weights(engine_dir)
    model = build_model(cfg.model)
    names = model.state_dict(keep_vars=True)  # persistent entries only, tied aliases included
    aliases = _tied_aliases(model)
    state = {k: v for k, v in state.items() if k not in aliases}
    missing = sorted(set(names) - set(state) - set(aliases))
    unexpected = sorted(set(state) - set(names))
    if missing or unexpected:
        raise CheckpointError(
            f"{engine_dir}: weights do not match model.kind={cfg.model.kind!r} from config.yaml "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(names[key].shape):
            expected = tuple(names[key].shape)
            raise CheckpointError(f"{engine_dir}: {key} has shape {tuple(value.shape)}, the model expects {expected}")
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


FORMATS = (torch_format, dcp_format, deepspeed_format)
"""Every engine's payload format: each tells whether a directory holds it and reads its weights."""


def read_engine_weights(engine_dir: Path) -> dict[str, torch.Tensor]:
    """The CausalLM's weights (its own parameter names, CPU) from the `engine/` directory of a
    checkpoint, in whichever engine's format it holds; raises CheckpointError naming the path."""
    for fmt in FORMATS:
        if fmt.holds(engine_dir):
            return fmt.read_weights(engine_dir)
    names = ", ".join(fmt.__name__.rsplit(".", 1)[-1] for fmt in FORMATS)
    raise CheckpointError(f"{engine_dir}: holds no engine payload in any known format ({names})")
