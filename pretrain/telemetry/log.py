"""Logging shared by every entry point: rank-aware, so only rank 0 prints progress."""

from __future__ import annotations

import logging
import sys

from pretrain.distributed.process_group import rank as current_rank


def setup_logging(level: str | int = "INFO", all_ranks: bool = False) -> logging.Logger:
    """Configure the project's root logger once.

    Rank 0 logs at `level`; other ranks log warnings and errors only (prefixed with their rank),
    unless `all_ranks` asks every rank to log fully, e.g. when debugging a hang.
    """
    rank = current_rank()
    logger = logging.getLogger("recurrent")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr if rank else sys.stdout)
    prefix = f"[rank {rank}] " if rank else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    """The project's logger (configure it with setup_logging at the entry point)."""
    return logging.getLogger("recurrent")
