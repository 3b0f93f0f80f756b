"""Why a VORT-family model scores worse on long contexts than on short ones: what its memory holds.

    python -m pretrain.evaluate.memory_probe --model <export dir> --data book.txt --context 65536 \
        [--chunk 1024] [--train-len 256] [--json probe.json] [--plot probe.png]

Streams one long window through the model chunk by chunk and records, per chunk, the loss and how
the SOE normaliser's mass is spread over timescales; a kernel table shows the same for the kernels
alone. docs/vort.md, "Long contexts", says what each quantity means and why it explains the drift.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model import CausalLM
from model.soe import SOEKernel, gl_weights
from pretrain.evaluate.text import EvalError, load_export_tokenizer, read_text
from pretrain.export import ExportError, load_exported


def kernel_table(
    kernel: SOEKernel, horizon: int, train_len: int, contexts: Sequence[int], temper: int | None = None
) -> list[dict[str, Any]]:
    """Per bank order: share of the kernel mass within `train_len` lags at each context (exact
    power law and SOE, both tempered by exp(-lag / temper) when given), and the SOE's max relative
    error over lags in (horizon, max context]."""
    rows = []
    top = max(contexts)
    n = np.arange(top, dtype=np.float64)
    taper = np.exp(-n / temper) if temper else np.ones_like(n)
    decays = np.exp(np.outer(n, kernel.log_lambda)) * taper[:, None]  # [N, S]
    for k, alpha in enumerate(kernel.banks):
        exact = np.cumsum(gl_weights(n, alpha) * taper)
        soe = np.cumsum(decays @ kernel.coef[k])
        beyond = slice(horizon + 1, top)
        ref = gl_weights(n[beyond], alpha) * taper[beyond]
        error = float(np.max(np.abs(decays[beyond] @ kernel.coef[k] - ref) / ref)) if top > horizon + 1 else 0.0
        rows.append({
            "alpha": float(alpha),
            "recent_share_exact": {str(c): float(exact[train_len - 1] / exact[c - 1]) for c in contexts},
            "recent_share_soe": {str(c): float(soe[train_len - 1] / soe[c - 1]) for c in contexts},
            "soe_rel_error_beyond_horizon": error,
        })
    return rows


@torch.inference_mode()
def probe(model: CausalLM, ids: np.ndarray, context: int, chunk: int, train_len: int) -> dict[str, Any]:
    """The per-chunk measurements of the module docstring over the first `context` tokens of `ids`."""
    if not model.reports_memory:
        raise EvalError(f"the memory probe reads SOE scan states; model.kind={model.config.kind!r} has none")
    if ids.size < context + 1:
        raise EvalError(f"the text has {ids.size} tokens; the probe needs context + 1 = {context + 1}")
    window = torch.from_numpy(ids[: context + 1])
    inputs, targets = window[None, :-1], window[1:]
    records = []
    state = model.init_state(1)
    for start in range(0, context, chunk):
        logits, state = model(inputs[:, start : start + chunk], state)
        n = logits.shape[1]
        nll = F.cross_entropy(logits[0].float(), targets[start : start + n])
        record = {"end": start + n, "bits_per_token": float(nll) / math.log(2),
                  "layers": model.memory_report(state, train_len)}
        records.append(record)
    return {"context": context, "chunk": chunk, "train_len": train_len, "chunks": records}


def plot(report: dict[str, Any], path: str) -> None:
    """Three panels against position: bits per token, normaliser mass, long-timescale share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = report["probe"]["chunks"]
    ends = [c["end"] for c in chunks]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(ends, [c["bits_per_token"] for c in chunks], marker=".")
    axes[0].set_ylabel("bits per token of the chunk")
    for i in range(len(chunks[0]["layers"])):
        axes[1].plot(ends, [c["layers"][i]["normaliser_mass"] for c in chunks], label=f"layer {i}")
        axes[2].plot(ends, [c["layers"][i].get("long_term_share", math.nan) for c in chunks], label=f"layer {i}")
    axes[1].set_ylabel("normaliser mass (sum of b)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel(f"share in terms with timescale > {report['probe']['train_len']}")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position (tokens)")
        ax.grid(True, alpha=0.3)
    axes[2].legend()
    fig.suptitle(f"{report['family']} memory along one {report['probe']['context']:,}-token window")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pretrain.evaluate.memory_probe", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", required=True, help="export directory (python -m pretrain.export)")
    parser.add_argument("--data", required=True, nargs="+", help="raw text files")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--train-len", type=int, default=256, help="the training sequence length")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    try:
        model = load_exported(args.model)
        text = read_text(args.data, load_export_tokenizer(Path(args.model)))
        result = probe(model, text.ids, args.context, args.chunk, args.train_len)
    except (EvalError, ExportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"model": args.model, "family": model.config.kind, "probe": result}
    tables = model.certified_kernel()
    if tables is not None:
        contexts = [c for c in (1024, 4096, 16384, 65536) if c <= args.context] or [args.context]
        report["kernel"] = kernel_table(tables.kernel, tables.horizon, args.train_len, contexts, tables.temper)
    for c in result["chunks"]:
        if c["end"] & (c["end"] - 1) == 0:  # powers of two
            layers = " ".join(
                f"L{i}: mass {e['normaliser_mass']:.3g} long {e.get('long_term_share', math.nan):.2f} "
                f"a {e.get('alpha_mean', math.nan):.2f}" for i, e in enumerate(c["layers"])
            )
            print(f"pos {c['end']:>6}: {c['bits_per_token']:.3f} bits | {layers}")
    for row in report.get("kernel", []):
        print(f"alpha {row['alpha']:.2f}: mass within {args.train_len} lags exact {row['recent_share_exact']} "
              f"soe {row['recent_share_soe']}; SOE error beyond horizon {row['soe_rel_error_beyond_horizon']:.2g}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
