"""Writing an export directory from a model or checkpoint, and loading one back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

from model import CausalLM, build_model
from model.config import as_trained, model_config_from_dict
from model.config_loader import ConfigError
from pretrain.checkpoint.consolidate import load_newest, origin
from pretrain.checkpoint.layout import CheckpointError
from pretrain.config import RunConfig
from pretrain.engines import engine_class
from pretrain.export.layout import CONFIG, EXPORT_FORMAT, WEIGHTS, ExportError
from pretrain.export.metadata import data_fingerprint, eval_metrics, hf_config, model_card, write_tokenizer
from pretrain.export.remote_code import write_code
from pretrain.telemetry.log import get_logger


def write_export(
    model: CausalLM,
    cfg: RunConfig,
    out: str | Path,
    training: dict[str, Any] | None = None,
    evals: dict[str, float] | None = None,
    allow_network: bool = False,
) -> Path:
    """Write `model` (built from `cfg.model`) as an export directory. `training` adds provenance
    (checkpoint, step, tokens_seen) and `evals` the metrics shown in the model card; remote paths
    in `cfg` (tokenizer, data manifests) are read only under `allow_network`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out, cfg.data.tokenizer, allow_network)
    provenance = {
        "format": EXPORT_FORMAT,
        "checkpoint": None,
        "engine": engine_class(cfg).describe(cfg),
        "step": 0,
        "tokens_seen": 0,
        **(training or {}),
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer["kind"] if tokenizer["kind"] == "bytes" else cfg.data.tokenizer,
        "data_fingerprint": data_fingerprint(cfg, allow_network),
    }
    save_model(model, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(hf_config(cfg, tokenizer, provenance), indent=1) + "\n")
    write_code(out)
    (out / "README.md").write_text(model_card(cfg, provenance, evals or {}))
    return out


def export(checkpoint: str | Path, out: str | Path, allow_network: bool = False) -> Path:
    """Write the export directory of the newest checkpoint `checkpoint` means that verifies and
    consolidates (pretrain.checkpoint.consolidate.load_newest); returns it. Nothing its config
    names is fetched over the network unless `allow_network`."""
    try:
        step_dir, cfg, model = load_newest(checkpoint, "export")
    except CheckpointError as err:
        raise ExportError(str(err)) from err
    get_logger().info("exporting %s", step_dir)
    try:
        trainer = json.loads((step_dir / "trainer_state.json").read_text()).get("trainer", {})
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"{step_dir / 'trainer_state.json'}: {err}") from err
    step = int(trainer.get("step", 0))
    training = {"checkpoint": origin(step_dir), "step": step, "tokens_seen": int(trainer.get("tokens_seen", 0))}
    return write_export(model, cfg, out, training, eval_metrics(step_dir, cfg, step), allow_network)


def read_export_config(export_dir: str | Path) -> dict[str, Any]:
    """config.json of an export directory (raises ExportError naming the path)."""
    path = Path(export_dir) / CONFIG
    if not path.is_file():
        raise ExportError(f"{path}: missing; is {export_dir} an export directory (python -m pretrain.export)?")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}: not valid JSON: {err}") from err
    if "lm_config" not in config:
        raise ExportError(f"{path}: no 'lm_config' entry; not written by pretrain.export")
    return config


def load_exported(export_dir: str | Path, device: str | torch.device = "cpu") -> CausalLM:
    """The exported CausalLM (eval mode, fp32), built by this project's code; no DeepSpeed needed."""
    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    try:
        model_cfg = model_config_from_dict(as_trained(config["lm_config"]))
    except ConfigError as err:
        raise ExportError(f"{export_dir / CONFIG}: lm_config: {err}") from err
    weights = export_dir / WEIGHTS
    if not weights.is_file():
        raise ExportError(f"{weights}: missing")
    model = build_model(model_cfg)
    load_model(model, str(weights), strict=True)
    return model.to(device).eval()
