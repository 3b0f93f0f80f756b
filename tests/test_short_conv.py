"""model.short_conv: the causal depthwise convolution before every family's mixer, and each path it
is carried through (streaming state, activation checkpointing, the exported transformers model),
each against the whole-sequence forward. Sequence parallelism and train.carry_state are in
tests/test_sequence_parallel.py and tests/test_carry_state.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

from model import build_model
from model.blocks import ShortConvolution
from model.config import ModelConfig, PMNetConfig, VortConfig
from pretrain.config import ConfigError, config_from_dict, load_config
from pretrain.export import write_export
from pretrain.validate import stream_logits
from tests.test_hf_eval import _generate, _hf_model, _reference

REPO = Path(__file__).resolve().parents[1]
VORT = VortConfig(n_features=8, n_banks=2, soe_horizon=256, chunk_size=8, probe_rank=4, probe_classes=8)
PMNET = PMNetConfig(window=8, branching=2, depth=2, memory_dim=8, segment_len=16)
FAMILIES = {
    kind: ModelConfig(kind=kind, d_model=32, n_layers=2, n_heads=2, max_seq_len=256, short_conv=4, vort=VORT,
                      pmnet=PMNET)
    for kind in ("transformer", "vort", "pl", "exp", "m5", "pmnet")
}
FAMILIES["swa"] = dataclasses.replace(FAMILIES["pmnet"], pmnet=dataclasses.replace(PMNET, memory_every=0))
RECURRENT = [k for k in FAMILIES if k != "transformer"]


def test_convolution_is_the_causal_weighted_sum_and_streams() -> None:
    torch.manual_seed(0)
    conv = ShortConvolution(6, 3)
    x = torch.randn(2, 10, 6)
    y, tail = conv(x, None)
    w = conv.conv.weight[:, 0]  # [channels, K]: w[:, -1] weighs the current token
    padded = torch.cat((torch.zeros(2, 2, 6), x), 1)
    expected = sum(padded[:, j : j + 10] * w[:, j] for j in range(3))
    torch.testing.assert_close(y, expected)
    assert torch.equal(tail, x[:, -2:])
    pieces, state = [], conv.init_state(2)
    for a, b in ((0, 1), (1, 2), (2, 7), (7, 10)):  # pieces shorter and longer than the tail
        out, state = conv(x[:, a:b], state)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), y)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_every_family_uses_it_causally(kind: str) -> None:
    """The convolution is in every block and changes the output; a later token changes nothing before it."""
    torch.manual_seed(0)
    model = build_model(FAMILIES[kind]).eval()
    assert all(isinstance(b.short_conv, ShortConvolution) for b in model.blocks)
    assert all(b.short_conv is None for b in build_model(dataclasses.replace(FAMILIES[kind], short_conv=0)).blocks)
    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        changed = ids.clone()
        changed[:, 11] = (changed[:, 11] + 1) % 258
        after = model(changed).logits
        assert torch.equal(after[:, :11], logits[:, :11]) and not torch.equal(after[:, 11:], logits[:, 11:])
        for block in model.blocks:
            block.short_conv.conv.weight.zero_()
        assert not torch.allclose(model(ids).logits, logits)


@pytest.mark.parametrize("kind", RECURRENT)
def test_streaming_pieces_equal_the_whole(kind: str) -> None:
    """generate() and pretrain.evaluate feed a sequence piecewise with the carried state: the
    convolution's last K-1 inputs travel in it, so the pieces give the whole sequence's logits."""
    torch.manual_seed(0)
    model = build_model(FAMILIES[kind]).eval()
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model(ids).logits
        streamed = torch.cat([logits for _, logits in stream_logits(model, ids, 7)], 1)
        state, pieces = model.init_state(2), []
        for a, b in ((0, 1), (1, 3), (3, 4), (4, 40)):  # pieces shorter than K-1 = 3 as well
            logits, state = model(ids[:, a:b], state)
            pieces.append(logits)
    torch.testing.assert_close(streamed, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["transformer", "vort", "pmnet"])
def test_activation_checkpointing_gives_the_same_gradients(kind: str) -> None:
    torch.manual_seed(0)
    model = build_model(FAMILIES[kind]).train()
    ids = torch.randint(0, 258, (2, 33), generator=torch.Generator().manual_seed(3))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert any("short_conv" in n for n in grads[0])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["vort", pytest.param("pmnet", marks=pytest.mark.slow), "transformer"])
def test_exported_model_gives_the_logits_and_generates_as_the_forward_loop(
    family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    tree = yaml.safe_load((REPO / "configs" / "model" / f"{family}-tiny.yaml").read_text())
    tree["model"]["short_conv"] = 3
    cfg = config_from_dict(tree)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    hf = _hf_model(write_export(model, cfg, tmp_path / family))
    assert all(b.short_conv is not None for b in hf.lm.blocks)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, model(ids).logits)
    greedy, lengths = _generate(hf, ids, max_new_tokens=6, do_sample=False)
    assert lengths[1:] == ([1] * 5 if family != "transformer" else list(range(41, 46)))
    assert torch.equal(greedy, _reference(hf, ids, 6, None))


def test_config_default_is_off_and_negative_sizes_are_refused() -> None:
    assert ModelConfig().short_conv == 0
    assert load_config(REPO / "configs" / "tiny.yaml").model.short_conv == 0
    with pytest.raises(ConfigError, match=r"model\.short_conv"):
        load_config(REPO / "configs" / "tiny.yaml", ["model.short_conv=-1"])
