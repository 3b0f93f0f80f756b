"""transformers tokenizer of an exported recurrent-pretrain model (copied into every export).

It wraps the data pipeline's own tokenizer, which travels in the export as
rlm_data_pipeline_tokenizer.py, so a string encodes to exactly the ids training saw: byte-level
(ids 0..255 are the UTF-8 bytes, then EOS and PAD) or the export's sentencepiece model in
tokenizer.model (encoded line by line, invalid UTF-8 replaced, as the data pipeline does).

Special tokens: EOS (and PAD where the tokenizer has one). There is no BOS: training put an EOS
between documents, so lm-evaluation-harness, which prefixes a document with BOS or else EOS, gives
the model the context it was trained with. Text is never searched for special-token strings.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, ClassVar

from transformers import PreTrainedTokenizer

from .rlm_data_pipeline_tokenizer import byte_tokenizer, load_tokenizer

SENTENCEPIECE_FILE = "tokenizer.model"


class RecurrentTokenizer(PreTrainedTokenizer):
    """The project's byte-level or sentencepiece tokenizer behind transformers' interface."""

    vocab_files_names: ClassVar[dict[str, str]] = {"sentencepiece_model": SENTENCEPIECE_FILE}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(self, sentencepiece_model: str | None = None, **kwargs: Any) -> None:
        self.project = load_tokenizer(sentencepiece_model) if sentencepiece_model else byte_tokenizer()
        self.sentencepiece_model = sentencepiece_model
        tok = self.project
        self._pieces = pieces = tok.pieces()
        self._piece_ids = {piece: i for i, piece in enumerate(pieces)}
        kwargs.setdefault("eos_token", pieces[tok.eos_id])
        if tok.pad_id >= 0:
            kwargs.setdefault("pad_token", pieces[tok.pad_id])
        kwargs.setdefault("split_special_tokens", True)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.project.vocab_size

    def get_vocab(self) -> dict[str, int]:
        return dict(self._piece_ids)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        """Token strings of the ids the data pipeline gives `text`'s UTF-8 bytes (a string decoded
        with errors="surrogateescape" gives back its original bytes, invalid ones included)."""
        ids, _ = self.project.encode(text.encode("utf-8", errors="surrogateescape"))
        return [self._pieces[i] for i in ids.tolist()]

    def _convert_token_to_id(self, token: str) -> int | None:
        return self._piece_ids.get(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self._pieces[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.project.decode([self._piece_ids[t] for t in tokens])

    def _decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        """The data pipeline's decoding of the content ids; special ids are dropped with
        skip_special_tokens, else written as their token strings between the decoded runs."""
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        if skip_special_tokens:
            return self.project.decode(ids)
        specials = {self.project.eos_id, self.project.pad_id}
        parts, run = [], []
        for i in ids:
            if i not in specials:
                run.append(i)
                continue
            parts += [self.project.decode(run), self._pieces[i]]
            run = []
        parts.append(self.project.decode(run))
        return "".join(parts)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        """A sentencepiece tokenizer writes its model file; the byte-level one has no vocabulary file."""
        if self.sentencepiece_model is None:
            return ()
        target = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + SENTENCEPIECE_FILE)
        if os.path.abspath(self.sentencepiece_model) != os.path.abspath(target):
            shutil.copyfile(self.sentencepiece_model, target)
        return (target,)
