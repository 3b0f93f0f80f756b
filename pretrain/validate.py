"""Scoring a model while it trains and after: losses streamed piece by piece with the carried state,
held-out bits per token at each configured context, and accuracy on the synthetic tasks. The trainer's
periodic evaluation and pretrain.evaluate (on exports) score with the same functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from data_pipeline import synthetic
from data_pipeline.stream import PackedStream
from data_pipeline.tokenizer import Tokenizer, load_tokenizer
from model import IGNORE_INDEX, CausalLM
from pretrain.config import RunConfig
from pretrain.distributed.process_group import all_reduce_sum
from pretrain.protocols import Engine


def stream_logits(model: CausalLM, input_ids: torch.Tensor, chunk: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Run `input_ids` [B, T] through the model `chunk` tokens at a time, carrying the state;
    yields (start, logits) per chunk, so that a caller that drops the logits keeps memory flat."""
    state = model.init_state(input_ids.shape[0], input_ids.device)
    for start in range(0, input_ids.shape[1], chunk):
        logits, state = model(input_ids[:, start : start + chunk], state)
        yield start, logits


@torch.inference_mode()
def task_accuracy(
    model: CausalLM, examples: list[synthetic.Example], chunk: int, device: torch.device
) -> dict[str, float]:
    """Argmax accuracy on the answer tokens, each example streamed like the text windows."""
    predictions = []
    for example in examples:
        ids = torch.from_numpy(example.input_ids).to(device)[None]
        parts = [logits[0].argmax(-1).cpu() for _, logits in stream_logits(model, ids, chunk)]
        predictions.append(torch.cat(parts))
    return synthetic.accuracy(examples, predictions)


def run_tasks(
    model: CausalLM,
    tasks: Sequence[str],
    tok: Tokenizer,
    length: int,
    n: int,
    chunk: int,
    device: torch.device,
    haystack: bytes,
) -> dict[str, Any]:
    """Accuracy of each requested task on `n` examples of about `length` tokens."""
    results: dict[str, Any] = {}
    for task in tasks:
        gen = synthetic.make_task(
            task, length, vocab_size=tok.content_vocab, haystack=haystack, encode=lambda b: tok.encode(b)[0]
        )
        examples = [gen.example(i) for i in range(n)]
        results[task] = {"examples": n, "length": length, **task_accuracy(model, examples, chunk, device)}
    return results


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
    """The synthetic long-context tasks, streamed with the carried state, on rank 0. Needs whole
    weights on every rank (pretrain.preflight refuses eval.tasks with an engine that shards them)."""
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


def periodic_evaluation(
    cfg: RunConfig, engine: Engine, rank: int, world: int, device: torch.device
) -> dict[str, float]:
    """What the trainer logs every eval.every steps: held-out bits per token (every rank takes part)
    and, on rank 0, the synthetic tasks."""
    results = heldout_bits_per_token(cfg, engine, rank, world, device) if cfg.data.valid else {}
    if cfg.eval.tasks and rank == 0:
        results.update(evaluate_tasks(cfg, engine, device))
    return results
