"""Command line: python -m pretrain.export --checkpoint <dir> --out <dir>."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pretrain.checkpoint.consolidate import resolve_checkpoint
from pretrain.export.directory import export
from pretrain.export.layout import ExportError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.export", description="Export a checkpoint as a self-contained model directory."
    )
    parser.add_argument("--checkpoint", required=True, help="step directory, checkpoints directory or run directory")
    parser.add_argument("--out", required=True, help="export directory (created)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0

