"""Every start-up refusal in one place: what the run config, its data and the world size must satisfy
before any weights are built. The trainer runs these at the start and `python -m pretrain.plan` runs
`check_start`, so a config that plans also starts. (What a config says about itself alone, such as
a family that cannot split its sequences, is refused earlier, when pretrain.config loads it.)
"""

from __future__ import annotations

from pathlib import Path

from data_pipeline.shards import MANIFEST_NAME, Manifest, ManifestError, load_manifest
from data_pipeline.synthetic import Task, make_task
from data_pipeline.tokenizer import TokenizerMismatchError, check_tokenizer
from model import family
from pretrain.config import ConfigError, RunConfig
from pretrain.distributed.parallel_dims import ParallelDims, dims_for
from pretrain.engines import engine_class


class DataError(ValueError):
    """Training data that cannot be used with this config; raised before any compute."""


def task_generator(cfg: RunConfig) -> Task:
    """The configured synthetic task's generator, checked against the model's vocabulary and data.seq_len."""
    task = cfg.data.task
    assert task is not None
    params = dict(task.params)
    vocab = int(params.pop("vocab_size", min(cfg.model.vocab_size, 256)))
    if vocab > cfg.model.vocab_size:
        raise DataError(f"data.task.params.vocab_size: {vocab} exceeds model.vocab_size={cfg.model.vocab_size}")
    try:
        generator = make_task(task.name, cfg.data.seq_len, vocab_size=vocab, seed=task.seed, **params)
    except ValueError as err:
        raise DataError(f"data.task: {err}") from err
    if generator.max_len > cfg.data.seq_len:
        raise DataError(
            f"data.task: {task.name} examples reach {generator.max_len} tokens, "
            f"more than data.seq_len={cfg.data.seq_len}"
        )
    return generator


def _manifest(key: str, path: str, tokenizer: str) -> Manifest:
    """The manifest of the shard set `path` (config key `key`); a missing one is refused with the
    command that builds it."""
    try:
        return load_manifest(path)
    except (ManifestError, FileNotFoundError, OSError) as err:
        if isinstance(err, FileNotFoundError) or isinstance(err.__cause__, FileNotFoundError):
            raise DataError(
                f"{key}: no shards at {path!r} (no {MANIFEST_NAME} there); build them with `python -m "
                f"data_pipeline.build --input <your text files> --output {path} --tokenizer {tokenizer}`"
            ) from err
        raise DataError(f"{key}: {err}") from err


def _check_shards(cfg: RunConfig) -> None:
    """Every training source: its manifest, its tokenizer and its vocabulary size."""
    for i, source in enumerate(cfg.data.train):
        manifest = _manifest(f"data.train[{i}].path", source.path, cfg.data.tokenizer)
        try:
            check_tokenizer(manifest.tokenizer, cfg.data.tokenizer, where=f"shards of {source.path!r}")
        except TokenizerMismatchError as err:
            raise DataError(f"data.train[{i}]: {err} (data.tokenizer={cfg.data.tokenizer!r})") from err
        except OSError as err:
            raise DataError(f"data.tokenizer: {err}") from err
        vocab = int(manifest.tokenizer["vocab_size"])
        if vocab != cfg.model.vocab_size:
            raise DataError(
                f"model.vocab_size={cfg.model.vocab_size} does not match the shards at {source.path!r}, "
                f"built with a tokenizer of vocab_size={vocab}"
            )


def check_data(cfg: RunConfig) -> None:
    """Fail fast, naming the path, when shards are missing or were built for another vocabulary."""
    if cfg.data.task is not None:
        task_generator(cfg)
    elif not cfg.data.train:
        raise DataError("data.train: no training sources configured (or data.task for a synthetic task)")
    _check_shards(cfg)
    if cfg.eval.tasks and engine_class(cfg).sharding_stage(cfg) >= 3:
        raise DataError(
            "eval.tasks: the periodic task evaluation runs on rank 0 and needs whole weights there; "
            "with FSDP or ZeRO-3 evaluate an export instead (python -m pretrain.evaluate --tasks ...)"
        )
    if cfg.eval.haystack and not Path(cfg.eval.haystack).is_file():
        raise DataError(f"eval.haystack: {cfg.eval.haystack}: no such file")
    for i, path in enumerate(cfg.data.valid):
        _manifest(f"data.valid[{i}]", path, cfg.data.tokenizer)


def check_carry(cfg: RunConfig) -> None:
    """The settings train.carry_state cannot work with."""
    if not cfg.train.carry_state:
        return
    if len(cfg.data.train) != 1:
        raise ConfigError(
            f"train.carry_state: needs exactly one data.train source (each lane follows one text stream), "
            f"got {len(cfg.data.train)}; build the mixture into one shard set"
        )
    if not family(cfg.model.kind).carries_memory:
        raise ConfigError(f"train.carry_state: model.kind={cfg.model.kind} carries no memory across calls, "
                          "only its position")
    if cfg.data.num_workers:
        raise ConfigError(f"data.num_workers={cfg.data.num_workers}: train.carry_state reads its lanes in the "
                          "training process; set data.num_workers=0")


def grad_accumulation_steps(cfg: RunConfig, world: int) -> int:
    """Micro-batches per data-parallel rank per step (`world` = data-parallel ranks, the world size
    over engine.sequence_parallel); the global batch must split evenly over them."""
    per_rank, remainder = divmod(cfg.train.global_batch, world)
    if remainder or per_rank % cfg.train.micro_batch:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} cannot be split over {world} data-parallel ranks in "
            f"micro-batches of train.micro_batch={cfg.train.micro_batch}: global_batch must be a "
            f"multiple of data_parallel_size * micro_batch = {world * cfg.train.micro_batch}"
        )
    return per_rank // cfg.train.micro_batch


def check_start(cfg: RunConfig, world: int) -> tuple[ParallelDims, int]:
    """The start-up rules that depend only on the config and the world size (no data, no devices):
    the (data x sequence)-parallel mesh and the micro-batches per data-parallel rank per step, or a
    ConfigError naming the key."""
    check_carry(cfg)
    if engine_class(cfg).one_process and (world > 1 or cfg.engine.sequence_parallel > 1):
        raise ConfigError(
            f"engine.kind={cfg.engine.kind} runs one process, but the world size is {world} and "
            f"engine.sequence_parallel={cfg.engine.sequence_parallel}; use deepspeed or fsdp"
        )
    dims = dims_for(cfg, world)
    return dims, grad_accumulation_steps(cfg, dims.data_parallel)
