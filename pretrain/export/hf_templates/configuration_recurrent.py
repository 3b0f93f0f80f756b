"""transformers configuration of an exported recurrent-pretrain model (copied into every export).

The project's ModelConfig travels whole, as the nested dict `lm_config`; the usual transformers
fields (vocab_size, hidden_size, ...) are mirrors of it for tools that look for them.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class RecurrentLMConfig(PretrainedConfig):
    """Configuration holding the project's model config (`lm_config`) and its family (`family`)."""

    model_type = "recurrent_lm"

    def __init__(self, lm_config: dict[str, Any] | None = None, family: str | None = None, **kwargs: Any) -> None:
        self.lm_config = dict(lm_config or {})
        self.family = family or self.lm_config.get("kind")
        kwargs.setdefault("tie_word_embeddings", bool(self.lm_config.get("tie_embeddings", True)))
        super().__init__(**kwargs)
