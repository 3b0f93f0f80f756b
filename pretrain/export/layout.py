"""What an export directory holds: its file names, format version and error type."""

from __future__ import annotations

from pathlib import Path

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TOKENIZER_JSON = "recurrent_tokenizer.json"  # not "tokenizer.json": that name is the HF tokenizers format
TOKENIZER_CONFIG = "tokenizer_config.json"  # what transformers' AutoTokenizer reads
SENTENCEPIECE_FILE = "tokenizer.model"
CODE_PREFIX = "rlm_"
EXPORT_FORMAT = 1
HF_TEMPLATES = Path(__file__).resolve().parent / "hf_templates"
"""The hand-written transformers wrappers copied into every export."""


class ExportError(RuntimeError):
    """A checkpoint or export directory that cannot be used; the message names the path."""
