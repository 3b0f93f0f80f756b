"""Checkpoints on an object store (s3://, gs://, any fsspec URL that is not a local path): a commit
without rename.

An object store has neither renames nor directories: "moving" a prefix copies each object and then
deletes it, so a kill in the middle leaves both halves. So a step is uploaded where it stays, and one
object commits it:

1. Every file of the step is uploaded under `<root>/step_N/`, `manifest.json` last. A step is
   committed exactly when its manifest exists (and verifies: every file it lists, with its size and
   sha256). Readers go by the manifest: they list `step_*/manifest.json`, read one, and download
   only the files it names, so a half-uploaded step, a stray object or a listing that lags behind the
   writes never passes for a committed step.
2. Re-saving a step that is committed already (a run that fell back past it reaches it again) first
   copies it aside to `step_N.old-<k>/`, manifest last (committed once whole, and restorable), then
   deletes `step_N/manifest.json` (from that instant the step is uncommitted) and the rest of its
   objects, then uploads the new one as in 1, and only then deletes the copy aside.
3. Deleting a step (pruning, the copies aside) deletes its manifest first.
4. `latest` is written after the commit. It is a hint for people; no reader trusts it.

A kill at any point thus leaves every step either committed and whole, or uncommitted; the newest
committed one is still there (tests/test_s3_checkpoint.py kills a save before each of its requests).
Every call goes through data_pipeline.storage.retrying, its retries counted by the caller
(`ckpt/retries` in metrics.jsonl).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from data_pipeline.storage import retrying
from pretrain.checkpoint.layout import LATEST, MANIFEST, OLD_SUFFIX, CheckpointError, old_number


class ObjectStore:
    """The checkpoints root `url` on an object store; `count(n)` is told of every retry made."""

    def __init__(self, url: str, count: Callable[[int], None] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.count = count

    def _call(self, what: str, key: str, call: Callable[[], Any]) -> Any:
        return retrying(f"{self.url}/{key}", call, self.count, what=what)

    # -- reading

    def committed(self) -> list[str]:
        """Names of the step directories whose manifest exists (order: unsorted)."""
        found = self._call("list", "step_*/" + MANIFEST, lambda: self.fs.glob(f"{self.root}/step_*/{MANIFEST}"))
        return [p.rstrip("/").split("/")[-2] for p in found]

    def read_manifest(self, name: str) -> dict[str, Any]:
        """Step `name`'s manifest; CheckpointError when it is missing or not a manifest."""
        key = f"{name}/{MANIFEST}"
        try:
            raw = self._call("read", key, lambda: self.fs.cat_file(f"{self.root}/{key}"))
            manifest = json.loads(raw)
            files = manifest["files"]
            if not isinstance(files, dict):
                raise TypeError("files is not a mapping")
        except FileNotFoundError as err:
            raise CheckpointError(f"{self.url}/{key}: missing (the step is not committed)") from err
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{self.url}/{key}: not a valid manifest: {err}") from err
        return manifest

    def download(self, name: str, into: Path) -> Path:
        """Copy step `name` here by its manifest: the manifest, then each file it lists (nothing
        else under the prefix); returns the local directory, to verify with manifest.verify_local."""
        manifest = self.read_manifest(name)
        target = into / name
        for rel in manifest["files"]:
            if rel.startswith("/") or ".." in rel.split("/"):
                raise CheckpointError(f"{self.url}/{name}/{MANIFEST}: lists {rel!r}, outside the step directory")
            local = target / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            self._call("download", f"{name}/{rel}", lambda rel=rel, local=local: self.fs.get_file(
                f"{self.root}/{name}/{rel}", str(local)))
        (target / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        return target

    # -- writing

    def commit(self, stage: Path, name: str) -> None:
        """Upload the staged step `stage` as `name` under the protocol of this module's docstring."""
        committed = set(self.committed())
        aside = None
        if name in committed:
            aside = f"{name}{OLD_SUFFIX}{self._next_old(name)}"
            self._copy(name, aside)
        self.delete(name)
        files = sorted(p for p in stage.rglob("*") if p.is_file() and p.name != MANIFEST)
        for path in [*files, stage / MANIFEST]:  # the manifest last: it commits the step
            rel = path.relative_to(stage).as_posix()
            self._parent(f"{name}/{rel}")
            self._call("upload", f"{name}/{rel}", lambda path=path, rel=rel: self.fs.put_file(
                str(path), f"{self.root}/{name}/{rel}"))
        for old in sorted(n for n in self._names() if n.startswith(name + OLD_SUFFIX)):
            self.delete(old)
        self._call("write", LATEST, lambda: self.fs.pipe_file(f"{self.root}/{LATEST}", name.encode()))

    def delete(self, name: str) -> None:
        """Uncommit step `name` (its manifest first), then delete the rest of its objects."""
        prefix = f"{self.root}/{name}"
        self._call("delete", f"{name}/{MANIFEST}", lambda: _ignore_missing(self.fs.rm_file, f"{prefix}/{MANIFEST}"))
        rest = self._call("list", f"{name}/", lambda: self.fs.find(prefix))
        if rest:
            self._call("delete", f"{name}/", lambda: _ignore_missing(self.fs.rm, rest))

    def _copy(self, name: str, to: str) -> None:
        """Server-side copy of committed step `name` to `to`, the manifest last."""
        manifest = self.read_manifest(name)
        for rel in [*sorted(manifest["files"]), MANIFEST]:
            self._parent(f"{to}/{rel}")
            self._call("copy", f"{name}/{rel}", lambda rel=rel: self.fs.copy(
                f"{self.root}/{name}/{rel}", f"{self.root}/{to}/{rel}"))

    def _parent(self, key: str) -> None:
        """A store has no directories; a local directory standing in for one needs them made."""
        if getattr(self.fs, "local_file", False):
            self.fs.makedirs(f"{self.root}/{key}".rsplit("/", 1)[0], exist_ok=True)

    def _names(self) -> list[str]:
        """The names directly under the root (steps and their copies, committed or not)."""
        listed = self._call("list", "", lambda: self.fs.ls(self.root, detail=False, refresh=True))
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in listed]

    def _next_old(self, name: str) -> int:
        return old_number(self._names(), name)


def _ignore_missing(call: Callable[..., Any], *args: Any) -> None:
    """`call(*args)`, a deletion: what is gone already is fine (a retried delete, a killed one)."""
    with contextlib.suppress(FileNotFoundError):
        call(*args)
