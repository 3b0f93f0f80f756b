"""`train.compile`: which parts of the training module torch.compile covers, and how it is applied.

``blocks`` (the default of ``train.compile: true``) compiles each block's forward: the blocks of a
model share their code and shapes, so one graph serves every layer (the first step compiles one block,
not the whole stack), and the engines' per-module hooks (ZeRO-3's parameter gathers, FSDP2's
all-gathers around each block) stay outside the graph, where they run in eager mode as they were
written to. The random features, routing, norms, gates, short convolution, phasor rotations and tree
reads, the scans (custom ops, kernels/library.py) and the sequence-parallel exchange (functional
collectives) are all inside a block. ``model`` compiles the whole training module: the embedding,
final norm and chunked loss join the graph too, at the price of a compile of the whole stack and of
tracing through the engine's hooks. docs/training.md ("Compiling the step") has the measured gain.

Every compiled run also sets ``INDUCTOR_SETTINGS``: inductor's kernels run in an order that keeps each
fused kernel at its last part's place (``LastMemberOrder``), which is what lets PMNet's whole-model
backward at 16k tokens fit in memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomSchedulerPass, get_hash_for_files

from pretrain.config import RunConfig

CompileMode = Literal["blocks", "model"]

DEFAULT_MODE: CompileMode = "blocks"
"""What ``train.compile: true`` means (the module docstring gives the reasons)."""

DYNAMO_SETTINGS = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
"""torch._dynamo settings of a compiled run. The layers keep what their last forward measured (VORT's
orders, PMNet's slot use and balance loss) as module attributes; under activation checkpointing a
compiled checkpoint would otherwise break its graph there, since eager checkpointing sets them again
when the backward recomputes the forward. The recompute sets the values the forward set, so not
replaying it loses nothing."""


class LastMemberOrder(CustomSchedulerPass):
    """Inductor's order of kernels after fusion, with each fused kernel where its last part was.

    Inductor fuses a producer into a consumer however far apart they are, and then orders the fused
    kernels by their first part, each preceded by everything it needs. A kernel that joins an early
    part to a late one thus pulls the late part's whole input chain in front of what does not lead
    to it. In PMNet's whole-model backward that kernel is the one that sums the token embeddings'
    gradient: every memory block routes from the embeddings (`route_input: embedding`), and one
    block's share is fused with the sum at the end. Everything on the chain of input gradients then
    ran first and the weight gradients of all twelve blocks last, each block's recomputed activations
    and output gradients alive until then (at 8,192 tokens 6.9 GB of the backward's buffers at once,
    1.4 GB in this order; docs/training.md, "Compiling the step"). Taken in the order of their last
    parts (still each after what it needs) the kernels run as autograd ran them. The kernels are the
    same; only the order of independent ones changes, so the results do not.
    """

    def __call__(self, nodes: list[Any]) -> list[Any]:
        producer = {name: node for node in nodes for name in node.get_buffer_names()}
        placed: set[Any] = set()
        order: list[Any] = []

        def place(node: Any) -> None:  # an explicit stack: a backward's chain is thousands of kernels deep
            stack = [(node, False)]
            while stack:
                current, ready = stack.pop()
                if ready:
                    order.append(current)
                    continue
                if current in placed:
                    continue
                placed.add(current)
                stack.append((current, True))
                needs = [producer[d.name] for d in sorted(current.unmet_dependencies, key=lambda d: d.name)
                         if d.name in producer]
                stack.extend((n, False) for n in reversed(needs) if n not in placed)

        for node in sorted(nodes, key=lambda n: n.max_order):
            place(node)
        return order

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


INDUCTOR_SETTINGS: dict[str, Any] = {"_post_fusion_custom_pass": LastMemberOrder()}
"""torch._inductor.config settings of a compiled run (`LastMemberOrder`: the kernels' order)."""


def compile_mode(cfg: RunConfig) -> CompileMode | None:
    """The run's compile mode: None when `train.compile` is false, the default for true."""
    value = cfg.train.compile
    if value is False:
        return None
    return DEFAULT_MODE if value is True else value


def compile_blocks(model: nn.Module) -> None:
    """Replace each block's forward by its compiled form, in place: the parameter names, the state dict
    and the module hooks are untouched (the hooks run around the compiled forward)."""
    for block in model.blocks:
        block.forward = distinct_tensor_inputs(torch.compile(block.forward))


def distinct_tensor_inputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` called with each tensor argument as its own object: a tensor passed twice (PMNet's
    first block gets the embeddings as both ``x`` and ``embedded``) goes in the second time as a view.

    Dynamo compiles one graph for two distinct inputs and another, which takes the tensor once, for the
    same tensor twice; each saves a different number of tensors for the backward. Whether a block sees
    one tensor or two can change between the forward and its recompute under activation checkpointing:
    FSDP2's pre-forward hook hands the block each input through its post-backward autograd Function,
    as distinct outputs, in the forward but not in the recompute, so the recompute ran the other graph
    and torch.utils.checkpoint stopped at the mismatch. With every tensor input distinct both passes
    run the same graph. A view shares the storage and copies nothing.
    """

    @functools.wraps(forward)
    def call(*args: Any, **kwargs: Any) -> Any:
        seen: set[int] = set()

        def distinct(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            if id(value) in seen:
                return value.view_as(value)
            seen.add(id(value))
            return value

        args = tuple(distinct(a) for a in args)
        return forward(*args, **{name: distinct(v) for name, v in kwargs.items()})

    return call


def compile_model(cfg: RunConfig, model: nn.Module) -> bool:
    """Apply the run's compile mode to `model` as far as the model goes (``blocks``: compile them now)
    and say whether the engine must compile its whole training module (``model``)."""
    mode = compile_mode(cfg)
    if mode is not None:
        for name, value in DYNAMO_SETTINGS.items():
            setattr(torch._dynamo.config, name, value)
        for name, value in INDUCTOR_SETTINGS.items():
            setattr(torch._inductor.config, name, value)
    if mode == "blocks":
        compile_blocks(model)
    return mode == "model"
