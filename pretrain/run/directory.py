"""A run directory belongs to one run: what a start finds there is settled before anything is written.

The trainer calls `claim_run` once rank 0 holds the run's lock (pretrain/checkpoint/run_lock.py) and
before it writes `config.yaml` or builds a model. Rank 0 decides and every rank gets the same answer:

- `--start-over`: the previous run (every file of the directory but the lock, and a local checkpoint
  root outside it) is renamed aside to `<dir>.old-<n>`, never deleted, and the start is a fresh one.
- resume "none" where the checkpoint root holds committed checkpoints: refused. The new run's
  checkpoints would sit beside the old run's, and the next automatic resume would take the newest
  step of either.
- otherwise the checkpoint to resume is chosen and verified (`Checkpointer.choose`), and this start's
  config is compared with the directory's `config.yaml` and with the checkpoint's
  (pretrain/run/resume_rules.py): a change the saved state cannot continue from is refused, naming the
  keys with their old and new values and the ways forward; the allowed changes are logged as a diff.
- a checkpoint at or past `train.steps` means the run is complete (`RunComplete`): nothing is
  trained and nothing written.
- the engine's own conditions on the checkpoint (DeepSpeed's ZeRO stages), and the data: a source
  whose shards changed since the checkpoint (another fingerprint under the same path) is refused
  unless `data.mixture_change` says the change is meant.

A refusal is a `RunRefusedError` (exit 2 with one line) and leaves the directory byte for byte as it
was: the lock file, taken and given back, ends as it began.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from data_pipeline.shards import ManifestError
from pretrain.checkpoint.checkpointer import Checkpointer, next_old_number, saved_trainer_state, share_text
from pretrain.checkpoint.layout import CONFIG, ENGINE_DIR, OLD_SUFFIX, CheckpointError
from pretrain.checkpoint.manifest import local_path
from pretrain.checkpoint.run_lock import LOCK_FILE
from pretrain.config import ConfigError, RunConfig, read_saved_config
from pretrain.data import rebuilt_sources
from pretrain.distributed import process_group as distributed
from pretrain.engines import engine_class
from pretrain.run.resume_rules import Change, compare, describe
from pretrain.telemetry.log import get_logger


class RunRefusedError(RuntimeError):
    """This start cannot use the run directory as it is; the message says why and what to do."""


class RunComplete(Exception):
    """The run has reached train.steps: nothing to do (the message says so)."""


def claim_run(cfg: RunConfig, checkpointer: Checkpointer, mode: str, start_over: bool, world: int) -> Path | None:
    """Collective: settle what this start does with its run directory (module docstring). Returns the
    verified checkpoint every rank restores (None for a fresh start); raises RunRefusedError or
    RunComplete on every rank alike."""
    outcome: dict[str, str] = {}
    if distributed.rank() == 0:
        try:
            outcome = {"checkpoint": str(_decide(cfg, checkpointer, mode, start_over, world) or "")}
        except RunComplete as done:
            outcome = {"complete": str(done)}
        except (RunRefusedError, CheckpointError, ConfigError, ManifestError) as err:
            outcome = {"refused": str(err)}
    outcome = json.loads(share_text(json.dumps(outcome) if distributed.rank() == 0 else ""))
    if "refused" in outcome:
        raise RunRefusedError(outcome["refused"])
    if "complete" in outcome:
        raise RunComplete(outcome["complete"])
    return Path(outcome["checkpoint"]) if outcome["checkpoint"] else None


def _decide(cfg: RunConfig, checkpointer: Checkpointer, mode: str, start_over: bool, world: int) -> Path | None:
    """Rank 0's part of `claim_run`."""
    run_dir = Path(cfg.run.dir)
    if start_over:
        _move_aside(run_dir, checkpointer)
        return None
    if mode == "none" and checkpointer.list():
        raise RunRefusedError(
            f"{checkpointer.root}: holds this run's checkpoints (newest {checkpointer.list()[0]}), and --resume none "
            "would start a second run beside them that the next automatic resume confuses with this one; resume it "
            f"(--resume auto), pass --start-over to move it aside to {_aside(run_dir)} and start afresh, or give the "
            "new run another run.dir"
        )
    chosen = checkpointer.choose(mode)
    allowed = _check_config(cfg, run_dir, chosen)
    if chosen is None:
        return None
    state = saved_trainer_state(chosen)
    try:
        step, data = int(state["trainer"]["step"]), state["data"]
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{chosen}: trainer_state.json has no step or data state ({err!r})") from err
    if step >= cfg.train.steps:
        raise RunComplete(
            f"{run_dir}: this run is complete: {chosen.name} is at step {step} of train.steps={cfg.train.steps}; "
            "nothing was trained or written. Raise train.steps to train further"
        )
    problem = engine_class(cfg).checkpoint_problem(cfg, chosen / ENGINE_DIR, world)
    if problem:
        raise RunRefusedError(problem)
    _check_data(cfg, chosen, data)
    if allowed:
        get_logger().info("resuming %s with changed settings: %s", run_dir, ", ".join(map(str, allowed)))
    return chosen


def _aside(run_dir: Path) -> Path:
    """Where --start-over moves the run now in `run_dir`: `<run dir>.old-<n>`, n the next free one."""
    parent = run_dir.resolve().parent
    return parent / f"{run_dir.name}{OLD_SUFFIX}{next_old_number(parent, run_dir.name)}"


def _move_aside(run_dir: Path, checkpointer: Checkpointer) -> None:
    """--start-over: rename the previous run's files (all but the lock, held by this start) into
    `<run dir>.old-<n>`, and a local checkpoint root outside the directory to `<root>.old-<n>`."""
    if not checkpointer.local and checkpointer.list():
        raise RunRefusedError(
            f"{checkpointer.root}: --start-over moves local directories only; move or delete this run's checkpoints "
            "there yourself, or give the new run another checkpoint.dir"
        )
    moved = sorted(p for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
    root = local_path(checkpointer.root).resolve() if checkpointer.local else None
    root_outside = root is not None and root.is_dir() and not root.is_relative_to(run_dir.resolve())
    if moved:
        aside = _aside(run_dir)
        aside.mkdir()
        for path in moved:
            os.replace(path, aside / path.name)
        get_logger().warning("--start-over: moved the previous run in %s aside to %s", run_dir, aside)
    if root_outside and root is not None and any(root.iterdir()):
        target = root.parent / f"{root.name}{OLD_SUFFIX}{next_old_number(root.parent, root.name)}"
        os.replace(root, target)
        get_logger().warning("--start-over: moved the previous run's checkpoints %s aside to %s", root, target)


def _check_config(cfg: RunConfig, run_dir: Path, chosen: Path | None) -> list[Change]:
    """Refuse a config the run directory's config.yaml or the chosen checkpoint's cannot continue
    into; return the allowed changes (from the checkpoint's config when there is one)."""
    sources = [path for path in (run_dir / CONFIG, chosen / CONFIG if chosen else None) if path and path.is_file()]
    allowed_changes = []
    for source in sources:
        refused, allowed = compare(read_saved_config(source), cfg)
        if refused:
            weights = f", or start it there from this run's weights with init.from={run_dir}" if chosen else ""
            raise RunRefusedError(
                f"{source}: this run was started with another config, and these changes would not continue it: "
                f"{describe(refused)}. To train this config, give it a new run.dir{weights}; or pass --start-over "
                f"to move this run aside (to {_aside(run_dir)}) and start afresh"
            )
        allowed_changes = allowed
    return allowed_changes


def _check_data(cfg: RunConfig, chosen: Path, saved_data: dict) -> None:
    """Refuse training sources whose shards were rebuilt since `chosen` was saved, unless
    data.mixture_change declares it (then they start over as new sources of the mixture)."""
    rebuilt = rebuilt_sources(cfg, saved_data)
    if not rebuilt:
        return
    if cfg.data.mixture_change and not cfg.train.carry_state:
        get_logger().warning("data.mixture_change: training on rebuilt shards from their first sample: %s",
                             "; ".join(rebuilt))
        return
    way = ("or start a new run from this run's weights with init.from (the lanes of train.carry_state cannot "
           "change their data)" if cfg.train.carry_state else
           "or resume with data.mixture_change=true to train on the new shards from here (each rebuilt source "
           "starts again at its first sample, as a new source of a mixture)")
    raise RunRefusedError(
        f"{'; '.join(rebuilt)}: the shards changed since {chosen.name} was saved (rebuilt in place?); restore "
        f"the ones the run was trained on, {way}"
    )
