"""The checkpointer: one directory per step holding everything needed to continue exactly.

A checkpoint is written to a local staging area, copied under a temporary name to any fsspec root,
and committed by its manifest and a rename, so a crash at any point leaves the previous one usable;
a step that exists already is renamed aside (`.old-<n>`, still restorable) before its replacement is
renamed in, and the step a run resumed from is not saved again. A directory that does not match its
manifest is never loaded (resume "auto" falls back to the one before); one that matches but does not
load into this run is a refusal, and the engines' loaders leave the engine as it was.
Loading never unpickles code (JSON and safetensors here; engine payloads are the format modules
beside this one). docs/training.md, "Checkpoints", gives the layout (pretrain/checkpoint/layout.py),
the commit order and retention.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from data_pipeline.storage import StorageError
from pretrain.checkpoint.layout import (
    DELETING_SUFFIX,
    LATEST,
    MANIFEST,
    OLD_SUFFIX,
    TMP_SUFFIX,
    TRAINER_STATE,
    CheckpointError,
    old_number,
    step_dir_name,
    step_number,
)
from pretrain.checkpoint.manifest import (
    committed_steps,
    fetch,
    fsync_dir,
    fsync_write,
    is_local,
    local_path,
    manifest_for,
    verify_local,
)
from pretrain.checkpoint.object_store import ObjectStore
from pretrain.checkpoint.rng import rng_state, set_rng_state
from pretrain.distributed import process_group as distributed
from pretrain.protocols import Engine
from pretrain.telemetry.log import get_logger


def next_old_number(root: Path, name: str) -> int:
    """The next free n for `<root>/<name>.old-<n>`, the name of a directory renamed aside."""
    return old_number([p.name for p in root.iterdir()], name)


class Checkpointer:
    """Saves, prunes and restores the checkpoints of one run under `root` (path or fsspec URL).

    `staging` is a local directory on a filesystem every rank of the node (or job) can reach: the
    engines write there. For a local root, the staging area is the root itself.
    """

    def __init__(self, root: str, staging: Path, keep_last: int, milestone_every: int, async_save: bool):
        self.root = str(root)
        self.local = is_local(self.root)
        self.staging = local_path(self.root) if self.local else Path(staging)
        self.keep_last, self.milestone_every, self.async_save = keep_last, milestone_every, async_save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_step = 0  # the step whose commit raised `_error`
        self.last_committed: str | None = None
        self.restored_step: int | None = None  # the committed step this run resumed from
        self.retries = 0  # retried object-store calls (ckpt/retries in metrics.jsonl)

    # -- saving

    def save(
        self, step: int, engine: Engine, trainer_state: dict[str, Any], config_yaml: str,
        rank_writer: Callable[[Path, int], None] | None = None,
    ) -> None:
        """Collective: write this step's checkpoint; commit it now or in the background.
        `rank_writer(directory, rank)`, when given, adds each rank's own files (the carried
        states of train.carry_state). Only rank 0 commits; a commit that fails raises on every rank
        (`settle`): now when it runs in the foreground, else at the next `settle` or `failed` vote."""
        self.settle()
        if step == self.restored_step:  # already committed and verified: re-saving it only risks it
            get_logger().info("step %d is the checkpoint this run resumed from: not saved again", step)
            self.last_committed = step_dir_name(step)
            return
        stage = self.staging / (step_dir_name(step) + ".tmp")
        rank = distributed.rank()
        if rank == 0:
            shutil.rmtree(stage, ignore_errors=True)
            (stage / "rng").mkdir(parents=True)
        distributed.barrier()
        engine.save(str(stage / "engine"))
        plain, tensors = rng_state()
        fsync_write(stage / "rng" / f"rank_{rank}.json", json.dumps(plain))
        save_file(tensors, str(stage / "rng" / f"rank_{rank}.safetensors"))
        if rank_writer is not None:
            rank_writer(stage, rank)
        if rank == 0:
            state = {**trainer_state, "world_size": distributed.world_size()}
            fsync_write(stage / TRAINER_STATE, json.dumps(state, indent=1, sort_keys=True))
            fsync_write(stage / "config.yaml", config_yaml)
        distributed.barrier()
        if rank == 0 and self.async_save:
            self._thread = threading.Thread(target=self._commit_guarded, args=(stage, step), daemon=True)
            self._thread.start()
        elif rank == 0:
            self._commit_guarded(stage, step)
        if not self.async_save:
            self.settle()

    def _commit_guarded(self, stage: Path, step: int) -> None:
        try:
            self._commit(stage, step)
        except Exception as err:  # raised on every rank by settle() (or the loop's vote)
            self._error, self._error_step = err, step

    def _commit(self, stage: Path, step: int) -> None:
        """Manifest, then swap in: a committed step is never absent. An existing directory of the
        same step is first renamed aside to `<name>.old-<n>` (still a candidate for restoring),
        the new one renamed in, and only then the old one deleted."""
        manifest = manifest_for(stage, step)
        fsync_write(stage / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        name = step_dir_name(step)
        if self.local:
            self._commit_local(stage, name)
        else:
            self._commit_remote(stage, name)
        self.last_committed = name
        self.prune()

    def _commit_local(self, stage: Path, name: str) -> None:
        final = self.staging / name
        if final.exists():
            os.replace(final, self.staging / f"{name}{OLD_SUFFIX}{next_old_number(self.staging, name)}")
        os.replace(stage, final)
        fsync_dir(self.staging)
        for old in sorted(self.staging.glob(f"{name}{OLD_SUFFIX}*")):
            shutil.rmtree(old, ignore_errors=True)
        fsync_write(self.staging / (LATEST + ".tmp"), name)
        os.replace(self.staging / (LATEST + ".tmp"), self.staging / LATEST)

    def _commit_remote(self, stage: Path, name: str) -> None:
        """Upload in place, the manifest last (pretrain/checkpoint/object_store.py: an object store
        has no rename), then drop the staged copy."""
        ObjectStore(self.root, self._count_retry).commit(stage, name)
        shutil.rmtree(stage, ignore_errors=True)

    def _count_retry(self, n: int) -> None:
        self.retries += n

    def failed(self) -> bool:
        """Whether this rank's commit (rank 0's: only it commits) failed and was not raised yet."""
        return self._error is not None

    def poll(self) -> None:
        """Raise, in this rank alone, an error that happened in a commit (see `settle` for all ranks)."""
        if self._error is not None:
            err = self._error
            raise CheckpointError(self._take_error()) from err

    def wait(self) -> None:
        """Block until the commit in flight (if any) has finished, then raise its error in this rank."""
        self._join_thread()
        self.poll()

    def settle(self) -> None:
        """Collective: rank 0 waits for its commit in flight, and when a commit of rank 0 failed, every
        rank raises the same CheckpointError (launch/pretrain.py: exit 2 on every rank), with rank 0's
        message; the ranks wait for one another here, as at a barrier."""
        self._join_thread()
        self.raise_if_failed(distributed.all_reduce_sum([1.0 if self.failed() else 0.0])[0] > 0)

    def raise_if_failed(self, failed_anywhere: bool) -> None:
        """Collective when `failed_anywhere` (every rank's sum of `failed()`, e.g. from a vote the loop
        takes anyway): every rank raises rank 0's commit error, its text sent to the others."""
        if not failed_anywhere:
            return
        err = self._error
        said = share_text(self._take_error() if err is not None and distributed.rank() == 0 else "")
        raise CheckpointError(said or "rank 0 could not commit a checkpoint (its log says why)") from err

    def _take_error(self) -> str:
        """The message of the commit error held (which is dropped: it is raised once)."""
        err, self._error = self._error, None
        return f"rank 0 could not commit the checkpoint of step {self._error_step}: {err}"

    def _join_thread(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def join(self, timeout_s: float) -> bool:
        """Wait `timeout_s` at most for the commit in flight (the hang watchdog's grace before it exits);
        whether none is left. An error it raised stays for `poll`."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def prune(self) -> None:
        """Delete committed checkpoints beyond the newest `keep_last`, keeping every milestone.
        Each goes by a rename to `<name>.del` first, so that it disappears at once rather than
        file by file (a half-deleted step would otherwise look committed)."""
        if self.local:  # left by a kill in the middle of an earlier prune
            for doomed in self.staging.glob(f"step_*{DELETING_SUFFIX}"):
                shutil.rmtree(doomed, ignore_errors=True)
        steps = sorted({step_number(n) for n in self.list()}, reverse=True)
        for step in steps[self.keep_last :]:
            if self.milestone_every and step % self.milestone_every == 0:
                continue
            for name in [n for n in self.list() if step_number(n) == step]:
                if self.local:
                    doomed = self.staging / (name.split(".")[0] + DELETING_SUFFIX)
                    shutil.rmtree(doomed, ignore_errors=True)
                    os.replace(self.staging / name, doomed)
                    shutil.rmtree(doomed, ignore_errors=True)
                else:
                    ObjectStore(self.root, self._count_retry).delete(name)

    # -- listing and restoring

    def list(self) -> list[str]:
        """Names of the candidate step directories (manifest.committed_steps), newest first; the
        retries of a remote listing count in `retries`, as every other call to the store does."""
        return committed_steps(self.root, self._count_retry)

    def _local_copy(self, url: str) -> Path:
        if is_local(url):
            return local_path(url)
        cache = self.staging / "restore"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        return fetch(url, cache, self._count_retry)

    def _verified(self, candidates: list[str]) -> Path | None:
        """Rank 0: a local copy of the first of `candidates` (step directory names, consumed from
        the front) that verifies; the others are reported and skipped. None when none is left."""
        while candidates:
            url = f"{self.root.rstrip('/')}/{candidates.pop(0)}"
            try:
                local = self._local_copy(url)
                verify_local(local)
                return local
            except CheckpointError as err:
                get_logger().warning("skipping checkpoint %s: %s", url, err)
        return None

    def _explicit(self, mode: str) -> Path:
        """Rank 0: the verified local copy of the checkpoint named by `mode` (a path or URL)."""
        if Path(mode).name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            raise CheckpointError(f"{mode}: an uncommitted checkpoint directory (checkpoint.resume)")
        local = self._local_copy(mode)
        verify_local(local)
        return local

    def choose(self, mode: str) -> Path | None:
        """Rank 0 alone (it reads and hashes; nothing is loaded): the verified local copy of the
        checkpoint `mode` names. "none": None. "auto": the newest that verifies, corrupt or partial
        ones reported and skipped (None when none verifies). A path or URL: that one, or a
        CheckpointError."""
        if mode == "none":
            return None
        if mode == "auto":
            return self._verified(self.list())
        return self._explicit(mode)

    def restore(self, directory: Path, engine: Engine) -> dict[str, Any]:
        """Collective: load `directory` (chosen by rank 0, visible to every rank) on every rank;
        returns the saved trainer state plus "path". A checkpoint that verifies but does not load
        into this run raises a CheckpointError on every rank, naming the mismatch; no rank's model
        or optimizer has been changed by it (pretrain/checkpoint/fit.py)."""
        state, error = self._load_everywhere(directory, engine)
        if state is None:
            raise CheckpointError(
                f"{directory}: verified but does not load into this run, so nothing was loaded: {error} "
                f"(if it is not this run's checkpoint, move it out of {self.root} to resume from the one before)"
            )
        return state

    def resume(self, mode: str, engine: Engine) -> dict[str, Any] | None:
        """Collective `choose` (on rank 0) and `restore` (everywhere): the saved state, or None when
        `mode` chooses nothing."""
        problem, choice = "", ""
        if distributed.rank() == 0:
            try:
                choice = str(self.choose(mode) or "")
            except (CheckpointError, StorageError) as err:  # a store out of reach stops every rank alike
                problem = str(err)
        problem = share_text(problem)
        if problem:
            raise CheckpointError(problem)
        choice = share_text(choice)
        return self.restore(Path(choice), engine) if choice else None

    def restore_before(self, step: int, engine: Engine) -> dict[str, Any] | None:
        """Collective: restore the newest checkpoint of a step before `step` that verifies (a loss-spike
        rollback, in the running processes); as `resume`'s return, or None if there is none."""
        self.settle()
        chosen = None
        if distributed.rank() == 0:
            chosen = self._verified([n for n in self.list() if step_number(n) < step])
        choice = share_text(str(chosen or ""))
        return self.restore(Path(choice), engine) if choice else None

    def _load_everywhere(self, directory: Path, engine: Engine) -> tuple[dict[str, Any] | None, str]:
        """Collective: load `directory` on every rank; (state, "") when every rank succeeded, else
        (None, this rank's error or a note that another rank failed). Two steps, every rank agreeing
        after each: this rank's own files (no collective), then the engine's payload, a collective
        load that no rank may enter while another has stopped."""
        state: dict[str, Any] = {}
        steps = (
            lambda: state.update(self._own_files(directory)),
            lambda: engine.load(str(directory / "engine"), self.staging / "scratch"),
        )
        for step in steps:
            error = ""
            try:
                step()
            except Exception as err:  # engines' loaders raise many types; each means "cannot use this one"
                get_logger().debug("loading %s failed", directory, exc_info=True)
                error = f"{type(err).__name__}: {err}"
            if distributed.all_reduce_sum([1.0 if error else 0.0])[0]:
                return None, error or "another rank failed to load it (its log names the file)"
        self.restored_step = step_number(directory.name)
        state["path"] = str(directory)
        return state, ""

    def _own_files(self, directory: Path) -> dict[str, Any]:
        """This rank's part of `directory` outside the engine, read and applied before the engine
        is touched: the trainer state (returned) and this rank's RNG states (set)."""
        state = saved_trainer_state(directory)
        plain = directory / "rng" / f"rank_{distributed.rank()}.json"
        if plain.is_file():  # a rank that did not exist when saving keeps its fresh seed
            saved = _read_json(plain), _read_safetensors(plain.with_suffix(".safetensors"))
            try:
                set_rng_state(*saved)
            except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as err:
                raise CheckpointError(f"{plain}: not the RNG states this program saves: {err!r}") from err
        return state


def saved_trainer_state(directory: Path) -> dict[str, Any]:
    """The trainer state a checkpoint directory holds (step, tokens, the data loader's state...)."""
    return _read_json(directory / TRAINER_STATE)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; raises CheckpointError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a JSON file: {err}") from err
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_safetensors(path: Path) -> dict[str, Any]:
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"{path}: not a safetensors file: {err}") from err


def share_text(text: str) -> str:
    """Collective: rank 0's `text` on every rank, sent as numbers (no pickle on the wire)."""
    if not dist.is_initialized():
        return text
    data = list(text.encode()) if distributed.rank() == 0 else []
    length = int(distributed.all_reduce_sum([float(len(data))])[0])
    if length == 0:
        return ""
    values = distributed.all_reduce_sum([float(b) for b in data] if data else [0.0] * length)
    return bytes(int(v) for v in values).decode()
