"""Tokenizers for the data pipeline: the byte-level vocabulary and sentencepiece models.

The byte-level vocabulary is defined here and nowhere else: ids 0..255 are the bytes themselves,
``EOS_ID`` separates documents in packed sequences and ``PAD_ID`` is reserved for callers that need
padding (the packer never pads). Byte-level models use ``BYTE_VOCAB_SIZE`` as their vocabulary size.

Every tokenizer has an *identity* (a JSON-able dict with kind, vocab size, special ids and a sha256)
that is written into each shard manifest, so that the trainer can refuse shards built with another
tokenizer (see ``check_tokenizer``).

CLI: ``python -m data_pipeline.tokenizer train --input ... --vocab-size N --out <prefix>`` trains a
sentencepiece model (BPE or unigram, byte fallback) on a deterministic sample of the corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import itertools
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np

BYTE_VOCAB_SIZE = 258
"""Vocabulary size of byte-level models: 256 byte values plus EOS and PAD."""
EOS_ID = 256
"""Byte-level end-of-document id; the packer puts one after every document."""
PAD_ID = 257
"""Byte-level padding id, reserved; packed sequences never contain it."""

_BYTE_IDENTITY_TAG = f"bytes-v1:vocab={BYTE_VOCAB_SIZE}:eos={EOS_ID}:pad={PAD_ID}"


class TokenizerMismatchError(ValueError):
    """Shards were built with a different tokenizer than the one the caller expects."""


def smallest_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0..vocab_size-1`` (uint8 / uint16 / uint32)."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab size {vocab_size} does not fit in uint32")


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer as the pipeline sees it: bytes in, a 1-D id array out (no EOS appended).

    ``content_vocab`` is the number of ids the encoder can emit for document content; shards
    store content tokens only, so their dtype is chosen from it (uint8 for byte-level).
    """

    kind: str
    vocab_size: int
    eos_id: int
    pad_id: int
    sha256: str
    content_vocab: int
    model: str = ""

    def identity(self) -> dict[str, Any]:
        """The JSON-able identity recorded in manifests and compared by ``check_tokenizer``."""
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "sha256": self.sha256,
            "model": self.model,
        }

    @property
    def storage_dtype(self) -> np.dtype:
        """dtype used for content tokens in shards."""
        return smallest_dtype(self.content_vocab)

    def encode(self, data: bytes) -> tuple[np.ndarray, bool]:
        """Encode one document; returns ``(ids, had_invalid_utf8)``.

        Byte-level keeps the bytes exactly. The sentencepiece path decodes UTF-8 with
        replacement (each invalid byte sequence becomes U+FFFD) and reports that it did so,
        so that the build can count such documents in the manifest. It encodes the document line
        by line in one batched call (faster than one long string); with sentencepiece's default
        whitespace handling this gives the same ids as encoding the whole text (tested).
        """
        if self.kind == "bytes":
            return np.frombuffer(data, dtype=np.uint8), False
        processor = _sp_processor(self.model, self.sha256)
        try:
            text = data.decode("utf-8")
            invalid = False
        except UnicodeDecodeError:
            text = data.decode("utf-8", errors="replace")
            invalid = True
        pieces = processor.encode(text.splitlines(keepends=True), out_type=int)
        count = sum(len(p) for p in pieces)
        return np.fromiter(itertools.chain.from_iterable(pieces), dtype=self.storage_dtype, count=count), invalid

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of content ids (special ids such as EOS and PAD are dropped); a byte sequence that is
        not valid UTF-8 becomes U+FFFD, as in ``encode``'s sentencepiece path."""
        specials = {self.eos_id, self.pad_id}
        content = [int(i) for i in ids if int(i) not in specials]
        if self.kind == "bytes":
            return bytes(content).decode("utf-8", errors="replace")
        return _sp_processor(self.model, self.sha256).decode(content)

    def pieces(self) -> list[str]:
        """A distinct readable string per id: sentencepiece's pieces; for byte-level, printable ASCII
        as itself, other bytes as ``<0xNN>``, then ``<eos>`` and ``<pad>``."""
        if self.kind != "bytes":
            processor = _sp_processor(self.model, self.sha256)
            return [processor.id_to_piece(i) for i in range(self.vocab_size)]
        pieces = [chr(b) if 0x21 <= b <= 0x7E else f"<0x{b:02X}>" for b in range(256)]
        return pieces + ["<eos>" if i == self.eos_id else "<pad>" for i in range(256, self.vocab_size)]


_SP_CACHE: dict[str, Any] = {}


def _sp_processor(model: str, sha256: str) -> Any:
    """Load (once per process) the sentencepiece processor for a model file."""
    if sha256 not in _SP_CACHE:
        import sentencepiece as spm

        with fsspec.open(model, "rb") as f:
            proto = f.read()
        _SP_CACHE[sha256] = spm.SentencePieceProcessor(model_proto=proto)
    return _SP_CACHE[sha256]


def byte_tokenizer() -> Tokenizer:
    """The byte-level tokenizer (ids 0..255 = bytes, ``EOS_ID``, ``PAD_ID``)."""
    return Tokenizer(
        kind="bytes",
        vocab_size=BYTE_VOCAB_SIZE,
        eos_id=EOS_ID,
        pad_id=PAD_ID,
        sha256=hashlib.sha256(_BYTE_IDENTITY_TAG.encode()).hexdigest(),
        content_vocab=256,
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """``"bytes"`` or a path/URL of a sentencepiece ``.model`` file -> ``Tokenizer``.

    Raises ``FileNotFoundError`` naming the model when it cannot be read, and ``ValueError``
    when the model has no EOS piece (packing needs a document separator).
    """
    if spec == "bytes":
        return byte_tokenizer()
    import sentencepiece as spm

    try:
        with fsspec.open(spec, "rb") as f:
            proto = f.read()
    except (FileNotFoundError, OSError) as exc:
        raise FileNotFoundError(f"cannot read sentencepiece model {spec!r}: {exc}") from exc
    digest = hashlib.sha256(proto).hexdigest()
    processor = spm.SentencePieceProcessor(model_proto=proto)
    _SP_CACHE[digest] = processor
    eos = processor.eos_id()
    if eos < 0:
        raise ValueError(f"sentencepiece model {spec!r} has no EOS piece; retrain with eos_id >= 0")
    vocab = processor.vocab_size()
    return Tokenizer(
        kind="sentencepiece",
        vocab_size=vocab,
        eos_id=eos,
        pad_id=processor.pad_id(),
        sha256=digest,
        content_vocab=vocab,
        model=spec,
    )


def check_tokenizer(found: dict[str, Any], expected: str | dict[str, Any], where: str = "shards") -> None:
    """Raise ``TokenizerMismatchError`` unless identity ``found`` matches ``expected``.

    ``expected`` is a tokenizer spec (``"bytes"`` or a model path) or an identity dict. Kind,
    vocab size, EOS id and model sha256 must agree; the model path may differ (a copied model is
    the same tokenizer).
    """
    want = load_tokenizer(expected).identity() if isinstance(expected, str) else expected
    for key in ("kind", "vocab_size", "eos_id", "sha256"):
        if found.get(key) != want.get(key):
            raise TokenizerMismatchError(
                f"{where} were built with tokenizer {found.get('kind')!r} "
                f"(vocab_size={found.get('vocab_size')}, eos_id={found.get('eos_id')}, "
                f"sha256={str(found.get('sha256'))[:12]}, model={found.get('model')!r}) but the run expects "
                f"{want.get('kind')!r} (vocab_size={want.get('vocab_size')}, eos_id={want.get('eos_id')}, "
                f"sha256={str(want.get('sha256'))[:12]}, model={want.get('model')!r}); {key} differs. "
                "Rebuild the shards with the run's tokenizer or point the run at matching shards."
            )


def _sample_sentences(inputs: Sequence[str], sample_bytes: int, max_line_bytes: int) -> Iterable[str]:
    """Lines of the corpus, in input order, until ``sample_bytes`` have been taken.

    Every document is sampled proportionally: a stride over the documents' lines keeps about
    ``sample_bytes`` in total, so a large corpus contributes a deterministic, spread-out sample.
    """
    from data_pipeline.sources import expand_inputs, iter_documents

    paths = expand_inputs(inputs)
    total = sum(size for _, size in paths)
    stride = max(1, total // max(1, sample_bytes))
    taken = 0
    for doc in iter_documents(paths):
        text = doc.data.decode("utf-8", errors="replace")
        for i, line in enumerate(text.splitlines()):
            if i % stride or not line.strip():
                continue
            line = line[:max_line_bytes]
            taken += len(line)
            yield line
            if taken >= sample_bytes:
                return


def train_sentencepiece(
    inputs: Sequence[str],
    vocab_size: int,
    out_prefix: str,
    model_type: str = "bpe",
    sample_bytes: int = 50_000_000,
    character_coverage: float = 0.9995,
    seed: int = 0,
) -> Tokenizer:
    """Train a sentencepiece model with byte fallback on a sample of ``inputs``.

    Writes ``<out_prefix>.model`` and ``<out_prefix>.vocab`` (through fsspec) and returns the
    loaded tokenizer. Ids: unk=0, bos=1, eos=2, pad=3. The sample is a deterministic stride
    over the corpus lines; training itself is seeded.
    """
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ValueError(f"model_type must be 'bpe' or 'unigram', not {model_type!r}")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_sample_sentences(inputs, sample_bytes, 4096)),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        character_coverage=character_coverage,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        max_sentence_length=16384,
        num_threads=1,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    proto = model.getvalue()
    with fsspec.open(out_prefix + ".model", "wb") as f:
        f.write(proto)
    processor = spm.SentencePieceProcessor(model_proto=proto)
    with fsspec.open(out_prefix + ".vocab", "w", encoding="utf-8") as f:
        for i in range(processor.vocab_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i)}\n")
    return load_tokenizer(out_prefix + ".model")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: ``train`` a sentencepiece model, or ``info`` prints a tokenizer identity."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.tokenizer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a sentencepiece model on a sample of the corpus")
    train.add_argument("--input", nargs="+", required=True, help="files, globs or fsspec URLs")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="output prefix: writes <out>.model and <out>.vocab")
    train.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    train.add_argument("--sample-bytes", type=int, default=50_000_000)
    train.add_argument("--seed", type=int, default=0)
    info = sub.add_parser("info", help="print the identity of a tokenizer spec as JSON")
    info.add_argument("spec", help="'bytes' or a sentencepiece model path/URL")
    args = parser.parse_args(argv)
    if args.command == "train":
        tok = train_sentencepiece(
            args.input, args.vocab_size, args.out, args.model_type, args.sample_bytes, seed=args.seed
        )
    else:
        tok = load_tokenizer(args.spec)
    json.dump(tok.identity(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
