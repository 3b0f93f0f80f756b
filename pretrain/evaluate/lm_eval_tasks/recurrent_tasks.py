"""Data and scoring of the project's lm-evaluation-harness tasks, generated here rather than downloaded.

    lm_eval --model hf --model_args pretrained=<export>,trust_remote_code=True \\
        --include_path pretrain/evaluate/lm_eval_tasks --tasks recurrent_copy,recurrent_needle,recurrent_zipf \\
        --metadata '{"length": 4096, "examples": 32}'

Each task's examples come from `data_pipeline.synthetic` (seeded: the same metadata gives the same
examples) and are turned into text: `context` is everything before the answer, `answer` the
answer itself, so a loglikelihood request scores exactly the answer tokens. Lengths are in bytes
of text, which for byte-level models are tokens.

Metadata keys (all optional): length (bytes per example, default 2048), examples (default 16),
seed (default 0), haystack (the needle task's text file, default the demo's held-out book) and
text_files (the bits-per-byte task's files, default the same book).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from data_pipeline import synthetic

REPO = Path(__file__).resolve().parents[3]
DEFAULT_TEXT = REPO / "data" / "demo" / "valid" / "northangerabbey.txt"
ZIPF_ALPHABET = 94
"""The Zipf-lag task's symbols are the printable ASCII characters '!'..'~', one per id."""


def _settings(metadata: dict[str, Any]) -> tuple[int, int, int]:
    length, examples = int(metadata.get("length", 2048)), int(metadata.get("examples", 16))
    seed = int(metadata.get("seed", 0))
    if length < synthetic.MIN_TASK_LEN or examples < 1:
        raise ValueError(
            f"metadata: length must be at least {synthetic.MIN_TASK_LEN} and examples at least 1, "
            f"got {length}, {examples}"
        )
    return length, examples, seed


def _split(rows: list[dict[str, Any]]) -> dict[str, datasets.Dataset]:
    return {"test": datasets.Dataset.from_list(rows)}


def _row(text: str, answer_start: int, **extra: Any) -> dict[str, Any]:
    return {"context": text[:answer_start], "answer": text[answer_start:], **extra}


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"metadata {what}: cannot read {path}: {err}") from err
    if not data:
        raise ValueError(f"metadata {what}: {path} is empty")
    return data


def copy_docs(**metadata: Any) -> dict[str, datasets.Dataset]:
    """Copy-paste: STX, a printable segment (up to length/8 bytes), filler, ETX; answer: the segment."""
    length, examples, seed = _settings(metadata)
    task = synthetic.make_task("copy", length, seed=seed)
    rows = []
    for i in range(examples):
        e = task.example(i)
        rows.append(_row(bytes(e.input_ids.tolist()).decode("ascii"), e.answer[0], **e.meta))
    return _split(rows)


def needle_docs(**metadata: Any) -> dict[str, datasets.Dataset]:
    """A six-digit number planted in a window of real text, asked for at the end; answer: the number."""
    length, examples, seed = _settings(metadata)
    haystack = _read(metadata.get("haystack", DEFAULT_TEXT), "haystack")
    task = synthetic.make_task("needle", length, haystack=haystack, seed=seed)
    rows = []
    for i in range(examples):
        e = task.example(i)
        data = bytes(e.input_ids.tolist())
        # a window cut mid-character becomes U+FFFD: the text must be a valid string
        context = data[: e.answer[0]].decode("utf-8", errors="replace")
        rows.append({"context": context, "answer": data[e.answer[0] :].decode("ascii"), "depth": e.meta["depth"]})
    return _split(rows)


def zipf_docs(**metadata: Any) -> dict[str, datasets.Dataset]:
    """Key-value records in noise, one queried at a Zipf-distributed lag; answer: the key's value."""
    length, examples, seed = _settings(metadata)
    task = synthetic.make_task("zipf", length, vocab_size=ZIPF_ALPHABET, seed=seed)
    rows = []
    for i in range(examples):
        e = task.example(i)
        text = (e.input_ids.astype(np.uint8) + ord("!")).tobytes().decode("ascii")
        rows.append(_row(text, e.answer[0], lag=e.meta["lag"]))
    return _split(rows)


def text_docs(**metadata: Any) -> dict[str, datasets.Dataset]:
    """Whole UTF-8 text files, one document each, for loglikelihood_rolling (bits per byte)."""
    files = metadata.get("text_files", [str(DEFAULT_TEXT)])
    rows = []
    for path in [files] if isinstance(files, str) else files:
        data = _read(path, "text_files")
        try:
            rows.append({"text": data.decode("utf-8"), "path": str(path)})
        except UnicodeDecodeError as err:
            raise ValueError(f"metadata text_files: {path} is not UTF-8 text ({err})") from err
    return _split(rows)


def answer_scores(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, float]:
    """A loglikelihood request's scores: `acc`, the whole answer is the model's argmax, and
    `answer_bits_per_byte`, its negative log-likelihood in bits per byte of answer (which shows
    partial use of the context where `acc` is still 0)."""
    (loglikelihood, greedy), = results
    return {"acc": float(greedy), "answer_bits_per_byte": -loglikelihood / math.log(2) / len(doc["answer"].encode())}


def needle_exact(doc: dict[str, Any], results: list[str]) -> dict[str, int]:
    """Generated needle answer: right when the first six characters are the number."""
    return {"exact": int(results[0].strip()[:6] == doc["answer"])}
