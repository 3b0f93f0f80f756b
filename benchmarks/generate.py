"""Time and memory per generated token of an export's transformers generate(), against prompt length.

    python -m benchmarks.generate --model <export dir> --prompt 1024,65536 --new-tokens 64 [--json out.json]

The export is loaded the way a user loads it (AutoModelForCausalLM, trust_remote_code); each prompt
is the first tokens of --text (repeated if shorter). Greedy decoding; a logits processor stamps
the time and the process's RSS at every step, so the per-token time is the gap between two steps
(forward of one token with the state, plus the argmax) and the RSS growth is from the second step
to the last (at the first, the prompt's logits are still held).
The state's size is measured after the prompt and after the prompt plus the new tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]


def state_bytes(state: Any) -> int:
    """Bytes held by the tensors of a (nested) recurrent state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):  # NamedTuple states included
        return sum(state_bytes(v) for v in state)
    return 0


class StepClock:
    """A logits processor that records the time and RSS at each generation step (changes nothing)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.rss: list[int] = []
        self._process = psutil.Process()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        self.rss.append(self._process.memory_info().rss)
        return scores


def measure(model: Any, tokenizer: Any, text: str, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    from transformers import LogitsProcessorList

    ids = tokenizer.encode(text)
    ids = (ids * (prompt_len // max(1, len(ids)) + 1))[:prompt_len]
    prompt = torch.tensor([ids])
    clock = StepClock()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([clock]),
        )
        gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
        after_prompt = model(prompt).state
        after_all = model(out).state
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": out.shape[1] - prompt_len,
        "prefill_s": clock.times[0] - started,
        "ms_per_token_median": 1e3 * statistics.median(gaps),
        "ms_per_token_max": 1e3 * max(gaps),
        "decode_rss_growth_mib": (clock.rss[-1] - clock.rss[1]) / 2**20,
        "state_mib_after_prompt": state_bytes(after_prompt) / 2**20,
        "state_mib_after_generation": state_bytes(after_all) / 2**20,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="export directory (python -m pretrain.export)")
    parser.add_argument("--prompt", default="1024,65536", help="comma-separated prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--text", default=str(REPO / "data" / "demo" / "valid" / "northangerabbey.txt"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    rows = [measure(model, tokenizer, text, int(n), args.new_tokens) for n in args.prompt.split(",") if n.strip()]
    header = ("prompt", "new", "prefill s", "ms/token (median)", "ms/token (max)", "decode RSS growth MiB", "state MiB")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(
            f"| {r['prompt_tokens']:,} | {r['new_tokens']} | {r['prefill_s']:.2f} | {r['ms_per_token_median']:.2f} | "
            f"{r['ms_per_token_max']:.2f} | {r['decode_rss_growth_mib']:.1f} | "
            f"{r['state_mib_after_prompt']:.3f} -> {r['state_mib_after_generation']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
