"""Command line: python -m pretrain.export --checkpoint <dir> --out <dir>. A checkpoint that cannot be
used exits 2 with one line naming the file and what was wrong."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from data_pipeline import storage
from data_pipeline.storage import StorageError, is_remote
from model.config_loader import ConfigError
from pretrain.checkpoint.layout import CheckpointError
from pretrain.export.directory import export
from pretrain.export.layout import ExportError
from pretrain.export.object_store import publish
from pretrain.telemetry.log import get_logger


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.export", description="Export a checkpoint as a self-contained model directory."
    )
    parser.add_argument("--checkpoint", required=True, help="step directory, checkpoints directory or run directory")
    parser.add_argument("--out", required=True, help="export directory (created), or an object-store URL (uploaded)")
    parser.add_argument("--allow-network", action="store_true",
                        help="read remote paths the checkpoint's config names (tokenizer, data manifests)")
    storage.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        storage.configure_from_args(args)  # as a run sets its `storage` section: one attempt per call, ours retried
        if is_remote(args.out):
            with tempfile.TemporaryDirectory(prefix="export-") as tmp:
                publish(export(args.checkpoint, Path(tmp) / "export", args.allow_network), args.out)
            out = args.out
        else:
            out = export(args.checkpoint, args.out, args.allow_network)
    except (ExportError, CheckpointError, StorageError, ConfigError) as err:
        get_logger().debug("export failed", exc_info=True)
        print(f"error: {one_line(str(err))}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def one_line(message: str, limit: int = 600) -> str:
    """`message` on one line (a nested error may span several), cut at `limit` characters."""
    flat = " ".join(message.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."

