"""The small surface through which training, evaluation and export see a model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig

IGNORE_INDEX = -100
"""Label value of positions that are not scored (PyTorch cross-entropy's default ignore_index)."""

LOSS_CHUNK_ELEMENTS = 2**26
"""Logits the loss holds at once: tokens per chunk = this // vocabulary (256 MiB of fp32 logits, 2,097
tokens at a 32k vocabulary). 8 chunks at 16,384 tokens instead of 16 at 128 MiB: fewer, larger launches,
3.9 ms less of a vort-125m x 16,384 step on an H100 by benchmarks.predict (1.9 compiled)."""


def loss_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the cross-entropy for this vocabulary size."""
    return max(1, LOSS_CHUNK_ELEMENTS // vocab_size)


def _chunk_log_probs(hidden: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """fp32 log-probabilities of tokens [start, end): the logits in the weights' dtype, then fp32, as
    the plain loss computes them, so that values and gradients round as F.cross_entropy's do."""
    return torch.log_softmax((hidden[start:end] @ weight.t()).float(), dim=-1)


def _token_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
               grads: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """Per-token negative log-likelihood, fp32 [N] (0 at ignored labels), with the logits of one chunk
    of tokens alive at a time. Given ``grads`` (grad_hidden [N, D] in hidden's dtype, grad_weight [V, D]
    fp32, either None), each chunk also adds its share of the summed loss's gradient into them while its
    log-probabilities are at hand: softmax - one_hot(label) on the scored rows, rounded to hidden's dtype
    as the plain loss's backward rounds it, through the head's two products."""
    grad_hidden, grad_weight = grads
    nll = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    step = loss_chunk_tokens(weight.shape[0])
    for start in range(0, hidden.shape[0], step):
        end = start + step
        target = labels[start:end]
        scored = target != IGNORE_INDEX
        log_probs = _chunk_log_probs(hidden, weight, start, end)
        picked = log_probs.gather(1, target.clamp_min(0)[:, None])[:, 0]
        nll[start:end] = torch.where(scored, -picked, 0.0)
        if grad_hidden is None and grad_weight is None:
            continue
        weights = scored.float()
        grad_logits = log_probs.exp_().mul_(weights[:, None])
        rows = torch.arange(target.shape[0], device=target.device)
        grad_logits[rows, target.clamp_min(0)] -= weights
        grad_logits = grad_logits.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden[start:end] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += (grad_logits.t() @ hidden[start:end]).float()
    return nll


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of hidden [N, D] @ weight [V, D]^T against labels [N], with no more than one
    chunk's [tokens x vocabulary] logits held at a time. The loss is a sum ending the graph, so its
    gradient is the gradient of the sum times one upstream number: the forward makes that gradient
    chunk by chunk while each chunk's log-probabilities are at hand (as Liger-Kernel's fused linear
    cross-entropy does), and the backward only scales it. The logits are computed once, not again in the
    backward: one [tokens x d] x [d x vocabulary] product and the log-softmax's passes fewer a step."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        total = _token_nll(hidden, weight, labels, (grad_hidden, grad_weight)).sum()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:  # scaled in fp32: the upstream number is not rounded to hidden's dtype
            grad_hidden = (grad_hidden.float() * grad_total).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits hidden @ weight^T, summed over labels != IGNORE_INDEX (fp32
    scalar), computed in chunks of tokens: equal to F.cross_entropy(..., reduction="sum") on the
    fp32 logits in value and gradient without ever materialising [tokens x vocabulary] logits. Tokens
    that fit in one chunk take the plain loss itself: the same bound, and the plain loss's rounding,
    which the sequence-parallel tests compare step by step."""
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if hidden.shape[0] <= loss_chunk_tokens(weight.shape[0]):
        logits = (hidden @ weight.t()).float()
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _token_nll(hidden, weight, labels).sum()  # no gradient wanted (evaluation): none made
    return _ChunkedCrossEntropy.apply(hidden, weight, labels)


def token_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [..., T] of hidden [..., T, D] @ weight^T (0 at ignored labels), in chunks;
    for evaluation (no gradient)."""
    with torch.no_grad():
        nll = _token_nll(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1))
    return nll.view(labels.shape)


class LMHead(nn.Linear):
    """The output projection: logits of hidden states, or given labels, their chunked summed
    cross-entropy (called through forward, so that engines that gather a module's weights in its
    forward hooks, ZeRO-3 and FSDP2, see the loss use them)."""

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__(d_model, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        return chunked_cross_entropy(hidden, self.weight, labels)


class LMOutput(NamedTuple):
    """Next-token logits [B, T, V] and the recurrent state after the last token (None if stateless)."""

    logits: torch.Tensor
    state: Any


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in a sequence split over the ranks of ``group`` (consecutive equal pieces).

    A model given one computes on its piece only and gets what crosses the piece borders (recurrent
    state, attention halo) from the neighbouring ranks through ``group``; ``offset`` is the global
    position of the piece's first token (rotary angles, segment positions). With document starts the
    model replaces it (`model.blocks.documents_across_pieces`) by the position of each row's first
    token within its document (long [B]).
    """

    group: Any  # a torch.distributed ProcessGroup
    rank: int
    size: int
    offset: int | torch.Tensor


class ScanShape(NamedTuple):
    """The recurrent scan one layer of a family runs, in the sizes its kernel's launch planner takes
    after (batch, seq_len): what the kernel benchmarks compile and model without knowing the family.

    `kernel` "soe": sizes (heads, terms, features, head_dim, chunk_size) of kernels.soe.triton.soe_launches;
    "phasor": sizes (levels, width, slots) of kernels.phasor.triton.phasor_launches.
    """

    kernel: str
    sizes: tuple[int, ...]


class CausalLM(nn.Module):
    """Base class of every model family.

    Subclasses implement `forward`, `flops_per_token` and, when they carry memory across calls,
    `init_state`. A state returned by `forward` can be fed to the next call so that a long
    sequence processed piece by piece gives the same outputs as processed whole.
    """

    config: ModelConfig
    head: LMHead
    streams_exactly: ClassVar[bool] = True
    """Whether the state carries all a later call needs from earlier tokens, so that a sequence fed
    piece by piece gives the outputs of the whole; False for a model that forgets across calls."""

    supports_sequence_parallel: ClassVar[bool] = False
    """Whether `forward` accepts a `SequenceParallel` piece (see `sequence_parallel_problem`)."""

    carries_memory: ClassVar[bool] = True
    """Whether the state holds memory of earlier tokens, so that carrying it from window to window
    (train.carry_state) means something; False for a model whose state is only a position."""

    reports_memory: ClassVar[bool] = False
    """Whether `memory_report` describes what the state holds (pretrain.evaluate.memory_probe)."""

    @classmethod
    def sequence_parallel_problem(cls, config: ModelConfig, piece: int) -> str | None:
        """Why this family cannot split its sequences into pieces of `piece` tokens on consecutive
        ranks (None if it can)."""
        if not cls.supports_sequence_parallel:
            return f"model.kind={config.kind!r} cannot run sequence-parallel"
        return None

    @classmethod
    def doc_boundaries_problem(cls, config: ModelConfig, sequence_parallel: int) -> str | None:
        """Why this family cannot reset at document starts when split over `sequence_parallel` ranks
        (None if it can)."""
        return None

    @classmethod
    def scan_shape(cls, config: ModelConfig) -> ScanShape | None:
        """The scan a layer of this config runs (None for a family without a recurrent scan)."""
        return None

    @property
    def certified_horizon(self) -> int | None:
        """The longest lag the memory kernel's error bound covers; None for models without one."""
        return None

    def certified_kernel(self) -> Any:
        """The certified kernel tables and the settings they were built with (model/soe/tables.py's
        `KernelTables`), or None for models without one."""
        return None

    def with_kernel(self, **settings: Any) -> CausalLM:
        """The same weights with the memory kernel rebuilt from other settings (a certified model's
        horizon or tempering); raises ValueError for a model without such a kernel."""
        raise ValueError(f"model.kind={self.config.kind!r} has no certified memory kernel to rebuild")

    def memory_report(self, state: Any, train_len: int) -> list[dict[str, float]]:
        """Per layer, what the state holds, with lags counted against the training length `train_len`
        (only where `reports_memory`)."""
        raise NotImplementedError(f"model.kind={self.config.kind!r} has no memory report")

    def state_bytes(self, batch: int, sequence_parallel: int) -> tuple[float, float]:
        """Per rank, in bytes: the recurrent states of `batch` rows over all layers, and the buffers
        that cross the piece borders when a sequence is split over `sequence_parallel` ranks."""
        return 0.0, 0.0

    def scan_buffer_bytes(self, batch: int, tokens: int) -> float:
        """Per rank, in bytes: what the GPU scan kernels allocate beside a training step's activations at
        `batch` x `tokens` (the states each layer's forward keeps for its backward, and one layer's
        scan call at once); 0 for models whose scans allocate nothing of note."""
        return 0.0

    @torch.no_grad()
    def cache_floats(self, seq_len: int) -> int:
        """Floats an inference cache holds after `seq_len` tokens: the recurrent state (a model that
        recomputes attention over its context overrides this with the keys and values it would keep)."""

        def count(x: Any) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel()
            return sum(count(item) for item in x) if isinstance(x, (list, tuple)) else 0

        return count(self(torch.zeros(1, seq_len, dtype=torch.long)).state)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: Any = None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
    ) -> LMOutput:
        """Logits for input_ids [B, T]; with ``sequence_parallel``, input_ids is this rank's piece of
        longer sequences (then ``state`` must be None: the piece's entering state comes from the
        other ranks). ``doc_start`` (bool [B, T], True where a token starts a document) makes every
        packed document give the outputs it gives alone: memory, attention and positions restart."""
        raise NotImplementedError

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        state: Any = None,
        sequence_parallel: SequenceParallel | None = None,
        doc_start: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """What `forward` computes before `head`: the final hidden states [B, T, D] and the new state."""
        raise NotImplementedError

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> Any:
        """The state before the first token; None for models without recurrent memory."""
        return None

    def loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Mean next-token cross-entropy in nats over labels != IGNORE_INDEX, plus the family's
        `auxiliary_loss` of this forward in training, and the new state."""
        total, count, new_state = self.summed_loss(input_ids, labels, state, doc_start=doc_start)
        loss, auxiliary = total / count.clamp_min(1), self.auxiliary_loss()
        return (loss if auxiliary is None else loss + auxiliary), new_state

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The family's own training loss of the last forward in training mode, weighted, to add to
        the cross-entropy (None: it has none). Under sequence parallelism each rank's value is the
        whole sequence's and its gradients follow the sequence-parallel loss's N x convention
        (`kernels.parallel.sum_over_ranks` gives both), so `sequence_parallel_loss` adds it as is."""
        return None

    def summed_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None,
        sequence_parallel: SequenceParallel | None = None, doc_start: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(cross-entropy summed over labels != IGNORE_INDEX, their count, the new state), chunked over
        tokens so that no [tokens x vocabulary] fp32 logits are held (see `chunked_cross_entropy`)."""
        hidden, new_state = self.hidden_states(input_ids, state, sequence_parallel, doc_start)
        return self.head(hidden, labels), (labels != IGNORE_INDEX).sum(), new_state

    def token_losses(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        """Per-token cross-entropy [B, T] (0 at ignored labels) and the new state, without gradients."""
        hidden, new_state = self.hidden_states(input_ids, state, doc_start=doc_start)
        return token_cross_entropy(hidden, self.head.weight, labels), new_state

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token at the given context length."""
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """Model-specific statistics for the trainer's logger (scalars or 1-D tensors as histograms)."""
        return {}

    def no_weight_decay(self) -> set[str]:
        """Names (as in `named_parameters`) of matrices the optimizer must not decay; the optimizer
        already spares vectors, norms and embeddings."""
        return set()

    def memory_parameters(self) -> int:
        """Parameters of a separate memory module (PMNet's phasor memories), reported by
        `python -m model.summary`; 0 for a family whose state lives inside its mixing layers."""
        return 0

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= sum(p.numel() for n, p in self.named_parameters() if n.endswith("embed.weight"))
        return total
