"""The descriptive files of an export: tokenizer description, config.json and the model card."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import fsspec

from pretrain.checkpoint.manifest import is_local
from pretrain.config import RunConfig, config_to_dict
from pretrain.export.layout import SENTENCEPIECE_FILE, TOKENIZER_CONFIG, TOKENIZER_JSON, ExportError

TOKENIZER_CLASS = "RecurrentTokenizer"


def refuse_remote(url: str, key: str, allow_network: bool) -> None:
    """Export reads nothing over the network that a checkpoint's config names unless the user asked
    (`--allow-network`): a config is a file anyone may have written, and a URL in it would make the
    export contact whatever host it names."""
    if not allow_network and not is_local(url):
        raise ExportError(f"{key}={url!r}: a remote path named by the checkpoint's config; export contacts "
                          "nothing unless asked (python -m pretrain.export --allow-network)")


def write_tokenizer(out: Path, spec: str, allow_network: bool = False) -> dict[str, Any]:
    """recurrent_tokenizer.json describing the run's tokenizer, tokenizer_config.json for
    transformers' AutoTokenizer (whose class, tokenization_recurrent.py, wraps the project's own
    tokenizer) and, for sentencepiece runs, a copy of the model."""
    from data_pipeline.tokenizer import load_tokenizer

    refuse_remote(spec, "data.tokenizer", allow_network)
    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as err:
        raise ExportError(f"data.tokenizer={spec!r}: {err}") from err
    info: dict[str, Any] = {
        "format": "recurrent-pretrain tokenizer v1",
        "kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "sha256": tok.sha256,
    }
    if tok.kind == "bytes":
        info["description"] = "ids 0..255 are the byte values; eos_id ends a document; pad_id is reserved"
    else:
        with fsspec.open(spec, "rb") as f:
            proto = f.read()
        (out / SENTENCEPIECE_FILE).write_bytes(proto)
        info["file"] = SENTENCEPIECE_FILE
        info["description"] = "sentencepiece model in tokenizer.model (sha256 above is of that file)"
    (out / TOKENIZER_JSON).write_text(json.dumps(info, indent=1) + "\n")
    (out / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    return info


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json: where AutoTokenizer finds the class (trust_remote_code). Special tokens
    are set by the class from the project's tokenizer; text is never parsed for them, so that any
    string encodes to the ids the data pipeline would give it."""
    return {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"tokenization_recurrent.{TOKENIZER_CLASS}", None]},
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }


def data_fingerprint(cfg: RunConfig, allow_network: bool = False) -> str:
    """sha256 over the training sources' manifests (path, weight, manifest bytes), or a note."""
    digest = hashlib.sha256()
    for source in cfg.data.train:
        if not allow_network and not is_local(source.path):
            return f"not computed ({source.path} is remote; python -m pretrain.export --allow-network reads it)"
        try:
            with fsspec.open(source.path.rstrip("/") + "/manifest.json", "rb") as f:
                manifest = f.read()
        except OSError:
            return f"unavailable ({source.path}/manifest.json not readable at export time)"
        digest.update(f"{source.path}\0{source.weight}\0".encode())
        digest.update(manifest)
    return digest.hexdigest()


def eval_metrics(step_dir: Path, cfg: RunConfig, step: int) -> dict[str, float]:
    """The run's last logged eval/* numbers at or before `step`, from metrics.jsonl in the run
    directory (the checkpoint's grandparent by default, else the configured run.dir)."""
    found: dict[str, float] = {}
    candidates = [step_dir.parent.parent / "metrics.jsonl", Path(cfg.run.dir) / "metrics.jsonl"]
    metrics = next((path for path in candidates if path.is_file()), None)
    if metrics is None:
        return found
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            found.update({k: v for k, v in record.items() if k.startswith("eval/")})
    return found


def hf_config(cfg: RunConfig, tokenizer: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json: what transformers needs to find the remote code, plus our model config."""
    m = cfg.model
    return {
        "model_type": "recurrent_lm",
        "architectures": ["RecurrentLMForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_recurrent.RecurrentLMConfig",
            "AutoModelForCausalLM": "modeling_recurrent.RecurrentLMForCausalLM",
            "AutoTokenizer": [f"tokenization_recurrent.{TOKENIZER_CLASS}", None],
        },
        "lm_config": config_to_dict(m),
        "family": m.kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": m.tie_embeddings,
        "eos_token_id": tokenizer["eos_id"],
        "pad_token_id": tokenizer["pad_id"] if tokenizer["pad_id"] >= 0 else None,
        "dtype": "float32",
        "recurrent_export": provenance,
    }


def model_card(cfg: RunConfig, provenance: dict[str, Any], evals: dict[str, float]) -> str:
    m = cfg.model
    lines = [
        f"# {cfg.run.name}: {m.kind} language model",
        "",
        f"- family: `{m.kind}` (d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"vocabulary {m.vocab_size})",
        f"- parameters: {provenance['parameters']:,} ({provenance['parameters'] / 1e6:.2f}M)",
        f"- training: {provenance['step']:,} steps, {provenance['tokens_seen']:,} tokens, engine "
        f"`{cfg.engine.kind}`, sequence length {cfg.data.seq_len}",
        f"- tokenizer: `{provenance['tokenizer']}`",
        f"- data manifest fingerprint (sha256): `{provenance['data_fingerprint']}`",
        f"- exported from: `{provenance['checkpoint'] or 'a model in memory (write_export)'}`",
        "",
        "## Evaluation logged during training",
        "",
    ]
    if evals:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in sorted(evals.items())]
    else:
        lines.append("none logged (`eval.every` was 0 or no validation data).")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from pretrain.export import load_exported          # with this project installed",
        "model = load_exported('<this dir>')",
        "# or, with only transformers and torch:",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained('<this dir>', trust_remote_code=True)",
        "tokenizer = AutoTokenizer.from_pretrained('<this dir>', trust_remote_code=True)",
        "ids = tokenizer('It is a truth', return_tensors='pt').input_ids",
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=64)[0]))",
        "```",
        "",
        "`forward(input_ids, state=None)` returns logits and the recurrent state; pass the state back",
        "to continue a long text piece by piece (`python -m pretrain.evaluate` does this, and",
        "`generate()` keeps the state as its cache). lm-evaluation-harness runs on this directory with",
        "`--model hf --model_args pretrained=<this dir>,trust_remote_code=True`.",
        "",
    ]
    return "\n".join(lines)
