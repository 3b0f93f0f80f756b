"""Crash consistency by injection: a forked child runs one checkpoint operation and dies (os._exit,
as a SIGKILL would) just before its Nth file-system mutation, for every N; the next start must
restore the newest committed step, with the payload saved for it, and be able to save again."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

from pretrain.checkpoint import checkpointer as checkpointer_module
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.manifest import verify

KILLED = 9


class FakeEngine:
    """The Engine protocol's checkpoint half: one small JSON file holding `value`."""

    def __init__(self, value: int = -1) -> None:
        self.value = value

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "payload.json"), "w") as f:
            f.write(json.dumps({"value": self.value}))

    def load(self, path: str, scratch: Path) -> None:
        self.value = json.loads(Path(path, "payload.json").read_text())["value"]


class ObjectStoreFS(LocalFileSystem):
    """A local directory with an object store's semantics: `mv` copies file by file, then deletes
    (fsspec's generic implementation), so a kill inside it leaves both halves."""

    protocol = "objstore"

    def mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: Any = None, **kwargs: Any) -> None:
        AbstractFileSystem.mv(self, path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)


fsspec.register_implementation("objstore", ObjectStoreFS, clobber=True)


def payload_of(step: int, version: int = 0) -> int:
    return 1000 * version + step


def save(ckpt: Checkpointer, step: int, version: int = 0) -> None:
    state = {"trainer": {"step": step, "version": version}, "data": {}}
    ckpt.save(step, FakeEngine(payload_of(step, version)), state, "run: {}\n")
    ckpt.wait()


class Mutations:
    """Counts every file-system mutation (renames, creations, deletions, writes) and exits the
    process just before the `kill_at`th one; 0 counts without killing."""

    NAMES = ("replace", "rename", "mkdir", "unlink", "remove", "rmdir")

    def __init__(self, kill_at: int) -> None:
        self.kill_at, self.count = kill_at, 0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.kill_at:
            os._exit(KILLED)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.tick()
            return fn(*args, **kwargs)

        return wrapped

    def install(self) -> None:
        for name in self.NAMES:
            setattr(os, name, self.wrap(getattr(os, name)))
        real_open = builtins.open

        def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if any(c in mode for c in "wax+"):
                self.tick()
            return real_open(file, mode, *args, **kwargs)

        builtins.open = io.open = opening
        checkpointer_module.save_file = self.wrap(checkpointer_module.save_file)  # safetensors writes in Rust


def in_child(action: Callable[[], None], kill_at: int) -> tuple[int, int]:
    """Fork; the child runs `action` under mutation counting and reports (exit code, mutations)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            counter = Mutations(kill_at)
            counter.install()
            try:
                action()
            finally:
                os.write(write_end, str(counter.count).encode())
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read()
    return os.waitstatus_to_exitcode(status), int(reported or 0)




def restored(root: str, staging: Path) -> tuple[int, int] | None:
    """What the next start resumes from: (step, payload), or None for a fresh start."""
    engine = FakeEngine()
    state = Checkpointer(root, staging, 10, 0, False).resume("auto", engine)
    if state is None:
        return None
    verify(state["path"])
    return state["trainer"]["step"], engine.value


def ckpt(root: str, staging: Path, keep_last: int = 10, milestone: int = 0, async_save: bool = False) -> Checkpointer:
    return Checkpointer(root, staging, keep_last, milestone, async_save)


SCENARIOS: dict[str, dict[str, Any]] = {
    # name: before (set-up, not killed), action (killed), state before, state after, steps that must survive
    "first-save": dict(before=lambda r, s: None, action=lambda r, s: save(ckpt(r, s), 1),
                       old=None, new=(1, payload_of(1))),
    "restart-resave": dict(
        before=lambda r, s: [save(ckpt(r, s), n) for n in (1, 2)],
        action=lambda r, s: (lambda c: (c.resume("auto", FakeEngine()), save(c, 2, version=1)))(ckpt(r, s)),
        old=(2, payload_of(2)), new=(2, payload_of(2)), writes=False),  # the resumed step is not re-saved
    "overwrite-same-step": dict(
        before=lambda r, s: [save(ckpt(r, s), n) for n in (1, 2)],
        action=lambda r, s: save(ckpt(r, s), 2, version=1),
        old=(2, payload_of(2)), new=(2, payload_of(2, 1))),
    "prune-keep-last-1": dict(
        before=lambda r, s: save(ckpt(r, s, keep_last=1), 1),
        action=lambda r, s: save(ckpt(r, s, keep_last=1), 2),
        old=(1, payload_of(1)), new=(2, payload_of(2))),
    "milestone": dict(
        before=lambda r, s: [save(ckpt(r, s, keep_last=1, milestone=2), n) for n in (2, 3)],
        action=lambda r, s: save(ckpt(r, s, keep_last=1, milestone=2), 4),
        old=(3, payload_of(3)), new=(4, payload_of(4)), keep=[2]),
    "async-save": dict(
        before=lambda r, s: save(ckpt(r, s, keep_last=1, async_save=True), 1),
        action=lambda r, s: save(ckpt(r, s, keep_last=1, async_save=True), 2),
        old=(1, payload_of(1)), new=(2, payload_of(2))),
    "remote-save-and-prune": dict(
        remote=True, before=lambda r, s: save(ckpt(r, s, keep_last=1), 1),
        action=lambda r, s: save(ckpt(r, s, keep_last=1), 2),
        old=(1, payload_of(1)), new=(2, payload_of(2))),
    "remote-overwrite-same-step": dict(
        remote=True, before=lambda r, s: save(ckpt(r, s), 1),
        action=lambda r, s: save(ckpt(r, s), 1, version=1),
        old=(1, payload_of(1)), new=(1, payload_of(1, 1))),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_crash_point_keeps_the_newest_committed_step(name: str, tmp_path: Path) -> None:
    spec = SCENARIOS[name]
    template, staging = tmp_path / "template", tmp_path / "staging"
    prefix = "objstore://" if spec.get("remote") else ""
    spec["before"](prefix + str(template), staging)
    template.mkdir(exist_ok=True)

    def fresh() -> str:
        work = tmp_path / "work"
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(template, work)
        return prefix + str(work)

    root = fresh()
    code, total = in_child(lambda: spec["action"](root, staging), kill_at=0)
    assert code == 0, f"the uninterrupted {name} failed (exit {code})"
    assert (total > 0) == spec.get("writes", True), f"{name}: {total} mutations"
    assert restored(root, staging) == spec["new"]
    switched = False
    for kill_at in range(1, total + 1):
        root = fresh()
        code, _ = in_child(lambda root=root: spec["action"](root, staging), kill_at)
        assert code == KILLED, f"{name}: the child was not killed at mutation {kill_at}"
        got = restored(root, staging)
        assert got in (spec["old"], spec["new"]), f"{name}, killed at mutation {kill_at}/{total}: restored {got}"
        switched = switched or got == spec["new"]
        assert got == (spec["new"] if switched else spec["old"]), f"{name}: went back to the old state at {kill_at}"
        for step in spec.get("keep", []):
            assert any(n.startswith(f"step_{step:08d}") for n in ckpt(root, staging).list()), f"milestone {step} lost"
        next_step = (got[0] if got else 0) + 1  # the next start saves on, in the same directories
        save(ckpt(root, staging, keep_last=1), next_step, version=2)
        assert restored(root, staging) == (next_step, payload_of(next_step, 2)), f"{name}: no save after {kill_at}"
