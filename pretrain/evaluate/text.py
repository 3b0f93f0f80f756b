"""Streaming evaluation of an exported model on raw text, at context lengths up to 512k and beyond.

    python -m pretrain.evaluate --model <export dir> --data <text files> --context 4096,65536,524288 \
        [--chunk 2048] [--max-tokens 65536] [--soe-horizon N] [--temper N] [--json out.json] [--plot out.png] \
        [--tasks copy,needle,zipf] [--doc-boundaries]

A window is fed in chunks with the model's state passed along, so memory stays flat however long
the context. docs/export_eval.md, "Evaluation", says what is scored and reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import resource
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

from data_pipeline import synthetic
from data_pipeline.stream import document_starts
from data_pipeline.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer
from model import CausalLM
from pretrain.export import SENTENCEPIECE_FILE, TOKENIZER_JSON, ExportError, load_exported, read_export_config
from pretrain.telemetry.progress import Pace, announce
from pretrain.validate import run_tasks


class EvalError(RuntimeError):
    """Input that cannot be evaluated; the message names the path or option."""


class ContextWarning(UserWarning):
    """A context longer than the model was trained or certified for: its numbers are extrapolation."""


def context_warnings(model: CausalLM, context: int, chunk: int) -> list[str]:
    """Why results at `context` tokens may not mean what they seem (empty when nothing is exceeded)."""
    cfg = model.config
    found = []
    horizon = model.certified_horizon
    if horizon is not None and context > horizon:
        found.append(
            f"context {context} exceeds the memory kernel's certified horizon (soe_horizon={horizon}): lags "
            "beyond it have no error bound"
        )
    if context > cfg.max_seq_len:
        found.append(f"context {context} exceeds model.max_seq_len={cfg.max_seq_len}, the length it was built for")
    if not model.streams_exactly and context > chunk:
        found.append(f"context {context} exceeds --chunk {chunk}: a {cfg.kind} model sees at most one chunk of it")
    return found


# ----------------------------------------------------------------------------- inputs


def load_export_tokenizer(export_dir: Path) -> Tokenizer:
    """The tokenizer described by the export's recurrent_tokenizer.json (sentencepiece: its checksum is checked)."""
    path = export_dir / TOKENIZER_JSON
    if not path.is_file():
        raise EvalError(f"{path}: missing; re-export the checkpoint with python -m pretrain.export")
    info = json.loads(path.read_text())
    if info.get("kind") == "bytes":
        return byte_tokenizer()
    model_file = export_dir / info.get("file", SENTENCEPIECE_FILE)
    if not model_file.is_file():
        raise EvalError(f"{model_file}: missing (named by {path})")
    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()
    if digest != info.get("sha256"):
        raise EvalError(f"{model_file}: sha256 {digest[:12]} differs from the {str(info.get('sha256'))[:12]} in {path}")
    try:
        tok = load_tokenizer(str(model_file))
    except (OSError, ValueError, RuntimeError) as err:
        raise EvalError(f"{model_file}: {err}") from err
    return tok


@dataclass
class Text:
    """The evaluation text as token ids (documents separated by EOS) and its size in characters."""

    ids: np.ndarray
    n_bytes: int
    n_chars: int


def read_text(paths: Sequence[str], tok: Tokenizer) -> Text:
    """Tokenise each file as one document, followed by EOS."""
    pieces, n_bytes, n_chars = [], 0, 0
    for path in paths:
        try:
            with fsspec.open(path, "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError, OSError) as err:
            raise EvalError(f"{path}: cannot read the text file: {err}") from err
        if not data:
            raise EvalError(f"{path}: the text file is empty")
        ids, _ = tok.encode(data)
        pieces += [ids.astype(np.int64), np.array([tok.eos_id], dtype=np.int64)]
        n_bytes += len(data)
        n_chars += len(data.decode("utf-8", errors="replace"))
    return Text(np.concatenate(pieces), n_bytes, n_chars)


def position_buckets(context: int, per_octave: int = 4) -> np.ndarray:
    """Bucket edges over positions [0, context): 0, 1, then log-spaced (`per_octave` per doubling)."""
    edges = np.unique(np.round(np.logspace(0, math.log2(context), int(math.log2(context) * per_octave) + 1, base=2)))
    return np.unique(np.concatenate([[0], edges.astype(np.int64), [context]]))


# ----------------------------------------------------------------------------- streaming


@torch.inference_mode()
def evaluate_context(
    model: CausalLM, text: Text, context: int, chunk: int, max_windows: int | None, device: torch.device,
    doc_start: np.ndarray | None = None,
) -> dict[str, Any]:
    """Streaming next-token loss over consecutive windows of `context` tokens; with ``doc_start`` (bool
    over the text's tokens, `document_starts`) the model resets at each document start inside a window."""
    n_windows = (text.ids.size - 1) // context
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    if n_windows == 0:
        return {"skipped": f"the text has {text.ids.size} tokens; a window needs context + 1 = {context + 1}"}
    edges = position_buckets(context)
    bucket_of = torch.from_numpy(np.searchsorted(edges, np.arange(context), side="right") - 1)
    sums = torch.zeros(len(edges) - 1, dtype=torch.float64)
    counts = torch.zeros(len(edges) - 1, dtype=torch.float64)
    started = time.perf_counter()
    for w in range(n_windows):
        window = torch.from_numpy(text.ids[w * context : (w + 1) * context + 1]).to(device)
        inputs, targets = window[None, :-1], window[1:]
        starts = None if doc_start is None else torch.from_numpy(doc_start[w * context : (w + 1) * context])[None]
        state = model.init_state(1, device)
        for start in range(0, context, chunk):
            piece = slice(start, start + chunk)
            losses, state = model.token_losses(inputs[:, piece], targets[None, piece], state,
                                               None if starts is None else starts[:, piece].to(device))
            nll = losses[0].double().cpu()
            n = nll.shape[0]
            buckets = bucket_of[start : start + n]
            sums.index_add_(0, buckets, nll)
            counts.index_add_(0, buckets, torch.ones_like(nll))
    seconds = time.perf_counter() - started
    tokens = n_windows * context
    bits = float(sums.sum()) / math.log(2)
    result: dict[str, Any] = {
        "windows": n_windows,
        "tokens": tokens,
        "bits_per_token": bits / tokens,
        "buckets": [
            {"start": int(lo), "end": int(hi), "bits_per_token": float(total / n) / math.log(2)}
            for lo, hi, total, n in zip(edges[:-1], edges[1:], sums, counts)
            if n > 0
        ],
        "seconds": seconds,
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "peak_rss_mb": peak_rss_mb(),
    }
    return result


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_text_units(result: dict[str, Any], text: Text, tok: Tokenizer) -> None:
    """Bits per byte (byte-level: a token is a byte) or per character (tokenized, whole-text ratio)."""
    if "skipped" in result:
        return
    if tok.kind == "bytes":
        result["bits_per_byte"] = result["bits_per_token"]
    else:
        chars_per_token = text.n_chars / text.ids.size
        result["bits_per_character"] = result["bits_per_token"] / chars_per_token


# ----------------------------------------------------------------------------- plot and CLI


def plot(results: dict[str, Any], path: str, title: str) -> None:
    """Bits per token against position in the context (log x), one line per context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for context, result in results.items():
        if "buckets" not in result:
            continue
        mids = [max(1.0, (b["start"] + b["end"] - 1) / 2) for b in result["buckets"]]
        ax.plot(mids, [b["bits_per_token"] for b in result["buckets"]], marker=".", label=f"context {context}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the context (tokens)")
    ax.set_ylabel("bits per token")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_options(
    model_dir: Path, contexts: Sequence[int], chunk: int, tasks: Sequence[str], task_len: int, max_tokens: int | None
) -> None:
    """Refuse, before anything is loaded, the options `evaluate` cannot run with (EvalError names the option)."""
    if not model_dir.is_dir():
        raise EvalError(f"{model_dir}: no such export directory")
    if max_tokens is not None and max_tokens < 1:
        raise EvalError(f"--max-tokens must be positive, got {max_tokens}")
    if chunk < 1 or not contexts or min(contexts) < 1:
        raise EvalError(f"--chunk and --context must be positive (chunk={chunk}, contexts={list(contexts)})")
    unknown = sorted(set(tasks) - set(synthetic.TASKS))
    if unknown:
        raise EvalError(f"--tasks: unknown {unknown}; known: {', '.join(sorted(synthetic.TASKS))}")
    if tasks and task_len < synthetic.MIN_TASK_LEN:
        raise EvalError(
            f"--task-len: {task_len} is too short for the synthetic tasks (at least {synthetic.MIN_TASK_LEN})"
        )


def load_for_eval(
    model_dir: Path, device: str, soe_horizon: int | None, temper: int | None
) -> tuple[dict[str, Any], CausalLM]:
    """The export's config.json and its model, with the memory kernel rebuilt when `soe_horizon` or
    `temper` asks for one other than the trained model's."""
    try:
        config = read_export_config(model_dir)
        model = load_exported(model_dir, device)
    except ExportError as err:
        raise EvalError(str(err)) from err
    kernel = {k: v for k, v in (("soe_horizon", soe_horizon), ("temper", temper)) if v is not None}
    if kernel:
        try:
            model = model.with_kernel(**kernel)
        except ValueError as err:
            raise EvalError(f"--soe-horizon/--temper: {err}") from err
    return config, model


def window_limit(context: int, max_windows: int | None, max_tokens: int | None) -> int | None:
    """How many windows of `context` tokens to score: `max_windows`, lowered so that the context
    scores about `max_tokens` tokens (at least one window); None for every window of the text."""
    if max_tokens is None:
        return max_windows
    by_tokens = max(1, max_tokens // context)
    return by_tokens if max_windows is None else min(max_windows, by_tokens)


def score_tasks(
    model: CausalLM,
    data: Sequence[str],
    tasks: Sequence[str],
    tok: Tokenizer,
    task_len: int,
    task_examples: int,
    chunk: int,
    device: torch.device,
) -> dict[str, Any]:
    """The synthetic tasks' accuracies (the needle's haystack is the first data file), each with the
    warnings that hold for examples of `task_len` tokens."""
    with fsspec.open(data[0], "rb") as f:
        haystack = f.read()
    results = run_tasks(model, tasks, tok, task_len, task_examples, chunk, device, haystack)
    task_warnings = context_warnings(model, task_len, chunk)
    for result in results.values():
        result["warnings"] = task_warnings
    for message in task_warnings:
        warnings.warn(f"--task-len: {message}", ContextWarning, stacklevel=3)
    return results


def evaluate(
    model_dir: str | Path,
    data: Sequence[str],
    contexts: Sequence[int],
    chunk: int = 2048,
    tasks: Sequence[str] = (),
    task_len: int = 2048,
    task_examples: int = 8,
    max_windows: int | None = None,
    device: str = "cpu",
    max_tokens: int | None = None,
    soe_horizon: int | None = None,
    temper: int | None = None,
    doc_boundaries: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Evaluate an export directory; returns the JSON-able report (see module docstring).

    `max_windows` caps the windows of every context; `max_tokens` caps each context at
    max(1, max_tokens // context) windows, so that all contexts score about the same tokens.
    `soe_horizon` and `temper` rebuild a VORT-family model's SOE tables (see `CausalLM.with_kernel`).
    `doc_boundaries` resets the model at each file's start, as data.doc_boundaries does in training.
    `progress` announces each context and the tasks on stderr, with the time elapsed and left.
    """
    model_dir = Path(model_dir)
    check_options(model_dir, contexts, chunk, tasks, task_len, max_tokens)
    config, model = load_for_eval(model_dir, device, soe_horizon, temper)
    tok = load_export_tokenizer(model_dir)
    text = read_text(data, tok)
    dev = torch.device(device)
    report: dict[str, Any] = {
        "model": str(model_dir),
        "family": config["lm_config"]["kind"],
        "parameters": model.num_parameters(),
        "tokenizer": tok.kind,
        "data": list(data),
        "text_tokens": int(text.ids.size),
        "text_bytes": text.n_bytes,
        "chunk": chunk,
        "soe_horizon": model.config.vort.soe_horizon,
        "temper": model.config.vort.temper,
        "doc_boundaries": doc_boundaries,
        "contexts": {},
    }
    doc_start = document_starts(text.ids, tok.eos_id) if doc_boundaries else None
    pace = Pace(len(contexts) + (1 if tasks else 0)) if progress else None
    for done, context in enumerate(contexts):
        if pace is not None:
            announce(pace, done, f"context {context}")
        limit = window_limit(context, max_windows, max_tokens)
        result = evaluate_context(model, text, context, chunk, limit, dev, doc_start)
        add_text_units(result, text, tok)
        result["warnings"] = context_warnings(model, context, chunk)
        for message in result["warnings"]:
            warnings.warn(message, ContextWarning, stacklevel=2)
        report["contexts"][str(context)] = result
    if tasks:
        if pace is not None:
            announce(pace, len(contexts), f"tasks {', '.join(tasks)}")
        report["tasks"] = score_tasks(model, data, tasks, tok, task_len, task_examples, chunk, dev)
    report["peak_rss_mb"] = peak_rss_mb()
    return report


def _contexts(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from err


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="export directory (python -m pretrain.export)")
    parser.add_argument("--data", required=True, nargs="+", help="raw text files (paths or fsspec URLs)")
    parser.add_argument("--context", type=_contexts, default=[4096], help="comma-separated context lengths")
    parser.add_argument("--chunk", type=int, default=2048, help="tokens per forward call (the state carries the rest)")
    parser.add_argument("--max-windows", type=int, default=None, help="at most this many windows per context")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="at most max(1, this // context) windows per context (equal token budgets)")
    parser.add_argument("--soe-horizon", type=int, default=None,
                        help="VORT family: score with SOE tables certified to this many lags (weights unchanged)")
    parser.add_argument("--temper", type=int, default=None,
                        help="VORT family: score with the kernel tempered by exp(-lag/N) (weights unchanged)")
    parser.add_argument(
        "--tasks", type=lambda v: [t for t in v.split(",") if t], default=[], help=",".join(sorted(synthetic.TASKS))
    )
    parser.add_argument("--task-len", type=int, default=2048, help="tokens per synthetic-task example")
    parser.add_argument("--task-examples", type=int, default=8, help="examples per synthetic task")
    parser.add_argument("--doc-boundaries", action="store_true",
                        help="reset the model at each file's start (for models trained with data.doc_boundaries)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--plot", help="write a PNG of bits per token against position here")
    args = parser.parse_args(argv)
    try:
        report = evaluate(
            args.model,
            args.data,
            args.context,
            args.chunk,
            args.tasks,
            args.task_len,
            args.task_examples,
            args.max_windows,
            args.device,
            args.max_tokens,
            args.soe_horizon,
            args.temper,
            args.doc_boundaries,
            progress=True,
        )
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for context, result in report["contexts"].items():
        if "skipped" in result:
            print(f"context {context}: skipped ({result['skipped']})")
            continue
        unit = "bits/byte" if "bits_per_byte" in result else "bits/token"
        extra = f", {result['bits_per_character']:.4f} bits/char" if "bits_per_character" in result else ""
        print(
            f"context {context}: {result['bits_per_token']:.4f} {unit}{extra} over {result['tokens']:,} tokens "
            f"({result['windows']} windows), {result['tokens_per_s']:,.0f} tok/s, "
            f"peak RSS {result['peak_rss_mb']:.0f} MiB"
        )
    for task, result in report.get("tasks", {}).items():
        print(f"task {task}: exact {result['exact']:.3f}, token {result['token']:.3f} ({result['examples']} examples)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report["contexts"], args.plot, f"{report['family']} ({report['parameters']:,} parameters)")
    return 0

