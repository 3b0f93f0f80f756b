"""Entry point: `deepspeed launch/pretrain.py --config configs/x.yaml [key=value ...]`.

Also runs under `torchrun ... engine.kind=fsdp`, as one `srun` task per GPU (ranks from SLURM's
variables; launch/slurm/) and as a plain `python launch/pretrain.py` in one process. Bad
configuration or data stops here, before any compute, with a message naming the key or file, and
so does a start the run directory cannot take (another run's config, changed data; pretrain/run/directory.py).
Exit codes: 0 done (or nothing left to do), 2 bad input, 3 preempted or interrupted (saved) or a rank
hung (requeue either), 4 diverged, 130 a second Ctrl-C (stopped at once, unsaved); the batch script exits 5
when a requeue would find no newer checkpoint once more (pretrain/resilience/requeue.py, docs/cluster.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Large CPU tensors on transparent huge pages (torch reads this at its first multi-MB allocation): a fresh
# buffer otherwise costs a page fault per 4 KB, which measured 2.4x slower for the phasor scan at 64k
# tokens (docs/kernels.md). Harmless on GPU runs, which allocate little host memory.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# Run as a script, this file would shadow the `pretrain` package (its directory comes first on
# sys.path); the repository root goes in front of it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pretrain.config import ConfigError, load_config
from pretrain.distributed.process_group import adopt_slurm_environment
from pretrain.resilience.requeue import EXIT_ABORTED, EXIT_BAD_INPUT
from pretrain.telemetry.log import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config (may `extends:` others)")
    parser.add_argument(
        "--resume", default=None, help="auto (newest valid checkpoint), none, or a checkpoint directory; "
        "default: checkpoint.resume from the config"
    )
    parser.add_argument(
        "--start-over", action="store_true",
        help="start afresh in a run directory that holds a previous run, after moving that run aside to "
        "<run dir>.old-<n> (nothing is deleted); implies --resume none",
    )
    parser.add_argument(
        "--preempted-marker", default=None, metavar="FILE",
        help="after a preemption save (exit code 3), rank 0 writes FILE; a rank's hang watchdog writes it "
        "before exiting 3: the batch script requeues on it",
    )
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 model.n_layers=4")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    adopt_slurm_environment()
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    log = setup_logging()
    if args.start_over and args.resume not in (None, "none"):
        log.error("--start-over starts afresh, so it cannot be combined with --resume %s", args.resume)
        return EXIT_BAD_INPUT
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        log.error("config error: %s", err)
        return EXIT_BAD_INPUT

    from data_pipeline.shards import ManifestError, ShardError
    from data_pipeline.storage import StorageError
    from pretrain.checkpoint.layout import CheckpointError
    from pretrain.run.directory import RunRefusedError
    from pretrain.trainer import DataError, RunLockedError, train

    resume = "none" if args.start_over else args.resume
    try:
        return train(cfg, resume=resume, preempted_marker=args.preempted_marker, start_over=args.start_over)
    except (DataError, ConfigError, RunLockedError, RunRefusedError, CheckpointError, ManifestError, ShardError,
            StorageError) as err:
        log.debug("stopped on bad input", exc_info=True)
        log.error("%s", " ".join(str(err).split()))
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        log.debug("aborted", exc_info=True)
        log.error("interrupted: stopped at once without saving (a second Ctrl-C, or one before training began); "
                  "the run resumes from its last checkpoint")
        return EXIT_ABORTED


if __name__ == "__main__":
    sys.exit(main())
