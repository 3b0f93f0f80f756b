"""The three ways a step runs: one process, DeepSpeed ZeRO 0-3, PyTorch FSDP2.

Every engine offers the same operations to the trainer:
  - `train_step(micro_batches, lr)`: forward and backward of this rank's micro-batches, gradients
    averaged over the global batch, clipping, and the optimizer update (skipped when the loss or
    gradients are not finite on any rank); returns a StepInfo of device tensors. Nothing in a step
    waits for the device: the skip is decided on it (AdamW's found_inf flag), and the trainer reads
    the StepInfos only at log steps. (DeepSpeed's ZeRO 1-3 optimizers read their own overflow flag
    every step; that wait is theirs.)
  - `eval_loss(input_ids, labels, state, doc_start=None)`: the loss without gradients (sharded engines
    gather weights) and the state after the piece, so that long contexts are evaluated piece by piece.
  - `save(path)` / `load(path, scratch)`: the engine-native checkpoint of model and optimizer
    (a format module each in pretrain/checkpoint/; the files around it, trainer state and RNG,
    are pretrain/checkpoint/checkpointer.py's).
What the rest of pretrain/ must know about an engine before one exists (whether it runs in one
process, how far it shards, what its communication buffers cost, how it joins the process group,
whether it can restore a given checkpoint) is
a class attribute or class method of the engine class, looked up by `engine_class(cfg)`; the trainer,
the preflight checks and the memory plan never branch on the engine kind. Adding an engine means a
class here, an entry in ENGINES, and its checkpoint format in pretrain/checkpoint/.
"""

from __future__ import annotations

import copy
import datetime
import math
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from model import CausalLM, SequenceParallel
from pretrain.carry import detach_state
from pretrain.checkpoint import dcp_format, deepspeed_format, torch_format
from pretrain.checkpoint.dcp_format import load_dcp_state, save_dcp_state
from pretrain.checkpoint.deepspeed_format import deepspeed_layout_problem, load_deepspeed, save_deepspeed
from pretrain.checkpoint.torch_format import load_torch_state, save_torch_state
from pretrain.config import RunConfig
from pretrain.distributed.compiling import compile_model
from pretrain.distributed.parallel_dims import sequence_parallel_loss
from pretrain.distributed.process_group import init_distributed
from pretrain.optim import param_groups
from pretrain.protocols import Batch, Engine, StepInfo
from pretrain.resilience import watchdog


class TrainModule(nn.Module):
    """Wraps a CausalLM so that forward returns the loss: what DeepSpeed and FSDP shard and call.

    With a sequence-parallel context, training batches are this rank's pieces and the loss is
    pretrain.parallel_dims's; evaluation (eval mode) always sees whole sequences.
    """

    def __init__(self, model: CausalLM, sequence_parallel: SequenceParallel | None = None):
        super().__init__()
        self.model = model
        self.sequence_parallel = sequence_parallel

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any = None, doc_start: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss; given a carried state (train.carry_state), also the state after the window,
        detached: the gradient of this window stops at its start (truncated BPTT). ``doc_start``
        (data.doc_boundaries) resets the model at each document start."""
        if self.training and self.sequence_parallel is not None:
            return sequence_parallel_loss(self.model, input_ids, labels, self.sequence_parallel, doc_start)
        loss, new_state = self.model.loss(input_ids, labels, state, doc_start)
        if state is None:
            return loss
        return loss, detach_state(new_state)


def _forward(module: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
    """(loss, state after the window or None) of one micro-batch."""
    out = module(*batch)
    return out if isinstance(out, tuple) else (out, None)


def _adamw(cfg: RunConfig, module: nn.Module) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (CUDA and CPU): one kernel for all parameters instead of a loop
    over them, and it honours a `found_inf` flag on the device, which skips the update (moments and
    step count included) without the host looking at it."""
    t = cfg.train
    return torch.optim.AdamW(
        param_groups(module, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True
    )


def _skip_flag(*values: torch.Tensor) -> torch.Tensor:
    """1.0 when any of `values` is non-finite on any rank, else 0.0: a float32 0-d tensor on their
    device, summed over the ranks by a device collective (the found_inf fused AdamW takes)."""
    bad = torch.stack([(~torch.isfinite(v.detach())).any() for v in values]).any().float()
    if dist.is_initialized():
        dist.all_reduce(bad)
    return (bad > 0).float()


def _poisoned(loss: torch.Tensor) -> torch.Tensor:
    """`loss`, times NaN when it is not finite: the gradients of a non-finite loss are then NaN too,
    whatever the loss's form, so the step's check drops them (decided on the device)."""
    ones = torch.ones_like(loss.detach())
    return loss * torch.where(torch.isfinite(loss.detach()), ones, ones * math.nan)


@torch.no_grad()
def eval_loss(
    module: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, state: Any, doc_start: torch.Tensor | None = None
) -> tuple[torch.Tensor, Any]:
    """The loss in eval mode without gradients, starting from the carried `state`, and the state after
    (through the wrapper, so sharded weights are gathered); the module is back in train mode afterwards.
    ``doc_start`` (data.doc_boundaries) resets the model at each document start."""
    module.eval()
    loss, new_state = module(input_ids, labels, state, doc_start)
    module.train()
    return loss, new_state


@dataclass(frozen=True)
class ParameterBytes:
    """Bytes an engine keeps per parameter, before sharding: weights (with any fp32 master copy),
    gradients (with any fp32 master gradient) and optimizer state (with a master copy counted there)."""

    weights: int
    grads: int
    optimizer: int


FP32_ADAMW = ParameterBytes(weights=4, grads=4, optimizer=8)


class _TorchOptimizerEngine:
    """Shared by the single-process and FSDP2 engines: a torch AdamW stepped by us.

    The class attributes and class methods are what callers ask before an engine exists."""

    one_process: ClassVar[bool] = False
    """Whether the engine runs in one process only (no data or sequence parallelism)."""
    group_of_one: ClassVar[bool] = False
    """Whether a plain `python` run (no launcher) still needs a process group (of one)."""
    payload: ClassVar[ModuleType]
    """The module of pretrain/checkpoint/ that writes and reads the engine's checkpoint payload."""

    @classmethod
    def sharding_stage(cls, cfg: RunConfig) -> int:
        """What the engine partitions over data-parallel ranks, in ZeRO's terms: 0 nothing, 1 the
        optimizer state, 2 and the gradients, 3 and the weights."""
        return 0

    @classmethod
    def describe(cls, cfg: RunConfig) -> str:
        return cfg.engine.kind

    @classmethod
    def comm_buffer_bytes(cls, cfg: RunConfig, n_params: int, weight_bytes: int) -> float:
        """Bytes per rank of the gradient buckets the engine keeps in flight."""
        return 0.0

    @classmethod
    def parameter_bytes(cls, cfg: RunConfig) -> ParameterBytes:
        """What the engine holds per parameter in the run's precision (the memory plan's figures)."""
        return FP32_ADAMW

    @staticmethod
    def joined(backend: str, timeout: datetime.timedelta) -> None:
        """The engine's own set-up once the process group exists."""

    @classmethod
    def checkpoint_problem(cls, cfg: RunConfig, engine_dir: Path, world: int) -> str | None:
        """Why this engine cannot restore the payload in `engine_dir` at `world` ranks, asked before
        one is built (None when it can): another engine's format, or a layout it cannot convert."""
        return None if cls.payload.holds(engine_dir) else _foreign_payload(cfg, engine_dir)

    def __init__(self, cfg: RunConfig, module: TrainModule, gas: int, stepped: nn.Module | None = None):
        """``stepped``: the module whose parameters the optimizer updates, ``module`` itself unless given."""
        self.cfg, self.gas, self.model = cfg, gas, module.model
        self.module: nn.Module = torch.compile(module) if compile_model(cfg, module.model) else module
        self.optimizer = _adamw(cfg, module if stepped is None else stepped)

    def _set_sync(self, last: bool) -> None:
        """FSDP reduces gradients only on the last micro-batch of a step."""

    def _backward_done(self) -> None:
        """After each micro-batch's backward: where the single engine's bf16 mode moves the gradients
        to its fp32 master weights."""

    def _stepped(self) -> list[nn.Parameter]:
        """The parameters with gradients that the optimizer updates (clipped together)."""
        return [p for p in self.module.parameters() if p.grad is not None]

    def _updated(self) -> None:
        """After the optimizer step: where the single engine's bf16 mode rounds its master weights into
        the model."""

    def eval_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        return eval_loss(self.module, input_ids, labels, state, doc_start)

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepInfo:
        losses, states = [], []
        for i, batch in enumerate(micro_batches):
            self._set_sync(i == len(micro_batches) - 1)
            loss, state = _forward(self.module, batch)
            (loss / len(micro_batches)).backward()
            self._backward_done()
            losses.append(loss.detach())
            states.append(state)
        local_loss = torch.stack(losses).mean()
        watchdog.phase("optimizer")
        params = self._stepped()
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        skip = _skip_flag(local_loss, norm)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.found_inf = skip
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._updated()
        return StepInfo(local_loss, norm, skip == 0, states)


class SingleEngine(_TorchOptimizerEngine):
    """One process (any device): the reference the distributed engines are compared against.

    Under engine.precision=bf16 it trains as FSDP2's mixed precision does: the model is converted to
    bf16 in place, as DeepSpeed converts it (what the model keeps fp32 stays fp32), and computes in it;
    the optimizer steps an fp32 master copy, whose gradients are the model's summed in fp32 over the
    micro-batches; after each step the master weights are rounded into the model. Checkpoints hold the
    master weights, so they are the fp32 run's format.
    """

    one_process = True
    payload = torch_format

    @classmethod
    def parameter_bytes(cls, cfg: RunConfig) -> ParameterBytes:
        """bf16: the bf16 model and its gradients beside the fp32 master and its gradients."""
        if cfg.engine.precision == "bf16":
            return ParameterBytes(weights=2 + 4, grads=2 + 4, optimizer=8)
        return FP32_ADAMW

    def __init__(self, cfg: RunConfig, module: TrainModule, gas: int):
        self.master: CausalLM | None = None
        if cfg.engine.precision == "bf16":
            self.master = copy.deepcopy(module.model)
            module.model.to(torch.bfloat16)
        super().__init__(cfg, module, gas, self.master)

    def _pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(model parameter, master parameter), in the same order: the master is a deep copy."""
        assert self.master is not None
        return list(zip(self.model.parameters(), self.master.parameters(), strict=True))

    def _backward_done(self) -> None:
        if self.master is None:
            return
        for param, master in self._pairs():
            if param.grad is not None:
                master.grad = param.grad.float() if master.grad is None else master.grad.add_(param.grad)
                param.grad = None

    def _stepped(self) -> list[nn.Parameter]:
        if self.master is None:
            return super()._stepped()
        return [p for p in self.master.parameters() if p.grad is not None]

    @torch.no_grad()
    def _updated(self) -> None:
        if self.master is not None:
            for param, master in self._pairs():
                param.copy_(master)

    def save(self, path: str) -> None:
        save_torch_state(path, self.model if self.master is None else self.master, self.optimizer)

    def load(self, path: str, scratch: Path) -> None:
        load_torch_state(path, self.model if self.master is None else self.master, self.optimizer)
        self._updated()


class FSDPEngine(_TorchOptimizerEngine):
    """FSDP2: every block and the root sharded with `fully_shard`; checkpoints through DCP.

    Under bf16 the shards and their gradients stay fp32 (they are the master weights); only the block
    gathered for compute is bf16, so it keeps the fp32 figures of `parameter_bytes`."""

    payload = dcp_format

    @classmethod
    def sharding_stage(cls, cfg: RunConfig) -> int:
        return 3

    def __init__(self, cfg: RunConfig, module: TrainModule, gas: int):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ValueError("engine.kind=fsdp needs a distributed launch (torchrun); use engine.kind=single")

        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if cfg.engine.precision == "bf16" else torch.float32,
            reduce_dtype=torch.float32,
        )
        for block in module.model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(module, mp_policy=policy)
        super().__init__(cfg, module, gas)

    def _set_sync(self, last: bool) -> None:
        self.module.set_requires_gradient_sync(last)

    def save(self, path: str) -> None:
        save_dcp_state(path, self.module, self.optimizer)

    def load(self, path: str, scratch: Path) -> None:
        load_dcp_state(path, self.module, self.optimizer)  # DCP reshards by itself


class DeepSpeedEngine:
    """DeepSpeed ZeRO stage 0-3 around our AdamW; its JSON config is generated from ours."""

    one_process = False
    group_of_one = True

    @classmethod
    def sharding_stage(cls, cfg: RunConfig) -> int:
        return cfg.engine.zero_stage

    @classmethod
    def describe(cls, cfg: RunConfig) -> str:
        return f"deepspeed ZeRO-{cfg.engine.zero_stage}"

    @classmethod
    def comm_buffer_bytes(cls, cfg: RunConfig, n_params: int, weight_bytes: int) -> float:
        """overlap_comm at stages 1-3: two reduction buckets in flight."""
        return 2 * deepspeed_bucket_elements(n_params) * weight_bytes if cfg.engine.zero_stage >= 1 else 0.0

    @classmethod
    def parameter_bytes(cls, cfg: RunConfig) -> ParameterBytes:
        """bf16: bf16 weights and gradients; the fp32 master sits with the optimizer's partition."""
        if cfg.engine.precision == "bf16":
            return ParameterBytes(weights=2, grads=2, optimizer=8 + 4)
        return FP32_ADAMW

    @classmethod
    def checkpoint_problem(cls, cfg: RunConfig, engine_dir: Path, world: int) -> str | None:
        """As the other engines'; and a ZeRO stage DeepSpeed cannot convert the checkpoint's to."""
        return deepspeed_layout_problem(engine_dir, cfg.engine.zero_stage, world) or (
            None if deepspeed_format.holds(engine_dir) else _foreign_payload(cfg, engine_dir)
        )

    @staticmethod
    def joined(backend: str, timeout: datetime.timedelta) -> None:
        """DeepSpeed adopts the process group that exists."""
        import deepspeed

        if not torch.cuda.is_available():
            # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce op, used only for
            # inference, that leaves a 66 MB /dev/shm file per rank behind on every run and hangs
            # every later run on a stale build lock if a compile is killed. Training never calls it.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)

    def __init__(self, cfg: RunConfig, module: TrainModule, gas: int):
        import deepspeed

        self.cfg, self.gas = cfg, gas
        self.optimizer = _adamw(cfg, module)
        n_params = sum(p.numel() for p in module.parameters())
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.ds_config = deepspeed_config(cfg, gas, world, n_params)
        self.engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=self.optimizer, config=self.ds_config, dist_init_required=False
        )
        if compile_model(cfg, module.model):
            self.engine.compile()  # torch.compile of the wrapped module, DeepSpeed's hooks kept outside the graph

    @property
    def model(self) -> CausalLM:
        return self.engine.module.model

    def train_step(self, micro_batches: list[Batch], lr: float) -> StepInfo:
        """DeepSpeed's own accumulation: backward and engine.step() per micro-batch; the step at
        the accumulation boundary is the one that updates (and ZeRO's overflow check may skip)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses, states, own_norm = [], [], None
        for batch in micro_batches:
            loss, state = _forward(self.engine, batch)
            losses.append(loss.detach())
            states.append(state)
            # a non-finite loss poisons the gradients so that the step is dropped: by ZeRO's overflow
            # check at stages 1-3, by the found_inf flag below at stage 0
            self.engine.backward(_poisoned(loss))
            if self.engine.is_gradient_accumulation_boundary():
                watchdog.phase("optimizer")
                if self.cfg.engine.zero_stage == 0:
                    own_norm = self._grad_norm()
                    self.optimizer.found_inf = _skip_flag(own_norm)
            self.engine.step()
        local_loss = torch.stack(losses).mean()
        norm = self.engine.get_global_grad_norm() if own_norm is None else own_norm
        norm = torch.as_tensor(math.nan if norm is None else norm, dtype=torch.float32, device=local_loss.device)
        applied = torch.isfinite(norm) & bool(self.engine.was_step_applied())
        return StepInfo(local_loss, norm, applied, states)

    def eval_loss(
        self, input_ids: torch.Tensor, labels: torch.Tensor, state: Any, doc_start: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Any]:
        return eval_loss(self.engine, input_ids, labels, state, doc_start)

    def _grad_norm(self) -> torch.Tensor:
        """Global gradient norm at stage 0, where DeepSpeed's data-parallel gradients are whole."""
        grads = [p.grad.float().norm() ** 2 for p in self.engine.module.parameters() if p.grad is not None]
        return torch.stack(grads).sum().sqrt() if grads else torch.zeros(())

    def save(self, path: str) -> None:
        save_deepspeed(self.engine, path, self.cfg.engine.zero_stage)

    def load(self, path: str, scratch: Path) -> None:
        load_deepspeed(self.engine, path, self.cfg.engine.zero_stage, scratch)


def _foreign_payload(cfg: RunConfig, engine_dir: Path) -> str:
    return (f"{engine_dir}: not a checkpoint that engine.kind={cfg.engine.kind} writes (another engine's payload); "
            "resume with the engine that wrote it, or start this config from its weights with init.from")


DEEPSPEED_MAX_BUCKET = 500_000_000
"""DeepSpeed's default reduce/all-gather bucket (elements): the cap of `deepspeed_bucket_elements`."""


def deepspeed_bucket_elements(n_params: int) -> int:
    """Gradient-reduction and all-gather bucket size (elements) for a model of `n_params`: a quarter
    of the weights, so that a backward pass fills about four buckets and each one's reduction overlaps
    the rest of the backward (`overlap_comm`), between 2^20 and DeepSpeed's default of 5e8 (whose
    buffer alone is 1 GiB in bf16, several times a 125M model's gradients per rank)."""
    return int(min(DEEPSPEED_MAX_BUCKET, max(2**20, n_params // 4)))


def deepspeed_config(cfg: RunConfig, gas: int, world: int, n_params: int) -> dict[str, Any]:
    """The DeepSpeed JSON section, generated so that it can never disagree with our config."""
    bucket = deepspeed_bucket_elements(n_params)
    zero: dict[str, Any] = {
        "stage": cfg.engine.zero_stage,
        "overlap_comm": cfg.engine.zero_stage >= 1,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if cfg.engine.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "train_batch_size": cfg.train.micro_batch * gas * world,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": cfg.engine.precision == "bf16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


ENGINES: dict[str, type[SingleEngine | FSDPEngine | DeepSpeedEngine]] = {
    "single": SingleEngine,
    "fsdp": FSDPEngine,
    "deepspeed": DeepSpeedEngine,
}


def engine_class(cfg: RunConfig) -> type[SingleEngine | FSDPEngine | DeepSpeedEngine]:
    """The class of the engine named by `engine.kind` (the config loader has checked the name)."""
    return ENGINES[cfg.engine.kind]


def build_engine(
    cfg: RunConfig, model: CausalLM, gas: int, sequence_parallel: SequenceParallel | None = None
) -> Engine:
    """The engine named by `engine.kind` around `model` (already on its device), stepping `gas`
    micro-batches per data-parallel rank, sequences split over `sequence_parallel`'s group. The
    config has passed pretrain.preflight.check_start at this world size."""
    model.activation_checkpointing = cfg.train.activation_checkpointing
    return engine_class(cfg)(cfg, TrainModule(model, sequence_parallel), gas)


def join_process_group(cfg: RunConfig) -> tuple[int, int]:
    """(rank, world) after joining the launcher's process group as this run's engine needs it."""
    engine = engine_class(cfg)
    return init_distributed(cfg.engine.dist_timeout_s, engine.group_of_one, engine.joined, Path(cfg.run.dir))
