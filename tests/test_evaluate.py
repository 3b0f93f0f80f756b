"""pretrain.evaluate: streaming bits per byte equals one-shot, report shape, plot, tasks, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from model import build_model
from pretrain.config import config_from_dict
from pretrain.evaluate import text as ev
from pretrain.export import load_exported, write_export

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "data" / "demo" / "train" / "macbeth.txt"


def _export(root: Path, family: str) -> Path:
    """An untrained tiny model of `family` written as an export (no training needed to test evaluation)."""
    cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / f"{family}-tiny.yaml").read_text()))
    torch.manual_seed(0)
    return write_export(build_model(cfg.model), cfg, root / family)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {family: _export(root, family) for family in ("vort", "pmnet", "transformer")}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("text") / "excerpt.txt"
    path.write_bytes(BOOK.read_bytes()[:3000])
    return path


@pytest.mark.parametrize("family", ["vort", "pmnet"])
def test_streaming_equals_one_shot(exports: dict[str, Path], text_file: Path, family: str) -> None:
    """Chunks of 37 tokens carrying the state give the loss of one forward over the whole window."""
    model = load_exported(exports[family])
    tok = ev.load_export_tokenizer(exports[family])
    text = ev.read_text([str(text_file)], tok)
    context = 512
    streamed = ev.evaluate_context(model, text, context, chunk=37, max_windows=2, device=torch.device("cpu"))
    whole = ev.evaluate_context(model, text, context, chunk=context, max_windows=2, device=torch.device("cpu"))
    with torch.no_grad():
        ids = torch.from_numpy(text.ids[: 2 * context + 1])
        nll = sum(
            F.cross_entropy(
                model(ids[None, w * context : (w + 1) * context]).logits[0],
                ids[w * context + 1 :][:context],
                reduction="sum",
            ).item()
            for w in range(2)
        )
    direct = nll / (2 * context) / math.log(2)
    assert streamed["windows"] == 2 and streamed["tokens"] == 2 * context
    assert math.isfinite(streamed["bits_per_token"])
    assert streamed["bits_per_token"] == pytest.approx(whole["bits_per_token"], rel=1e-5)
    assert streamed["bits_per_token"] == pytest.approx(direct, rel=1e-5)
    for a, b in zip(streamed["buckets"], whole["buckets"], strict=True):
        assert a["bits_per_token"] == pytest.approx(b["bits_per_token"], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("family", ["vort", "pmnet"])
def test_doc_boundaries_score_each_file_as_if_alone(exports: dict[str, Path], tmp_path: Path, family: str) -> None:
    """With doc_boundaries two files in one window, streamed in chunks of 37, score as each file run alone
    from its first token; the EOS that ends the first file is its last input and predicts the second's first
    token, as in training."""
    model = load_exported(exports[family])
    tok = ev.load_export_tokenizer(exports[family])
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_bytes(BOOK.read_bytes()[:300])
    second.write_bytes(BOOK.read_bytes()[5000:5400])
    text = ev.read_text([str(first), str(second)], tok)
    starts = ev.document_starts(text.ids, tok.eos_id)
    assert starts.nonzero()[0].tolist() == [0, 301]  # the text: 300 bytes, EOS, 400 bytes, EOS
    context, cpu = 512, torch.device("cpu")
    reset = ev.evaluate_context(model, text, context, chunk=37, max_windows=1, device=cpu, doc_start=starts)
    read_across = ev.evaluate_context(model, text, context, chunk=37, max_windows=1, device=cpu)
    ids = torch.from_numpy(text.ids)
    with torch.no_grad():
        nll = sum(F.cross_entropy(model(ids[None, lo:hi]).logits[0], ids[lo + 1 : hi + 1], reduction="sum").item()
                  for lo, hi in ((0, 301), (301, context)))
    assert reset["bits_per_token"] == pytest.approx(nll / context / math.log(2), rel=1e-5)
    assert reset["bits_per_token"] != pytest.approx(read_across["bits_per_token"], rel=1e-5)


def test_cli_report_plot_and_tasks(
    exports: dict[str, Path], text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "report.json", tmp_path / "loss.png"
    code = ev.main([
        "--model", str(exports["vort"]), "--data", str(text_file), "--context", "256,1024,100000",
        "--chunk", "128", "--json", str(out_json), "--plot", str(out_png),
        "--tasks", "copy,needle,zipf", "--task-len", "200", "--task-examples", "2",
    ])  # fmt: skip
    assert code == 0
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert [line.split("]")[1] for line in progress] == [" context 256", " context 1024", " context 100000",
                                                         " tasks copy, needle, zipf"], progress
    assert progress[0].startswith("[0/4 elapsed") and "left ~" in progress[-1]
    report = json.loads(out_json.read_text())
    assert report["family"] == "vort" and report["tokenizer"] == "bytes"
    assert report["text_bytes"] == 3000 and report["text_tokens"] == 3001  # one EOS after the file
    assert set(report["contexts"]) == {"256", "1024", "100000"}
    assert "skipped" in report["contexts"]["100000"]  # longer than the text: said so, not faked
    for context in ("256", "1024"):
        result = report["contexts"][context]
        assert result["windows"] == (3001 - 1) // int(context)
        assert 0 < result["bits_per_byte"] == result["bits_per_token"] < 16
        assert result["buckets"][0]["start"] == 0 and result["buckets"][-1]["end"] == int(context)
        assert result["peak_rss_mb"] > 0
    assert set(report["tasks"]) == {"copy", "needle", "zipf"}
    for result in report["tasks"].values():
        assert 0 <= result["exact"] <= 1 and 0 <= result["token"] <= 1 and result["examples"] == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformer_baseline_streams(exports: dict[str, Path], text_file: Path) -> None:
    """The baseline keeps no memory across chunks, but streaming evaluation still runs and is
    finite, with a warning that it saw one chunk at a time."""
    with pytest.warns(ev.ContextWarning, match="at most one chunk"):
        report = ev.evaluate(exports["transformer"], [str(text_file)], [512], chunk=128, max_windows=1)
    assert math.isfinite(report["contexts"]["512"]["bits_per_byte"])
    assert len(report["contexts"]["512"]["warnings"]) == 1


def test_contexts_beyond_what_the_model_was_built_for_are_flagged(exports: dict[str, Path], text_file: Path) -> None:
    """vort-tiny certifies its kernel to soe_horizon=256 and has max_seq_len=512: a context of 256
    is clean, 384 passes the horizon, 1024 both; the JSON says so beside the numbers."""
    with pytest.warns(ev.ContextWarning) as caught:
        report = ev.evaluate(exports["vort"], [str(text_file)], [256, 384, 1024], chunk=128, max_windows=1)
    contexts = report["contexts"]
    assert contexts["256"]["warnings"] == []
    assert len(contexts["384"]["warnings"]) == 1 and "soe_horizon=256" in contexts["384"]["warnings"][0]
    assert len(contexts["1024"]["warnings"]) == 2 and "max_seq_len=512" in contexts["1024"]["warnings"][1]
    assert [str(w.message) for w in caught] == contexts["384"]["warnings"] + contexts["1024"]["warnings"]


def test_bad_input_names_the_path(
    exports: dict[str, Path], text_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing_text = tmp_path / "nope.txt"
    assert ev.main(["--model", str(exports["vort"]), "--data", str(missing_text)]) == 2
    assert str(missing_text) in capsys.readouterr().err
    missing_model = tmp_path / "no_export"
    assert ev.main(["--model", str(missing_model), "--data", str(text_file)]) == 2
    assert str(missing_model) in capsys.readouterr().err
    not_export = tmp_path / "empty"
    not_export.mkdir()
    assert ev.main(["--model", str(not_export), "--data", str(text_file)]) == 2
    assert str(not_export / "config.json") in capsys.readouterr().err
    with pytest.raises(ev.EvalError, match="--tasks"):
        ev.evaluate(exports["vort"], [str(text_file)], [256], tasks=["sorting"])
    with pytest.raises(ev.EvalError, match="--task-len"):
        ev.evaluate(exports["vort"], [str(text_file)], [256], tasks=["copy"], task_len=16)


def test_sentencepiece_export_reports_bits_per_character(text_file: Path, tmp_path: Path) -> None:
    """A tokenized model: the tokenizer travels with its sha256 and evaluation reports bits per
    token and per character."""
    from data_pipeline.tokenizer import train_sentencepiece

    tok = train_sentencepiece([str(BOOK)], 512, str(tmp_path / "sp"), sample_bytes=200_000)
    tree = yaml.safe_load((REPO / "configs" / "model" / "vort-tiny.yaml").read_text())
    tree["model"]["vocab_size"] = tok.vocab_size
    tree["data"] = {"tokenizer": tok.model}
    cfg = config_from_dict(tree)
    out = write_export(build_model(cfg.model), cfg, tmp_path / "export")
    info = json.loads((out / ev.TOKENIZER_JSON).read_text())
    assert info["kind"] == "sentencepiece" and info["sha256"] == tok.sha256
    assert (out / info["file"]).read_bytes() == Path(tok.model).read_bytes()

    report = ev.evaluate(out, [str(text_file)], [128], chunk=50)
    result = report["contexts"]["128"]
    assert report["tokenizer"] == "sentencepiece" and "bits_per_byte" not in result
    chars_per_token = 3000 / report["text_tokens"]  # the excerpt is ASCII: one byte per character
    assert result["bits_per_character"] == pytest.approx(result["bits_per_token"] / chars_per_token)

    (out / info["file"]).write_bytes(b"not the model")
    with pytest.raises(ev.EvalError, match=r"tokenizer\.model"):
        ev.evaluate(out, [str(text_file)], [128])
