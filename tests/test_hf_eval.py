"""Exports used as they are by transformers and lm-evaluation-harness: AutoTokenizer gives the data
pipeline's ids, generate() carries the recurrent state and equals a loop over the full forward,
and lm_eval's three request types run on the project's tasks and match the project's scoring."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from data_pipeline.tokenizer import Tokenizer, load_tokenizer, train_sentencepiece
from model import build_model
from pretrain.config import config_from_dict
from pretrain.evaluate import text as ev
from pretrain.export import load_exported, write_export

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "data" / "demo" / "train" / "macbeth.txt"
TASKS = REPO / "pretrain" / "evaluate" / "lm_eval_tasks"
TEXTS = [
    "hello world",
    "héllo wörld ✓ 日本語 🙂",
    "",
    "  leading and trailing spaces  ",
    "lines\nwith\r\nbreaks\n\n\tand tabs\n",
    "strings that look special: </s> <eos> <pad> <s> <unk>",
    BOOK.read_text()[:2000],
]
INVALID_UTF8 = [b"ab\xff\xfe c\xc3", b"\x80", b"ok\xe2\x82"]


@pytest.fixture(autouse=True)
def _offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network for transformers, datasets or lm_eval; remote code goes to a temporary cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path_factory.getbasetemp() / "hf_modules"))


def _export(root: Path, family: str, tokenizer: Tokenizer | None = None) -> Path:
    tree = yaml.safe_load((REPO / "configs" / "model" / f"{family}-tiny.yaml").read_text())
    if tokenizer is not None:
        tree["model"]["vocab_size"] = tokenizer.vocab_size
        tree["data"] = {"tokenizer": tokenizer.model}
    cfg = config_from_dict(tree)
    torch.manual_seed(0)
    return write_export(build_model(cfg.model), cfg, root / family)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untrained tiny byte-level exports, and a VORT with a sentencepiece tokenizer."""
    root = tmp_path_factory.mktemp("exports")
    found = {family: _export(root, family) for family in ("vort", "pmnet", "transformer")}
    sp = train_sentencepiece([str(BOOK)], 400, str(root / "sp"), sample_bytes=200_000)
    found["sentencepiece"] = _export(root / "sp_export", "vort", sp)
    return found


def _auto_tokenizer(export_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(export_dir), trust_remote_code=True)


def _hf_model(export_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(export_dir), trust_remote_code=True).eval()


@pytest.mark.parametrize("kind", ["vort", "sentencepiece"])
def test_auto_tokenizer_equals_project_tokenizer(exports: dict[str, Path], kind: str) -> None:
    export_dir = exports[kind]
    own = ev.load_export_tokenizer(export_dir)
    assert own.kind == ("bytes" if kind == "vort" else "sentencepiece")
    tok = _auto_tokenizer(export_dir)
    assert type(tok).__module__.startswith("transformers_modules.")
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (own.eos_id, own.pad_id, None)
    assert len(tok) == own.vocab_size

    for text in TEXTS:
        ids = own.encode(text.encode())[0].tolist()
        assert tok.encode(text) == ids, text
        assert tok(text)["input_ids"] == ids  # no special tokens added around a text
        assert tok.decode(ids) == own.decode(ids)
        if own.kind == "bytes":
            assert tok.decode(ids) == text  # bytes are lossless
    for raw in INVALID_UTF8:  # a str decoded with surrogateescape carries the invalid bytes through
        ids = own.encode(raw)[0].tolist()
        assert tok.encode(raw.decode("utf-8", errors="surrogateescape")) == ids
        assert tok.decode(ids) == own.decode(ids)
    if own.kind == "bytes":
        assert tok.decode([0xFF, 0x41]) == "\ufffdA"

    ids = own.encode(b"two docs")[0].tolist()
    with_eos = [*ids[:3], own.eos_id, *ids[3:]]
    assert tok.decode(with_eos, skip_special_tokens=True) == own.decode(with_eos)
    assert tok.decode(with_eos) == own.decode(ids[:3]) + tok.eos_token + own.decode(ids[3:])
    batch = tok(["ab", "abcd"], padding="longest")
    assert batch["input_ids"][0][-1] == own.pad_id and batch["attention_mask"][0][-1] == 0


def _generate(model: torch.nn.Module, prompt: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, list[int]]:
    """generate()'s output and the length of the input_ids of each forward call it made."""
    lengths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda _module, _args, inputs: lengths.append(inputs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        return model.generate(prompt, **kwargs), lengths
    finally:
        handle.remove()


def _reference(model: torch.nn.Module, prompt: torch.Tensor, steps: int, temperature: float | None) -> torch.Tensor:
    """Next tokens from the full forward over the growing sequence (no state; the transformers
    wrapper or the project's CausalLM); sampling draws from softmax(logits / temperature) with
    torch.multinomial, as transformers does."""
    seq = prompt
    with torch.no_grad():
        for _ in range(steps):
            logits = model(seq).logits[:, -1].float()
            if temperature is None:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)
            seq = torch.cat([seq, nxt], 1)
    return seq


@pytest.mark.parametrize("family", ["vort", "pmnet", "transformer"])
def test_generate_equals_full_forward_loop(exports: dict[str, Path], family: str) -> None:
    """Greedy and sampled generate() give the tokens of a loop over the full forward; a recurrent
    model (VORT; PMNet, whose state also holds its attention window) is fed the prompt once and
    then one token per step, the Transformer baseline (no KV cache in its state) the whole
    sequence each step."""
    hf = _hf_model(exports[family])
    prompt = torch.tensor([list(b"It is a truth universally acknowledged that a single man" * 2)])  # > PMNet's window
    steps = 12
    greedy, lengths = _generate(hf, prompt, max_new_tokens=steps, do_sample=False)
    n = prompt.shape[1]
    assert lengths == ([n] + [1] * (steps - 1) if family != "transformer" else list(range(n, n + steps)))
    assert torch.equal(greedy, _reference(hf, prompt, steps, None))

    torch.manual_seed(7)
    sampled = hf.generate(prompt, max_new_tokens=steps, do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    torch.manual_seed(7)
    assert torch.equal(sampled, _reference(hf, prompt, steps, 0.7))
    assert len(set(sampled[0, prompt.shape[1] :].tolist())) > 2  # a real draw, not a constant

    with pytest.raises(ValueError, match="beam search"):
        hf.generate(prompt, max_new_tokens=2, num_beams=2)
    with pytest.raises(ValueError, match="padding"):
        hf.generate(torch.cat([prompt, prompt]), attention_mask=torch.ones(2, prompt.shape[1]).tril(), max_new_tokens=2)


def _project_loglikelihood(model: torch.nn.Module, tok: Tokenizer, context: str, answer: str) -> tuple[float, bool]:
    """Sum of log p(answer tokens | context) from the project's own model, and whether the answer is its argmax."""
    ctx = tok.encode(context.encode())[0].tolist()
    ids = torch.tensor([ctx + tok.encode((context + answer).encode())[0].tolist()[len(ctx) :]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), -1)[len(ctx) - 1 :]
    target = ids[0, len(ctx) :]
    return float(logp.gather(1, target[:, None]).sum()), bool(torch.equal(logp.argmax(-1), target))


def _project_rolling(model: torch.nn.Module, tok: Tokenizer, text: str, window: int) -> float:
    """Log-likelihood of `text` as lm_eval's rolling requests score it: disjoint spans of `window`
    tokens, each from a fresh state after one token of context (EOS before the first); the last,
    shorter span is read with the `window` tokens before its end as context."""
    ids = tok.encode(text.encode())[0].tolist()
    before = [tok.eos_id, *ids]  # before[k] is the token preceding ids[k]
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids), window):
            end = min(start + window, len(ids))
            logits = model(torch.tensor([before[max(0, end - window) : end]])).logits[0, -(end - start) :]
            logp = torch.log_softmax(logits.double(), -1)
            total += float(logp.gather(1, torch.tensor(ids[start:end])[:, None]).sum())
    return total


def test_lm_eval_runs_project_tasks_and_matches_project_scoring(exports: dict[str, Path], tmp_path: Path) -> None:
    """simple_evaluate with the hf model on the export: a loglikelihood task (copy), a
    loglikelihood_rolling task (bits per byte) and a generate_until task (needle), all from local data."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    text_file = tmp_path / "excerpt.txt"
    text_file.write_text(BOOK.read_text()[:1500])
    metadata = {"length": 256, "examples": 3, "text_files": [str(text_file)]}
    window = 512
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(exports["vort"]), "trust_remote_code": True, "max_length": window},
        tasks=["recurrent_copy", "recurrent_bpb", "recurrent_needle_gen"],
        task_manager=TaskManager(include_path=str(TASKS), metadata=metadata),
        metadata=metadata,
        device="cpu",
        batch_size=1,
        log_samples=True,
    )
    for task, metrics in results["results"].items():
        numbers = [v for k, v in metrics.items() if "," in k and isinstance(v, float)]
        assert numbers and all(math.isfinite(v) for v in numbers), (task, metrics)

    model = load_exported(exports["vort"])
    tok = load_tokenizer("bytes")
    copies = results["samples"]["recurrent_copy"]
    assert len(copies) == 3
    answer_bits = []
    for sample in copies:
        (context, answer), (ll, greedy) = sample["arguments"][0], sample["resps"][0][0]
        expected_ll, expected_greedy = _project_loglikelihood(model, tok, context, answer)
        assert ll == pytest.approx(expected_ll, rel=1e-5) and greedy == expected_greedy
        answer_bits.append(-expected_ll / math.log(2) / len(answer.encode()))
    copy_metrics = results["results"]["recurrent_copy"]
    assert copy_metrics["answer_bits_per_byte,none"] == pytest.approx(sum(answer_bits) / 3, rel=1e-5)

    (rolling,) = results["samples"]["recurrent_bpb"]
    text = text_file.read_text()
    assert rolling["resps"][0][0] == pytest.approx(_project_rolling(model, tok, text, window), rel=1e-5)
    bits = -rolling["resps"][0][0] / math.log(2) / len(text.encode())
    assert results["results"]["recurrent_bpb"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-6)

    for sample in results["samples"]["recurrent_needle_gen"]:
        context = sample["arguments"][0][0]
        prompt = torch.tensor([tok.encode(context.encode())[0].tolist()])
        new = _reference(model, prompt, 8, None)[0, prompt.shape[1] :].tolist()
        expected = tok.decode(new[: new.index(tok.eos_id)] if tok.eos_id in new else new)
        for stop in ("\n", "."):
            expected = expected.split(stop)[0]
        assert sample["resps"][0][0] == expected
