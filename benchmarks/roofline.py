"""Roofline model of the scans: the replaced span kernels (before 2026-12-03) and the kernels as built,
their share of a training step, and the floors a scan cannot go below.

    python -m benchmarks.roofline [--config vort-125m,vort-350m,pmnet-119m] [--json roofline.json]

A model, not a measurement. Per config it counts, per token and layer, the FLOPs and the global-memory
bytes of each scan kernel, converts them to H100 SXM time (time = max(FLOPs / rate, bytes / 3.35 TB/s)
per kernel), and puts the scans of every layer beside the rest of a training step at 65,536 tokens
per rank:

- "span (before 2026-12-03)": the span kernels the chunk kernels replaced (they no longer exist; this
  column is kept as the before). The models handed them fp32, so every tl.dot was an fp32 IEEE product
  on CUDA cores (67 TFLOP/s). SOE: one program per (head, term, value block) read q, k, v once per term
  (S-fold) and added outputs and gradients atomically (read + write, 8 bytes per fp32 element), with
  the sm_90 blocks of benchmarks/roofline_before.py. Phasor: phasor_launches for fp32 increments with fp32 IEEE dots.
- "built": the launches a bf16 training step makes, captured from the model itself on the meta device
  (benchmarks/launch_capture.py: the grids, blocks and tensors the model's code passes) and named by
  soe_launches / phasor_launches. Per launch, ACCESS says how the kernel touches each pointer argument
  and the FLOPs come from the tl.dot shapes of its body (padded tiles, as the tensor cores run them; a
  tf32 product counts twice, at the bf16 rate), so a launch the model makes that this model does not
  know is an error, not a silent gap. The SOE walks keep their state on chip: only the span states move
  through memory. The column-block programs of one span and head are launched side by side and walk the
  same chunks together (kernels/soe/gpu/walk.py, span_program), so the tiles they all read are counted
  once (SHARED: the first program's read comes from HBM, the others' from L2; an assumption of this
  model, to be checked by the GPU script's DRAM counters). The phasor's one-hot products run as three
  tf32 dots of an exact split of the fp32 operand (_select_dot), per (entry, slot block) pair the
  entry's tree level spans (phasor_level_blocks).

Floors (SOE): the IO floor reads q, k, v and the coefficients and writes o and z in the forward, reads
them again with the output gradients and writes the input gradients in the backward, in the operands'
dtype; the FLOP floor is three times the scan's forward FLOPs as the model counts them
(VortLayer.extra_forward_flops: 4 S F (D + 1) + 2 c (F + S + D + 1) per head, c the kernels' chunk), at
the bf16 peak.

The rest of the step is its parameter matmuls, 6 FLOPs per matmul parameter per token, at
MATMUL_EFFICIENCY of the bf16 peak; attention, norms and other elementwise work are not modelled (so
the scans' share is an upper bound on that count and the step a lower bound). MFU is the model's own
`flops_per_token` (the trainer's numerator) over the modelled step time at the bf16 peak. Not counted
in the kernels: elementwise work (decays, masks, the term-weighted sums), caches beyond SHARED, launch
overheads, the sequence-parallel entering-state read (a one-piece step makes none).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.launch_capture import capture_step, meta_model
from benchmarks.predict.ops import kernel_origin
from benchmarks.roofline_before import phasor_span_before, soe_span_before
from kernels._common import Launch
from model import family
from model.config import ModelConfig, load_model_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
SEQ_LEN = 65_536  # tokens per rank
CAPABILITY = 90  # the launches of an H100
# H100 SXM, dense: bf16 and tf32 tensor cores, fp32 CUDA cores
PEAK = {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}
PEAK_BYTES = 3.35e12  # H100 SXM HBM3
MATMUL_EFFICIENCY = 0.6  # of the bf16 peak, for the parameter matmuls of the rest of the step
GOAL_SHARE, GOAL_MFU, GOAL_FLOOR = 0.25, 0.45, 2.0  # scans' share at most, MFU at least, scans / floor at most
SPAN, BUILT = "span (before 2026-12-03)", "built"



# --- the built kernels, from the launches a training step makes ---------------------------------------

# How a kernel touches each pointer argument, per launch name of soe_launches / phasor_launches (the
# kernel bodies in kernels/soe/gpu/ and kernels/phasor/triton.py say which they load and store):
ALL = "all"  # loaded whole by every column-block program: bytes x grid[1]
SHARED = "shared"  # loaded whole by every column-block program of a span, side by side: once from HBM
ONCE = "once"  # each element loaded or stored once over the programs (column-block slices)
STATE = "state"  # state slots, one per span (per chunk for the phasor's spans), read or written once
PASS = "pass"  # the sequence pass: every state slot read and written once
DOCS = "docs"  # each program loads the document numbers of its own chunk
DECAYS = "decays"  # each program loads its head's S decays
PARTIAL = "partial"  # fp32 partials: this launch's share of the buffer, then summed by torch
OUTPUT = "output"  # an fp32 output, cast by torch to the operands' dtype when that is narrower
UNUSED = "unused"  # passed but not loaded in this launch
NORM_SHARE = "norm share"  # the coefficient shares [parts, ...]: the normalisers' program writes the last
VALUE_SHARES = "value shares"  # ... and the value blocks' walks the others

_PASS = {"states": PASS, "log_lam": ONCE, "carry": ONCE}
_WALK_IN = {"coef": SHARED, "log_lam": DECAYS, "docs": SHARED}
ACCESS: dict[str, dict[str, dict[str, str]]] = {
    "soe": {
        # the forward's state walk: the S term programs of a batch x head read its k, v and documents side by
        # side, each its own coefficient column; it writes the state entering every chunk once
        "fwd_states": {"k": SHARED, "v": SHARED, "coef": ONCE, "log_lam": ONCE, "docs": SHARED, "reads": ONCE,
                       "states": STATE},
        "bwd_reads": {"k": SHARED, "v": SHARED, "coef": ONCE, "log_lam": ONCE, "docs": SHARED, "reads": ONCE,
                      "states": STATE},  # the same walk again in the backward, phase by phase
        "fwd": dict.fromkeys(("q", "k", "v", "coef"), ONCE) | {"log_lam": DECAYS, "docs": DOCS, "reads": ONCE,
                                                              "out": ONCE, "z": ONCE},
        "bwd_states": {"q": SHARED, "d_out": ONCE, "d_z": ONCE, "log_lam": DECAYS, "docs": SHARED, "states": STATE},
        # the chunk-parallel backward (decays without a gradient): the reverse state-gradient walk, then dq
        # and (dk, dv, dcoef) one program per chunk, each reading its chunk's (gradient of the) state once
        "bwd_chunk_states": {"q": SHARED, "d_out": SHARED, "d_z": SHARED, "log_lam": ONCE, "docs": SHARED,
                             "d_reads": ONCE, "d_edges": STATE},
        "bwd_chunk_queries": dict.fromkeys(("q", "k", "v", "coef"), ONCE) | {"log_lam": DECAYS, "docs": DOCS}
        | dict.fromkeys(("reads", "d_out", "d_z", "dq"), ONCE),
        **{f"bwd_chunk_{made}": dict.fromkeys(("q", "k", "v", "coef"), ONCE) | {"log_lam": DECAYS, "docs": DOCS}
           | dict.fromkeys(("d_reads", "d_out", "d_z"), ONCE)
           | {out: ONCE if out in made_grads else UNUSED for out in ("dk", "dv", "dcoef")}
           for made, made_grads in (("keys_values", ("dk", "dv")), ("coefs", ("dcoef",)))},
        "bwd_pass": _PASS,
        "bwd_queries": {"q": ONCE, "k": ONCE, "v": SHARED} | _WALK_IN | {"states": STATE, "d_out": SHARED,
                                                                        "d_z": SHARED, "dq": ONCE, "dll": PARTIAL},
        "bwd_keys": {"q": SHARED, "k": SHARED, "v": SHARED} | _WALK_IN
        | {"d_states": STATE, "d_out": SHARED, "d_z": SHARED, "dk": ONCE, "shares": NORM_SHARE},
        "bwd_values": {"q": SHARED, "k": SHARED, "v": ONCE} | _WALK_IN | {"d_states": STATE, "d_out": ONCE,
                                                                      "dv": ONCE, "shares": VALUE_SHARES},
        "bwd_coef": dict.fromkeys(("q", "k", "v", "coef"), ONCE) | {"log_lam": DECAYS, "docs": ONCE}
        | dict.fromkeys(("d_out", "d_z", "shares", "dcoef"), ONCE) | {"dll": PARTIAL},
    },
    "phasor": {
        "fwd_spans": {"values": ONCE, "slots": ALL, "docs": ALL, "states": STATE},
        "fwd_pass": {"states": PASS, "log_lam": UNUSED, "carry": ONCE},
        "fwd": {"delta": ONCE, "slots": ALL, "docs": ALL, "states": STATE, "read": OUTPUT},
        "bwd_spans": {"values": ONCE, "slots": ALL, "docs": ALL, "states": STATE},
        "bwd_pass": {"states": PASS, "log_lam": UNUSED, "carry": ONCE},
        "bwd": {"d_read": ONCE, "slots": ALL, "docs": ALL, "d_states": STATE, "d_delta": OUTPUT},
    },
}  # fmt: skip


def _column_programs(name: str, c: dict, named: dict) -> int:
    """Programs of an SOE walk per span x batch x head: its column blocks, plus the normalisers' program
    of the output and key-gradient launches."""
    block = c.get("BD") or c["BC"]
    return -(-(named["DV"] if "BD" in c else named["F"]) // block) + (name in ("fwd", "bwd_keys"))


def _soe_flops(name: str, c: dict, named: dict) -> int:
    """tl.dot FLOPs on one chunk of one SOE program (chunk-parallel kernels) or of all the column
    programs of one span x batch x head (walks), padded tiles as the tensor cores run them, from the
    kernel bodies; a tf32 product (the decay table's, with fp32 operands) counts twice, so that all run
    at the bf16 rate. Walks: per term group a read X @ A^T and a write X += B^T @ A over the group's
    rows (terms x column block), the normalisers' [GN, R] tile in the state walks, and the intra-chunk
    products (scores, the kernel matrix R = E^T @ coef^T, its product with the values or gradients)."""
    bt, gn = c["BT"], c.get("GN", 0)
    block = c.get("BD") or c.get("BC") or 0
    rows = (c.get("GA", 0) + c.get("GB", 0) * c.get("HAS_B", False)) * block  # the groups' state rows
    cols = c.get("BF") if "BD" in c else c.get("BV")  # the state tiles' other side
    n_blocks = _column_programs(name, c, named) - (name in ("fwd", "bwd_keys")) if block else 0
    mask = 2 * 2 * bt * gn * bt  # R = E^T @ coef^T in tf32
    walk = 2 * bt * bt * cols + mask + 2 * bt * bt * block + 2 * 2 * rows * cols * bt  # intra part, read, write
    if name in ("fwd_states", "bwd_reads", "bwd_chunk_states"):  # one term's write (or its gradient's),
        return 2 * bt * c["BF"] * (c["BD"] + 16 * c.get("NORMS_BY_PRODUCT", False))  # the normalisers' product
    if name == "bwd_chunk_queries":  # dO V^T, (dP * Wc) K, the kernel matrix, a read per term
        return 2 * bt * bt * (c["BF"] + c["BD"]) + mask + named["S"] * 2 * bt * c["BF"] * c["BD"]
    if name in ("bwd_chunk_keys_values", "bwd_chunk_coefs"):
        # dO V^T and the kernel matrix; the scores for dv or dcoef; dk = (dP * Wc)^T Q and V dH_s^T per
        # term; dv = (S * Wc)^T dO and K dH_s per term; dcoef: the pairs spread by the decay table, and
        # K dH_s per term unless dv made it
        keys, values, coefs = c["KEYS"], c["VALUES"], c["COEFS"]
        per_term = named["S"] * 2 * bt * c["BF"] * c["BD"]
        common = 2 * bt * bt * c["BD"] + mask + (values or coefs) * 2 * bt * bt * c["BF"]
        return (common + keys * (2 * bt * bt * c["BF"] + per_term) + values * (2 * bt * bt * c["BD"] + per_term)
                + coefs * (mask + (not values) * per_term))
    if name == "bwd_states":
        return n_blocks * 2 * bt * cols * (rows + gn)
    if name == "fwd":  # scores, kernel matrix, its product with the values, one read per term
        return 2 * bt * bt * (c["BF"] + c["BD"]) + mask + named["S"] * 2 * bt * c["BF"] * c["BD"]
    if name in ("bwd_values", "bwd_queries"):
        return n_blocks * walk
    if name == "bwd_keys":  # the feature blocks' walks and the normalisers' (with the pairs: scores, spread)
        pairs = c["PAIRS"] * (2 * bt * bt * (c["BV"] + c["BF"]) + 2 * 2 * bt * bt * gn)
        return n_blocks * walk + 2 * 2 * gn * c["BF"] * bt + pairs
    if name == "bwd_coef":
        return c["NEED_DLL"] * (2 * bt * bt * (c["BV"] + c["BF"]) + 2 * mask)
    return 0


def _phasor_flops(name: str, c: dict, level_blocks: int) -> int:
    """tl.dot FLOPs of one phasor chunk in one column block over its ``level_blocks`` (level, slot
    block) pairs: each one-hot product is three tf32 dots (_select_dot); the span sums do
    onehot^T @ rows, the reads and the backward also same-slot @ rows, onehot @ state and the state
    update."""
    bt, bm, bn = c["BT"], c["BM"], c["BN"]
    per_level = {"fwd_spans": 2 * bn * bt * bm, "bwd_spans": 2 * bn * bt * bm,
                 "fwd": 2 * bt * bt * bm + 4 * bt * bn * bm, "bwd": 2 * bt * bt * bm + 4 * bt * bn * bm}
    return 3 * level_blocks * per_level.get(name, 0)


def phasor_level_blocks(entries: int, n_slots: int, block: int) -> int:
    """The (entry, slot block) pairs a phasor chunk computes: the kernels skip a slot block for an entry
    none of whose chunk tokens routes into it, so an entry costs the blocks its tree level's slots span
    (all of them: 16 tokens route into every block of a wide level almost surely). The levels come from
    PMNet's layout (model/pmnet_memory.py ``_entries``): a full tree of branching N and depth D has
    (N^(D+1) - 1) / (N - 1) slots, and a token's entries are its path (D + 1) or the root and every
    child of each node on the path (1 + D * N). ValueError for sizes no such tree gives."""
    for branching in range(2, n_slots):
        starts = [0]
        while starts[-1] < n_slots:
            starts.append(starts[-1] + branching ** (len(starts) - 1))
        if starts[-1] != n_slots:
            continue
        depth = len(starts) - 2
        spans = [(hi - 1) // block - lo // block + 1 for lo, hi in itertools.pairwise(starts)]
        if entries == depth + 1:
            return sum(spans)
        if entries == 1 + depth * branching:
            return spans[0] + branching * sum(spans[1:])
    raise ValueError(f"no full tree has {n_slots} slots and {entries} scan entries per token")


def launch_names(scan: str, captured: Sequence[tuple[Launch, tuple]]) -> list[str]:
    """The soe_launches / phasor_launches name of each captured launch, rebuilt from its arguments'
    sizes (a sequence pass from those of the chunk launch before it); ValueError for a launch that the
    launch functions do not make: a kernel this model does not know."""
    from kernels.phasor.triton import phasor_launches
    from kernels.soe.gpu.launches import soe_launches

    names, made = [], {}
    for launch, args in captured:
        named = launch.arguments(args)
        if scan == "soe" and "S" in named:
            x = next(named[n] for n in ("q", "x", "k") if n in named)
            b, t, h, f = x.shape
            made = {}  # both backwards: the walks (decays with a gradient) and the chunk-parallel one; 16: any
            # requested chunk gives the walks' chunk of 16 tokens (launches.chunk_block); the scan's fast terms
            # and resets as the launch says them (its walks' FAST; RESETS), where it says them
            options = {"fast_terms": launch.constexprs.get("FAST", 0), "resets": launch.constexprs.get("RESETS", True)}
            for decay_grad in (True, False):
                made |= soe_launches(b, t, h, named["S"], f, named["DV"], 16, x.dtype, CAPABILITY, decay_grad,
                                     **options)[1]
        elif scan == "phasor" and "L" in named:
            values = args[0]  # the increments or their read gradients, [B, T, levels, width]
            b, t, levels, width = values.shape
            made = phasor_launches(b, t, levels, width, named["NS"], values.dtype, CAPABILITY)[1]
        found = [n for n, m in made.items() if dataclasses.replace(m, grid=launch.grid) == launch]  # phases: grids
        if not found:
            raise ValueError(f"{scan}: the step launches {launch.kernel.__name__} with {launch.constexprs}, which "
                             "the launch functions do not make at its sizes")
        names.append(found[0])
    return names


def pointer_bytes(mode: str, t: torch.Tensor, launch: Launch, sharers: Counter) -> float:
    """Global-memory bytes a launch moves through the pointer argument ``t`` touched as ``mode`` (one
    of ACCESS's modes)."""
    nbytes = t.numel() * t.element_size()
    if mode in (ONCE, OUTPUT):
        return nbytes
    if mode in (STATE, PASS):
        return nbytes * (2 if mode == PASS else 1)
    if mode == ALL:
        return nbytes * launch.grid[1]
    if mode == SHARED:
        return nbytes
    if mode == DOCS:
        return launch.programs * launch.constexprs["BT"] * t.element_size()
    if mode == DECAYS:
        return launch.programs * t.shape[-1] * t.element_size()
    if mode == PARTIAL:
        return nbytes / sharers[id(t)]
    if mode in (NORM_SHARE, VALUE_SHARES):
        return nbytes / t.shape[0] * (1 if mode == NORM_SHARE else t.shape[0] - 1)
    return 0.0  # UNUSED


def _phase_share(t: torch.Tensor, named: dict, launch: Launch) -> float:
    """The share of a per-token tensor ([B, T, ...]) that one phase of the SOE chunk kernels (a launch with
    a first chunk C0) touches: its chunks' tokens; 1 for every other tensor and launch."""
    if "C0" not in named or t.dim() < 2 or t.shape[1] != named["seq_len"]:
        return 1.0
    bt, n_chunks = launch.constexprs["BT"], -(-named["seq_len"] // launch.constexprs["BT"])
    chunks = min(named["N"], n_chunks - named["C0"]) if "N" in named else launch.programs // named["BH"]
    return min(1.0, chunks * bt / named["seq_len"])


def launch_cost(scan: str, name: str, launch: Launch, args: tuple, sharers: Counter) -> tuple[float, float, str]:
    """(tl.dot FLOPs, global-memory bytes, rate) of one captured launch: bytes from its arguments' sizes
    and ACCESS (ValueError where ACCESS does not name exactly the launch's pointers); ``sharers`` counts
    the launches writing each partial buffer."""
    access = ACCESS[scan].get(name)
    if access is None or access.keys() != launch.pointers.keys():
        known = "nothing" if access is None else sorted(access)
        raise ValueError(f"{scan} {name}: ACCESS names {known}, the launch takes {sorted(launch.pointers)}")
    named, c = launch.arguments(args), launch.constexprs
    if name == "bwd_coef" and not c["NEED_DLL"]:  # the shares' sum alone (the pairs are in the shares)
        access = {p: mode if p in ("shares", "dcoef", "docs") else UNUSED for p, mode in access.items()}
    traffic = sum(pointer_bytes(mode, named[p], launch, sharers) * _phase_share(named[p], named, launch)
                  for p, mode in access.items())  # fmt: skip
    if scan == "phasor":  # programs x the chunks of a span (spans are whole chunks): every chunk once
        if "L" not in named:  # a sequence pass: no products
            return 0, traffic, "tf32"
        slot_blocks = -(-named["NS"] // c["BN"])
        chunks = launch.grid[0] * (launch.grid[1] // slot_blocks) * -(-named["seq_len"] // c["BT"])
        level_blocks = phasor_level_blocks(named["L"], named["NS"], c["BN"])
        return chunks * _phasor_flops(name, c, level_blocks), traffic, "tf32"
    if "S" not in named:  # a span pass: no products
        return 0, traffic, "bf16"
    n_chunks = -(-named["seq_len"] // c["BT"])
    if "SPAN" in named:  # a walk: the column programs of a span x batch x head cover its chunks once
        spans = launch.programs // _column_programs(name, c, named) // named["BH"]
        chunks = named["BH"] * min(spans * named["SPAN"], n_chunks)
    elif "N" in named:  # a chunk walk per batch x head x term (x state block) over a phase's chunks
        chunks = launch.programs * min(named["N"], n_chunks - named["C0"])
    else:  # chunk parallel
        chunks = launch.programs
    return chunks * _soe_flops(name, c, named), traffic, "fp32" if c.get("PRECISION") == "ieee" else "bf16"


def torch_sums(scan: str, captured: Sequence[tuple[Launch, tuple]], names: Sequence[str]) -> tuple[int, float]:
    """(tensors, bytes) of the torch work on the kernels' outputs: each partial buffer summed over its
    first axis (function.py: ``dq.sum(0)`` ...), then the sums and the fp32 outputs cast to the
    operands' dtype where that is narrower than fp32."""
    operand = min(a.element_size() for _, args in captured for a in args
                  if isinstance(a, torch.Tensor) and a.is_floating_point())  # fmt: skip
    seen, traffic = set(), 0.0
    for (launch, args), name in zip(captured, names):
        for pointer, t in zip(launch.argument_names(), args):
            mode = ACCESS[scan][name].get(pointer)
            if mode not in (PARTIAL, OUTPUT) or id(t) in seen:
                continue
            seen.add(id(t))
            out = t.numel() * t.element_size()
            if mode == PARTIAL:
                traffic += out + out / t.shape[0]  # read the partials, write their sum
                out /= t.shape[0]
            if operand < 4:
                traffic += out + out * operand / 4
    return len(seen), traffic


DESIGNS = (SPAN, BUILT)
"""The designs modelled: the replaced span kernels (analytic) and the launches as built (captured)."""

_MODELS: dict[str, torch.nn.Module] = {}


def _meta_model(cfg: ModelConfig) -> torch.nn.Module:
    """The config's bf16 Triton-backend model on the meta device, built once per config."""
    key = repr(cfg)
    if key not in _MODELS:
        _MODELS[key] = meta_model(cfg)
    return _MODELS[key]


def built_rows(cfg: ModelConfig, scan: str, seq_len: int = SEQ_LEN) -> tuple[list[dict], int, tuple]:
    """(rows, scan layers, captured launches) of one training step of ``cfg`` at batch 1 x ``seq_len``
    on an H100, per kernel name: runs per layer, FLOPs and bytes per token and layer over those runs,
    the rate its dots run at; then torch's sums and casts of the partials and outputs."""
    model = _meta_model(cfg)
    captured = [(launch, args) for launch, args in capture_step(model, 1, seq_len, CAPABILITY)
                if kernel_origin(launch.kernel) == "kernels"]  # the scans' (not the fused feature map's)
    names = launch_names(scan, captured)
    layers = sum(  # a layer's forward starts at chunk 0 (the SOE forward runs in phases of chunks)
        1 for (launch, args), name in zip(captured, names)
        if name == "fwd" and launch.arguments(args).get("C0", 0) == 0
    )
    sharers = Counter(
        id(a) for (launch, args), name in zip(captured, names)
        for p, a in zip(launch.argument_names(), args) if ACCESS[scan][name].get(p) == PARTIAL
    )  # fmt: skip
    rows: dict[str, dict] = {}
    for (launch, args), name in zip(captured, names):
        flops, traffic, rate = launch_cost(scan, name, launch, args, sharers)
        row = rows.setdefault(name, {"kernel": f"{scan}_{name}", "runs": 0, "flops": 0.0, "bytes": 0.0, "rate": rate})
        row["runs"], row["flops"], row["bytes"] = row["runs"] + 1, row["flops"] + flops, row["bytes"] + traffic
    sums, traffic = torch_sums(scan, captured, names)
    if traffic:  # (fp32 partials and outputs of fp32 operands need no cast)
        rows["torch_sums"] = {"kernel": f"{scan}_torch_sums", "runs": sums, "flops": 0.0, "bytes": traffic,
                              "rate": "fp32"}
    tokens = seq_len * layers
    return [r | {"runs": r["runs"] / layers, "flops": r["flops"] / tokens, "bytes": r["bytes"] / tokens}
            for r in rows.values()], layers, tuple(captured)  # fmt: skip


def soe_floors(captured: Sequence[tuple[Launch, tuple]]) -> tuple[float, float]:
    """(IO floor bytes, FLOP floor) per token and layer of the SOE scan a step launches (module docstring),
    from the sizes of its first output launch: operands in their dtype, the kernels' chunk."""
    launch, args = next((launch, args) for launch, args in captured if "out" in launch.pointers)
    named = launch.arguments(args)
    heads, n_terms, feat, width = named["H"], named["S"], named["F"], named["DV"]
    size = named["q"].element_size()
    io = heads * size * (6 * feat + 5 * width + 3 * n_terms + 2)
    forward = 4 * n_terms * feat * (width + 1) + 2 * launch.constexprs["BT"] * (feat + n_terms + width + 1)
    return io, 3 * heads * forward


def kernel_rows(cfg: ModelConfig, design: str, seq_len: int = SEQ_LEN) -> tuple[list[dict], int]:
    """(per-kernel rows, scan layers) of one training step's scans in ``design``: each row's runs per
    layer, FLOPs and bytes per token and layer, and the rate (a key of PEAK) its products run at."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {sorted(DESIGNS)}, got {design!r}")
    scan = family(cfg.kind).scan_shape(cfg)
    if scan is None:
        raise ValueError(f"model.kind={cfg.kind!r} with these settings has no scan to model")
    if design != SPAN:
        return built_rows(cfg, scan.kernel, seq_len)[:2]
    model = _meta_model(cfg)
    layers = len(model.memories()) if hasattr(model, "memories") else cfg.n_layers
    before = soe_span_before if scan.kernel == "soe" else phasor_span_before
    costs = before(scan.sizes, seq_len)
    return [{"kernel": k, "runs": 1, "flops": f, "bytes": b, "rate": "fp32"} for k, (f, b) in costs.items()], layers


def _seconds(flops: float, traffic: float, rate: str) -> float:
    return max(flops / PEAK[rate], traffic / PEAK_BYTES)


def step_model(name: str, cfg: ModelConfig, design: str, seq_len: int = SEQ_LEN) -> dict:
    """The modelled training step of ``cfg`` at ``seq_len`` tokens per rank with the scans in ``design``:
    per-kernel rows, the scans' share and MFU and, for the SOE scan as built, its floors."""
    rows, layers = kernel_rows(cfg, design, seq_len)
    model = _meta_model(cfg)
    kernels = []
    for r in rows:
        seconds = _seconds(r["flops"], r["bytes"], r["rate"]) * seq_len * layers
        compute_bound = r["flops"] / PEAK[r["rate"]] >= r["bytes"] / PEAK_BYTES
        kernels.append({"kernel": r["kernel"], "runs": r["runs"], "rate": r["rate"],
                        "flops_per_token_layer": r["flops"], "bytes_per_token_layer": r["bytes"],
                        "bound": "compute" if compute_bound else "memory", "step_ms": seconds * 1e3})  # fmt: skip
    scan_ms = sum(k["step_ms"] for k in kernels)
    other_ms = 6 * model.matmul_params() * seq_len / (PEAK["bf16"] * MATMUL_EFFICIENCY) * 1e3
    step_ms = scan_ms + other_ms
    mfu = model.flops_per_token(seq_len) * seq_len / (step_ms * 1e-3 * PEAK["bf16"])
    step = {"config": name, "design": design, "scan_layers": layers, "kernels": kernels,
            "scan_flops_per_token": sum(r["flops"] for r in rows) * layers,
            "scan_bytes_per_token": sum(r["bytes"] for r in rows) * layers,
            "scan_ms": scan_ms, "other_ms": other_ms, "step_ms": step_ms, "scan_share": scan_ms / step_ms, "mfu": mfu,
            "io_floor_ms": None, "flop_floor_ms": None}  # fmt: skip
    if design == BUILT and family(cfg.kind).scan_shape(cfg).kernel == "soe":
        io, flops = soe_floors(built_rows(cfg, "soe", seq_len)[2])
        step["io_floor_ms"] = io / PEAK_BYTES * seq_len * layers * 1e3
        step["flop_floor_ms"] = flops / PEAK["bf16"] * seq_len * layers * 1e3
    return step


def goal_met(step: dict) -> bool:
    """Scans at most GOAL_SHARE of the step, MFU at least GOAL_MFU and, where the floors are known, the
    scans within GOAL_FLOOR times the larger floor."""
    floor = max(step["io_floor_ms"] or 0.0, step["flop_floor_ms"] or 0.0)
    return step["scan_share"] <= GOAL_SHARE and step["mfu"] >= GOAL_MFU and (
        not floor or step["scan_ms"] <= GOAL_FLOOR * floor
    )


def format_report(steps: Sequence[dict]) -> str:
    """The per-kernel table, then one summary line per config and design."""
    lines = ["| config | design | kernel | runs/layer | rate | MFLOP/token/layer | kB/token/layer | bound "
             "| ms/step (all layers) |", "|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        for k in s["kernels"]:
            lines.append(f"| {s['config']} | {s['design']} | {k['kernel']} | {k['runs']:g} | {k['rate']} | "
                         f"{k['flops_per_token_layer'] / 1e6:.2f} | {k['bytes_per_token_layer'] / 1e3:.1f} | "
                         f"{k['bound']} | {k['step_ms']:.1f} |")
    lines += ["", f"step at {SEQ_LEN:,} tokens per rank on an H100 (other work: parameter matmuls at "
              f"{MATMUL_EFFICIENCY:.0%} of the bf16 peak); goal: scans <= {GOAL_SHARE:.0%} of the step, MFU >= "
              f"{GOAL_MFU:.0%}, scans <= {GOAL_FLOOR:g}x the larger floor",
              "| config | design | scan layers | scan MFLOP/token | scan kB/token | scans ms | IO floor ms "
              "| FLOP floor ms | scans / floor | other ms | scan share | MFU | goal |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in steps:
        floor = max(s["io_floor_ms"] or 0.0, s["flop_floor_ms"] or 0.0)
        cells = [f"{s[k]:.1f}" if s[k] is not None else "-" for k in ("io_floor_ms", "flop_floor_ms")]
        ratio = f"{s['scan_ms'] / floor:.2f}" if floor else "-"
        lines.append(f"| {s['config']} | {s['design']} | {s['scan_layers']} | {s['scan_flops_per_token'] / 1e6:.0f} | "
                     f"{s['scan_bytes_per_token'] / 1e3:.0f} | {s['scan_ms']:.1f} | {cells[0]} | {cells[1]} | "
                     f"{ratio} | {s['other_ms']:.1f} | {s['scan_share']:.0%} | {s['mfu']:.0%} | "
                     f"{'met' if goal_met(s) else 'not met'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="vort-125m,vort-350m,pmnet-119m", help="comma-separated configs/model stems"
    )
    parser.add_argument("--json", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    steps = []
    for name in [c for c in args.config.split(",") if c]:
        path = CONFIG_DIR / f"{name}.yaml"
        if not path.exists():
            parser.error(f"--config: no configs/model/{name}.yaml")
        cfg = load_model_config(path)
        steps += [step_model(name, cfg, design) for design in DESIGNS]
    print(format_report(steps))
    if args.json:
        args.json.write_text(json.dumps(steps, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
