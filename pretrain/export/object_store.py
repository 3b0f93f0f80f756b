"""Exports on an object store (s3://, any fsspec URL): `python -m pretrain.export --out s3://...` writes
the directory locally, then uploads it with `config.json` last, so that a prefix is an export exactly
when its config.json exists (what `init.from` looks for); readers download it to a local directory
first. Every call goes through data_pipeline.storage.retrying."""

from __future__ import annotations

from pathlib import Path

from fsspec.core import url_to_fs

from data_pipeline.storage import retrying
from pretrain.export.layout import CONFIG, ExportError


def publish(local: Path, url: str) -> None:
    """Upload the export directory `local` to the prefix `url`, config.json last."""
    fs, root = url_to_fs(url.rstrip("/"))
    files = sorted(p for p in local.rglob("*") if p.is_file() and p.relative_to(local).as_posix() != CONFIG)
    for path in [*files, local / CONFIG]:
        rel = path.relative_to(local).as_posix()
        retrying(f"{url}/{rel}", lambda path=path, rel=rel: fs.put_file(str(path), f"{root}/{rel}"), what="upload")


def is_export(url: str) -> bool:
    """Whether the prefix `url` holds an export (its config.json exists)."""
    fs, root = url_to_fs(url.rstrip("/"))
    return bool(retrying(url, lambda: fs.exists(f"{root}/{CONFIG}"), what="look up"))


def download(url: str, into: Path) -> Path:
    """Copy the export at the prefix `url` into the directory `into`; ExportError when it is none."""
    fs, root = url_to_fs(url.rstrip("/"))
    if not is_export(url):
        raise ExportError(f"{url}: no {CONFIG}; not an export (python -m pretrain.export --out {url})")
    for key in retrying(url, lambda: fs.find(root), what="list"):
        rel = key[len(root) + 1 :]
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        retrying(f"{url}/{rel}", lambda key=key, target=target: fs.get_file(key, str(target)), what="download")
    return into
