"""Export a training checkpoint as a self-contained model directory for downstream evaluation.

    python -m pretrain.export --checkpoint <step dir | checkpoints dir | run dir> --out <dir>

The checkpoint's manifest is verified first, the weights consolidated whatever engine wrote them
(`consolidate`), and the directory written as:

  model.safetensors       fp32 weights; tied head/embedding stored once, as safetensors' save_model does
  config.json             transformers-style: model_type, architectures, auto_map, our model config
                          nested under "lm_config", vocabulary and special ids, provenance
  recurrent_tokenizer.json  kind, vocab size, special ids, sha256 (a name HF tokenizers will not misread);
                          plus tokenizer.model (a copy of the sentencepiece model) for tokenized runs
  tokenizer_config.json   for transformers' AutoTokenizer (trust_remote_code)
  README.md               a short model card
  configuration_recurrent.py, modeling_recurrent.py, tokenization_recurrent.py, rlm_*.py
                          the code transformers runs under trust_remote_code (`remote_code`)
"""

from pretrain.export.cli import main
from pretrain.export.consolidate import consolidate, read_run_config, resolve_checkpoint
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
    "consolidate",
    "export",
    "flat_name",
    "hf_config",
    "load_exported",
    "main",
    "model_card",
    "read_export_config",
    "read_run_config",
    "resolve_checkpoint",
    "write_code",
    "write_export",
    "write_tokenizer",
]
