"""The training loop: data -> engine step -> metrics, evaluation and checkpoints.

Read top to bottom, `train()` is the whole story; everything engine-specific is behind
pretrain/engines.py and everything on disk behind pretrain/checkpoint/.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline.shards import ManifestError, load_manifest
from data_pipeline.stream import PackedStream, StreamLoader
from data_pipeline.synthetic import TaskBatches, make_task
from data_pipeline.tokenizer import TokenizerMismatchError, check_tokenizer
from model import IGNORE_INDEX, CausalLM, build_model
from pretrain import carry
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.config import ConfigError, RunConfig, TrainSection, config_text, config_to_dict, dump_config
from pretrain.distributed.parallel_dims import ParallelDims, dims_for, local_slice
from pretrain.distributed.process_group import all_reduce_mean, all_reduce_sum, barrier
from pretrain.engines import build_engine, device_for_rank, grad_accumulation_steps, init_distributed
from pretrain.init_from import load_initial_weights
from pretrain.log import get_logger
from pretrain.metrics import MetricsLogger, measure_peak_flops, memory_stats
from pretrain.optim import lr_at
from pretrain.protocols import Engine

EXIT_PREEMPTED = 3  # saved and stopped on SIGTERM/SIGUSR1 or the wall-clock limit: requeue me
EXIT_DIVERGED = 4  # non-finite loss under nan_policy=stop (or too many skipped steps)


class DataError(ValueError):
    """Training data that cannot be used with this config; raised before any compute."""


@dataclass
class TrainerState:
    """What the loop itself must remember across a restart (saved as JSON in checkpoints)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0


class StopFlag:
    """Set by SIGTERM / SIGUSR1; checked (and agreed on by all ranks) at step boundaries."""

    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal = signum


def check_data(cfg: RunConfig) -> None:
    """Fail fast, naming the path, when shards are missing or were built for another vocabulary."""
    if cfg.data.task is not None:
        make_task_data(cfg, 0, 1)
    elif not cfg.data.train:
        raise DataError("data.train: no training sources configured (or data.task for a synthetic task)")
    for i, source in enumerate(cfg.data.train):
        try:
            manifest = load_manifest(source.path)
        except (ManifestError, FileNotFoundError, OSError) as err:
            raise DataError(f"data.train[{i}].path: {err}") from err
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
    sharded_weights = cfg.engine.kind == "fsdp" or (cfg.engine.kind == "deepspeed" and cfg.engine.zero_stage == 3)
    if cfg.eval.tasks and sharded_weights:
        raise DataError(
            "eval.tasks: the periodic task evaluation runs on rank 0 and needs whole weights there; "
            "with FSDP or ZeRO-3 evaluate an export instead (python -m pretrain.evaluate --tasks ...)"
        )
    if cfg.eval.haystack and not Path(cfg.eval.haystack).is_file():
        raise DataError(f"eval.haystack: {cfg.eval.haystack}: no such file")
    for i, path in enumerate(cfg.data.valid):
        try:
            load_manifest(path)
        except (ManifestError, FileNotFoundError, OSError) as err:
            raise DataError(f"data.valid[{i}]: {err}") from err


def check_start(cfg: RunConfig, world: int) -> tuple[ParallelDims, int]:
    """The start-up rules that depend only on the config and the world size (no data, no devices):
    the (data x sequence)-parallel mesh and the micro-batches per data-parallel rank per step, or a
    ConfigError naming the key. `train` and `python -m pretrain.plan` both run this function."""
    carry.check_config(cfg)
    if cfg.engine.kind == "single" and world > 1:
        raise ConfigError(f"engine.kind=single runs one process, but the world size is {world}; use deepspeed or fsdp")
    dims = dims_for(cfg, world)
    return dims, grad_accumulation_steps(cfg, dims.data_parallel)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_task_data(cfg: RunConfig, rank: int, world: int) -> TaskBatches:
    """Batches of the configured synthetic task (token ids must fit the model's vocabulary)."""
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
    return TaskBatches(generator, cfg.data.seq_len, cfg.train.micro_batch, rank, world)


def make_loader(cfg: RunConfig, rank: int, world: int) -> StreamLoader | TaskBatches:
    if cfg.data.task is not None:
        return make_task_data(cfg, rank, world)
    stream = PackedStream(
        [(s.path, s.weight) for s in cfg.data.train],
        seq_len=cfg.data.seq_len,
        seed=cfg.run.seed,
        rank=rank,
        world_size=world,
        shuffle_buffer=cfg.data.shuffle_buffer,
        doc_boundaries=cfg.data.doc_boundaries,
        batch_size=cfg.train.micro_batch,
        expected_tokenizer=cfg.data.tokenizer,
    )
    # pinned batches copy to the GPU without making the host wait (the loop's non_blocking copies)
    return StreamLoader(stream, num_workers=cfg.data.num_workers, pin_memory=torch.cuda.is_available())


def eval_piece_tokens(cfg: RunConfig, model: CausalLM, context: int) -> int:
    """Tokens per forward call of the periodic evaluation at `context`: a rank's training piece
    (seq_len / sequence_parallel) for models whose carried state makes piecewise exact, so that the
    evaluation's memory does not grow with the context; the whole context otherwise."""
    if not model.streams_exactly:
        return context
    return min(context, cfg.data.seq_len // cfg.engine.sequence_parallel)


def streamed_loss(
    eval_loss: Callable[..., tuple[torch.Tensor, Any]],
    model: CausalLM, inputs: torch.Tensor, labels: torch.Tensor, piece: int, doc_start: torch.Tensor | None = None,
) -> tuple[float, int]:
    """(summed loss, scored tokens) of [1, T] inputs fed `piece` tokens at a time through `eval_loss`
    (an engine's), the state carried from piece to piece: memory stays that of one piece. With
    ``doc_start`` (data.doc_boundaries) the model resets at each document start, as in training."""
    state = model.init_state(inputs.shape[0], inputs.device)
    total, count = 0.0, 0
    for start in range(0, inputs.shape[1], piece):
        piece_labels = labels[:, start : start + piece]
        piece_starts = None if doc_start is None else doc_start[:, start : start + piece]
        loss, state = eval_loss(inputs[:, start : start + piece], piece_labels, state, piece_starts)
        scored = int((piece_labels != IGNORE_INDEX).sum())
        total += float(loss) * scored
        count += scored
    return total, count


def heldout_bits_per_token(
    cfg: RunConfig, engine: Engine, rank: int, world: int, device: torch.device
) -> dict[str, float]:
    """Held-out loss at each configured context length, as bits per token (= per byte for byte
    models); every rank evaluates its share of the sequences, streaming each in pieces with the
    carried state (`eval_piece_tokens`), and the sums are reduced. Under data.doc_boundaries the
    model resets at the documents' starts, as it does in training."""
    results: dict[str, float] = {}
    model = engine.model
    for context in cfg.eval.contexts:
        piece = eval_piece_tokens(cfg, model, context)
        n_seq = max(world, cfg.eval.max_tokens // context)
        total, count = 0.0, 0
        for path in cfg.data.valid:
            stream = PackedStream(
                [(path, 1.0)], seq_len=context, seed=0, rank=rank, world_size=world, shuffle=False,
                max_samples=n_seq - n_seq % world, batch_size=1, expected_tokenizer=cfg.data.tokenizer,
                doc_boundaries=cfg.data.doc_boundaries,
            )
            for sample in stream:
                inputs, labels = sample["input_ids"][None].to(device), sample["labels"][None].to(device)
                doc_start = sample["doc_start"][None].to(device) if "doc_start" in sample else None
                summed, scored = streamed_loss(engine.eval_loss, model, inputs, labels, piece, doc_start)
                total += summed
                count += scored
        total, count = all_reduce_sum([total, count])
        results[f"eval/bits_per_token@{context}"] = total / max(count, 1) / math.log(2)
    return results


def evaluate_tasks(cfg: RunConfig, engine: Engine, device: torch.device) -> dict[str, float]:
    """Synthetic long-context tasks (pretrain.evaluate's, streamed with the carried state) on rank
    0. Needs whole weights on every rank: single process or DeepSpeed ZeRO stage <= 2."""
    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.evaluate.text import run_tasks

    haystack = Path(cfg.eval.haystack).read_bytes() if cfg.eval.haystack else b""
    model = engine.model
    model.eval()
    results = run_tasks(
        model, cfg.eval.tasks, load_tokenizer(cfg.data.tokenizer), cfg.eval.task_len, cfg.eval.task_examples,
        chunk=cfg.data.seq_len // cfg.engine.sequence_parallel, device=device, haystack=haystack,
    )
    model.train()
    scores = {}
    for task, result in results.items():
        scores[f"eval/{task}_exact"] = float(result["exact"])
        scores[f"eval/{task}_token_accuracy"] = float(result["token"])
    return scores


def model_statistics(model: CausalLM) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Split the model's own statistics into scalars and histograms (1-D tensors)."""
    scalars, hists = {}, {}
    for key, value in model.stats().items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            hists[f"model/{key}"] = value.detach().cpu()
        else:
            scalars[f"model/{key}"] = float(value)
    return scalars, hists


def _batches(loader: StreamLoader | TaskBatches) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


def account_skips(state: TrainerState, pending: list[tuple[int, torch.Tensor]], train: TrainSection) -> int | None:
    """Count the skipped updates among `pending` ((step, applied flag) pairs, emptied), reading all
    their flags in one transfer; returns the first step at which the run diverged (a skip under
    nan_policy "stop", or more than max_skipped_steps skips in a row), or None."""
    if not pending:
        return None
    flags = torch.stack([applied for _, applied in pending]).tolist()
    steps = [step for step, _ in pending]
    pending.clear()
    diverged = None
    for step, applied in zip(steps, flags, strict=True):
        if applied:
            state.consecutive_skips = 0
            continue
        state.skipped_steps += 1
        state.consecutive_skips += 1
        get_logger().warning("step %d: non-finite loss or gradient; update skipped", step)
        too_many = train.nan_policy == "stop" or state.consecutive_skips > train.max_skipped_steps
        if too_many and diverged is None:
            diverged = step
    return diverged


def _any_rank(flag: bool) -> bool:
    return all_reduce_sum([1.0 if flag else 0.0])[0] > 0


def train(cfg: RunConfig, resume: str | None = None, preempted_marker: str | None = None) -> int:
    """Run (or continue) the configured training; returns the process exit code. After a
    preemption save has committed, rank 0 writes `preempted_marker` (when given): the file a
    batch script checks to requeue the job."""
    log = get_logger()
    started = time.time()
    check_data(cfg)
    rank, world = init_distributed(cfg)
    dims, gas = check_start(cfg, world)
    run_dir = Path(cfg.run.dir)
    checkpointer = Checkpointer(
        cfg.checkpoint.dir or str(run_dir / "checkpoints"), run_dir / ".checkpoint_staging",
        cfg.checkpoint.keep_last, cfg.checkpoint.milestone_every, cfg.checkpoint.async_save,
    )
    config_yaml = config_text(cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")

    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    device = device_for_rank()
    model = build_model(cfg.model).to(device)
    if cfg.init.from_ is not None:  # weights only; a resumed checkpoint below replaces them
        load_initial_weights(model, cfg.init.from_)
    n_params = model.num_parameters()  # before sharding engines partition the weights
    flops_per_token = model.flops_per_token(cfg.data.seq_len)
    seed_everything(cfg.run.seed + 1000 * rank)  # per-rank streams from here on
    sequence_parallel = dims.build(rank, cfg.data.seq_len)
    # under train.carry_state, each batch row continues its text and the model's state with it
    carrier = carry.make_carrier(cfg, model, rank, world, device) if cfg.train.carry_state else None
    # a sequence group reads the same samples: the loader runs at the data-parallel rank and size
    loader = carrier if carrier is not None else make_loader(cfg, dims.dp_rank(rank), dims.data_parallel)
    engine = build_engine(cfg, model, world, sequence_parallel)

    state = TrainerState()
    resume = resume if resume is not None else cfg.checkpoint.resume
    restored = checkpointer.resume(resume, engine)
    if restored is not None:
        state = TrainerState(**restored["trainer"])
        loader.load_state_dict(restored["data"])
        if carrier is not None:
            carrier.load(Path(restored["path"]))
        log.info("resumed from %s at step %d", restored["path"], state.step)

    metrics = MetricsLogger(run_dir, config_to_dict(cfg), rank == 0, cfg.log.wandb, cfg.log.wandb_project)
    peak = (cfg.log.peak_tflops * 1e12) if cfg.log.peak_tflops else all_reduce_mean([measure_peak_flops()])[0]
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    metrics.console(
        f"model {cfg.model.kind}: {n_params / 1e6:.2f}M parameters, "
        f"{flops_per_token / 1e6:.1f} MFLOP/token; engine {cfg.engine.kind} on {world} rank(s) "
        f"(data-parallel {dims.data_parallel} x sequence-parallel {dims.sequence_parallel}), "
        f"{gas} micro-batch(es) of {cfg.train.micro_batch} per data-parallel rank per step"
    )
    stop = StopFlag()
    batches = _batches(loader) if carrier is None else None

    # (step, applied) of the steps whose skip flags the host has not read yet: the loop reads them at
    # log steps and before a save (every step under nan_policy "stop", which must stop at the first)
    pending: list[tuple[int, torch.Tensor]] = []

    def save() -> None:
        account_skips(state, pending, cfg.train)
        trainer_state = {"trainer": vars(state), "data": loader.state_dict()}
        checkpointer.save(state.step, engine, trainer_state, config_yaml, carrier.save if carrier else None)
        metrics.console(f"checkpoint of step {state.step} written (async={cfg.checkpoint.async_save})")

    exit_code = 0
    window_start, window_tokens = time.time(), 0
    while state.step < cfg.train.steps:
        lr = lr_at(state.step, cfg.train)
        if carrier is not None:
            micro_batches = carrier.next_step()
        else:
            micro_batches = []
            for _ in range(gas):
                batch = next(batches)
                keys = ("input_ids", "labels", "doc_start") if "doc_start" in batch else ("input_ids", "labels")
                pieces = [local_slice(batch[key], sequence_parallel).to(device, non_blocking=True) for key in keys]
                if len(pieces) == 3:  # data.doc_boundaries: this rank's slice of the document starts
                    pieces.insert(2, None)  # no carried state
                micro_batches.append(tuple(pieces))
        info = engine.train_step(micro_batches, lr)
        if carrier is not None:
            carrier.update(info.states)
        checkpointer.poll()
        state.step += 1
        state.tokens_seen += tokens_per_step
        window_tokens += tokens_per_step
        pending.append((state.step, info.applied))
        log_step = state.step % cfg.train.log_every == 0 or state.step == cfg.train.steps
        checkpoint_step = cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0
        # the host waits for the device only here: at log and checkpoint steps (and every step under
        # nan_policy "stop"); every rank reads the same flags, so every rank agrees to stop
        if log_step or checkpoint_step or cfg.train.nan_policy == "stop":
            diverged_at = account_skips(state, pending, cfg.train)
            if diverged_at is not None:
                log.warning("diverged at step %d (train.nan_policy=%s, train.max_skipped_steps=%d)",
                            diverged_at, cfg.train.nan_policy, cfg.train.max_skipped_steps)
                save()
                exit_code = EXIT_DIVERGED
                break

        if log_step:
            # the global mean loss costs a collective: only on steps that report it
            loss_value = all_reduce_mean([float(info.loss)])[0]
            elapsed = time.time() - window_start
            tokens_per_s = window_tokens / max(elapsed, 1e-9)
            scalars = {
                "train/loss": loss_value,
                "train/bits_per_token": loss_value / math.log(2),
                "train/lr": lr,
                "train/grad_norm": float(info.grad_norm),
                "train/tokens_seen": state.tokens_seen,
                "train/skipped_steps": state.skipped_steps,
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": flops_per_token * tokens_per_s / (peak * world),
                **memory_stats(),
                **{f"data/{k}": v for k, v in loader.stats().items()},
            }
            model_scalars, model_hists = model_statistics(model)
            metrics.log(state.step, {**scalars, **model_scalars}, model_hists)
            metrics.console(
                f"step {state.step}/{cfg.train.steps} loss {loss_value:.4f} lr {lr:.2e} "
                f"grad {scalars['train/grad_norm']:.3f} {tokens_per_s:,.0f} tok/s mfu {scalars['perf/mfu']:.1%}"
            )
            window_start, window_tokens = time.time(), 0

        if cfg.eval.every and state.step % cfg.eval.every == 0:
            results = heldout_bits_per_token(cfg, engine, rank, world, device) if cfg.data.valid else {}
            if cfg.eval.tasks and rank == 0:
                results.update(evaluate_tasks(cfg, engine, device))
            metrics.log(state.step, results)
            metrics.console("eval " + " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in results.items()))

        out_of_time = cfg.train.max_runtime is not None and _projected_past(started, state.step, cfg)
        if _any_rank(stop.signal is not None or out_of_time):
            save()
            metrics.console(f"stopping at step {state.step}: {'signal' if stop.signal else 'max_runtime'}")
            exit_code = EXIT_PREEMPTED
            break
        if checkpoint_step and state.step < cfg.train.steps:
            save()

    if exit_code == 0:
        save()
    checkpointer.wait()
    if exit_code == EXIT_PREEMPTED and preempted_marker and rank == 0:
        write_preempted_marker(Path(preempted_marker), state.step, checkpointer.last_committed, stop.signal)
    metrics.close()
    # No rank leaves before rank 0 has committed: a launcher that kills the job when its first
    # rank exits (srun --kill-on-bad-exit) would otherwise interrupt the commit.
    barrier()
    return exit_code


def write_preempted_marker(path: Path, step: int, checkpoint: str | None, signum: int | None) -> None:
    """Atomically write the JSON note that asks the batch script to requeue this job."""
    path.parent.mkdir(parents=True, exist_ok=True)
    reason = signal.Signals(signum).name if signum else "max_runtime"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": step, "checkpoint": checkpoint, "reason": reason}) + "\n")
    os.replace(tmp, path)


def _projected_past(started: float, steps_done: int, cfg: RunConfig) -> bool:
    """True when one more step (at the mean pace so far) plus a save would pass max_runtime."""
    elapsed = time.time() - started
    per_step = elapsed / max(steps_done, 1)
    return elapsed + 2 * per_step > cfg.train.max_runtime
