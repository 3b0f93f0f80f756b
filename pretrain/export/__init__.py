"""Export a training checkpoint as a self-contained model directory for downstream evaluation.

    python -m pretrain.export --checkpoint <step dir | checkpoints dir | run dir> --out <dir>

The checkpoint is verified, its weights consolidated whatever engine wrote them, and written with
the tokenizer files, a model card and the code transformers needs to load it by itself.
docs/export_eval.md, "Export", lists the files and how the code travels.
"""

from pretrain.export.cli import main
from pretrain.export.directory import export, load_exported, read_export_config, write_export
from pretrain.export.layout import (
    CONFIG,
    SENTENCEPIECE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    WEIGHTS,
    ExportError,
)
from pretrain.export.metadata import hf_config, model_card, write_tokenizer
from pretrain.export.remote_code import flat_name, write_code

__all__ = [
    "CONFIG",
    "SENTENCEPIECE_FILE",
    "TOKENIZER_CONFIG",
    "TOKENIZER_JSON",
    "WEIGHTS",
    "ExportError",
    "export",
    "flat_name",
    "hf_config",
    "load_exported",
    "main",
    "model_card",
    "read_export_config",
    "write_code",
    "write_export",
    "write_tokenizer",
]
