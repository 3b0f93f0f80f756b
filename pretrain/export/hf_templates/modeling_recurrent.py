"""transformers wrapper of an exported recurrent-pretrain model (copied into every export).

The network itself is the project's CausalLM, built by the project's own code which travels in the
export as flat `rlm_*.py` modules (see pretrain/export/remote_code.py). Parameter names are the
CausalLM's own (`embed.weight`, `blocks.0....`), so model.safetensors is shared with the project's
loader: the wrapper registers the CausalLM's submodules as its own instead of nesting it.

forward(input_ids, state=None, labels=None) returns logits, the recurrent state after the last
token (pass it back to continue a long text in pieces) and, with labels, the mean next-token loss
in the transformers convention (labels are the input ids; the shift happens here).

generate() works greedy or sampling, with the recurrent state as its cache: the prompt goes
through once, then each step feeds one token and the state, so time and memory per generated
token do not depend on the prompt's length. A model whose state does not carry the whole context
(the Transformer baseline keeps no KV cache) is given the whole sequence at every step instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_recurrent import RecurrentLMConfig
from .rlm_model import IGNORE_INDEX, build_model
from .rlm_model_config import ModelConfig, PMNetConfig, VortConfig
from .rlm_sources import CARRIED_SOURCES


def model_config_from_dict(lm_config: dict[str, Any]) -> ModelConfig:
    """The nested `lm_config` dict back into the project's dataclasses (validated by them)."""
    top = {k: v for k, v in lm_config.items() if k not in ("vort", "pmnet")}
    vort, pmnet = VortConfig(**lm_config.get("vort", {})), PMNetConfig(**lm_config.get("pmnet", {}))
    return ModelConfig(**top, vort=vort, pmnet=pmnet)


@dataclass
class RecurrentLMOutput(ModelOutput):
    """Loss (with labels), next-token logits [B, T, V] and the recurrent state after the last token."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    state: Any = None


class RecurrentLMForCausalLM(PreTrainedModel, GenerationMixin):
    """An exported VORT / PMNet / baseline language model behind transformers' interface."""

    config_class = RecurrentLMConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    carried_sources = CARRIED_SOURCES
    _is_stateful = True  # generation cannot rewind the state: no assisted decoding

    def __init__(self, config: RecurrentLMConfig) -> None:
        super().__init__(config)
        lm_config = model_config_from_dict(config.lm_config)
        # transformers builds models on the meta device and then fills in the saved weights; our
        # models also compute constants at construction (SOE banks, random-feature projections,
        # tree offsets) that are not all in the weights file, so the CausalLM is built for real.
        with torch.device("cpu"):
            lm = build_model(lm_config)
        if lm._parameters or lm._buffers:
            raise ValueError("the CausalLM holds tensors outside its submodules; the wrapper cannot adopt it")
        object.__setattr__(self, "_lm", lm)
        # Non-persistent buffers (constants such as PMNet's tree offsets) are not in the weights
        # file; transformers empties them while loading and asks `_init_weights` to refill them.
        self._constants = {
            id(module): {
                name: buffer.detach().clone()
                for name, buffer in module._buffers.items()
                if name in module._non_persistent_buffers_set
            }
            for module in lm.modules()
        }
        for name, child in lm.named_children():
            self.add_module(name, child)
        if lm_config.tie_embeddings:
            self._tied_weights_keys = {"head.weight": "embed.weight"}
        self.post_init()

    @property
    def lm(self) -> torch.nn.Module:
        """The project's CausalLM (sharing every submodule with this wrapper)."""
        return self._lm

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Restore `module`'s constants; parameters need nothing: the CausalLM initialised itself
        and loading overwrites them from model.safetensors."""
        for name, value in self._constants.get(id(module), {}).items():
            module._buffers[name] = value.to(module._buffers[name].device)

    def train(self, mode: bool = True) -> RecurrentLMForCausalLM:
        super().train(mode)
        self._lm.training = mode
        return self

    def get_input_embeddings(self) -> torch.nn.Module:
        return self._lm.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self._lm.head

    def init_state(self, batch_size: int, device: torch.device | str = "cpu") -> Any:
        """The recurrent state before the first token (None for a model without memory)."""
        return self._lm.init_state(batch_size, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: Any = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **_: Any,
    ) -> RecurrentLMOutput | tuple:
        """Logits (and loss with `labels`) for `input_ids` [B, T], continuing from `state`.

        Other transformers keyword arguments (use_cache, output_attentions, ...) are accepted and
        ignored. Padding is refused: a pad token would enter the recurrent memory.
        """
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask with padding is not supported: feed unpadded sequences")
        logits, new_state = self._lm(input_ids, state)
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)
        output = RecurrentLMOutput(loss=loss, logits=logits, state=new_state)
        if return_dict is False:
            return output.to_tuple()
        return output

    # ------------------------------------------------------------------------- generation

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No KV cache: the recurrent state, kept in the generation kwargs as `state`, is the cache."""
        return False

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' generate(), greedy or sampling. Beam search is refused: it would have to
        reorder the recurrent state between beams, which this wrapper does not do."""
        config = kwargs.get("generation_config") or self.generation_config
        if (kwargs.get("num_beams") or config.num_beams or 1) > 1:
            raise ValueError("beam search is not supported by the recurrent state cache; use greedy or sampling")
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        state: Any = None,
        attention_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> dict[str, Any]:
        """The whole prompt first; afterwards only the newest token, with the state after the rest."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("generate() with padding is not supported: pass one prompt, or prompts of equal length")
        if state is None or not self._lm.streams_exactly:
            return {"input_ids": input_ids}
        return {"input_ids": input_ids[:, -1:], "state": state}

    def _update_model_kwargs_for_generation(
        self, outputs: RecurrentLMOutput, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        model_kwargs["state"] = outputs.state
        return model_kwargs
