"""Manifests and where checkpoints live: hashing a step directory, verifying it against its manifest,
listing the committed steps under a root (a path or an fsspec URL) and copying a remote one here."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs

from pretrain.checkpoint.layout import MANIFEST, CheckpointError
from pretrain.checkpoint.object_store import ObjectStore


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the renames inside directory `path` durable (a power loss, not only a kill)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_local(url: str) -> bool:
    return "://" not in str(url) or str(url).startswith("file://")


def local_path(url: str) -> Path:
    return Path(str(url).removeprefix("file://"))


def manifest_for(directory: Path, step: int) -> dict[str, Any]:
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if rel != MANIFEST:
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return {"step": step, "files": files}


def verify_local(directory: Path) -> dict[str, Any]:
    """Check a local checkpoint directory against its manifest; returns the manifest or raises.
    The manifest must list every file of the directory, and nothing else: a file it does not list
    could be read by a loader without ever being checked."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST} (incomplete checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        sizes = {str(rel): (int(meta["bytes"]), str(meta["sha256"])) for rel, meta in files.items()}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{manifest_path}: not a valid manifest: {err}") from err
    if not sizes:
        raise CheckpointError(f"{manifest_path}: lists no files (a checkpoint holds at least its config and payload)")
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() or p.is_symlink()}
    present.discard(MANIFEST)
    extra = sorted(present - set(sizes))
    if extra:
        raise CheckpointError(
            f"{directory / extra[0]}: not listed in {manifest_path} (a file the checkpoint did not write)"
        )
    for rel, (size, sha) in sizes.items():
        if rel.startswith("/") or ".." in rel.split("/"):
            raise CheckpointError(f"{manifest_path}: lists {rel!r}, outside the step directory")
        path = directory / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing")
        if path.is_symlink() or path.stat().st_size != size or sha256_file(path) != sha:
            raise CheckpointError(f"{path}: sha256 does not match the manifest (corrupt checkpoint)")
    return manifest


def verify(url: str | Path) -> dict[str, Any]:
    """Verify a checkpoint at a local path or fsspec URL (remote ones are read to hash them)."""
    if is_local(str(url)):
        return verify_local(local_path(str(url)))
    with tempfile.TemporaryDirectory() as tmp:
        return verify_local(fetch(str(url), Path(tmp)))


def fetch(url: str, into: Path, count: Callable[[int], None] | None = None) -> Path:
    """Copy a remote step directory to local disk by its manifest (DeepSpeed and DCP read local
    files); `count` is told of each retry. CheckpointError when it has no manifest."""
    root, _, name = str(url).rstrip("/").rpartition("/")
    return ObjectStore(root, count).download(name, into)


def committed_steps(root: str, count: Callable[[int], None] | None = None) -> list[str]:
    """Names of the candidate step directories under `root` (path or fsspec URL), newest step
    first: each step's own directory, then its `.old-<n>` copies (newest first), which hold the
    committed step when a re-save was interrupted. `.tmp` (being written) and `.del` (being
    pruned) never count. A listed directory may still fail verification. `count` is told of each
    retry of a remote listing."""
    if not is_local(root):  # listed by manifest: without one a step is not committed (object_store.py)
        names = ObjectStore(root, count).committed()
    else:
        fs, path = url_to_fs(root)
        if not fs.exists(path):
            return []
        names = [Path(p.rstrip("/")).name for p in fs.ls(path, detail=False)]
    return sorted((n for n in names if _candidate(n)), key=_order, reverse=True)


def _candidate(name: str) -> bool:
    base, _, suffix = name.partition(".")
    digits = base.removeprefix("step_")
    if not (base.startswith("step_") and digits.isdigit()):
        return False
    return not suffix or (suffix.startswith("old-") and suffix[4:].isdigit())


def _order(name: str) -> tuple[int, int]:
    """Newest step first; within a step its own directory, then the newest `.old-<n>`."""
    base, _, suffix = name.partition(".")
    return int(base.removeprefix("step_")), int(suffix[4:]) if suffix else 1 << 30
