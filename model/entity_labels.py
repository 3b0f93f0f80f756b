"""Weak entity labels for byte-level text: the auxiliary target of VORT's entity probe.

A byte is labelled 1 when it is a letter of a capitalised word that does not open a sentence: its
first letter is A-Z, the last non-space byte before it is not '.', '!' or '?' (nor the start of
the sequence), and the word is not the pronoun "I". This is a crude stand-in for named-entity
tags (it also marks capitalised verse openings, titles and the start of quoted speech), chosen
because it needs no tagger and can be computed from the input ids alone.
"""

from __future__ import annotations

import torch

_SENTENCE_END = torch.tensor([ord(c) for c in ".!?"])
_SPACE = torch.tensor([ord(c) for c in " \t\r\n\"'"])


def _last_index(mask: torch.Tensor) -> torch.Tensor:
    """For each position, the index of the latest position <= it where `mask` holds (-1 if none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).cummax(dim=-1).values


def capitalised_word_mask(ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] of bytes -> float [B, T]: 1 on the letters of non-sentence-initial capitalised words."""
    upper = (ids >= ord("A")) & (ids <= ord("Z"))
    letter = upper | ((ids >= ord("a")) & (ids <= ord("z")))
    previous_letter = torch.nn.functional.pad(letter[:, :-1], (1, 0), value=False)
    next_letter = torch.nn.functional.pad(letter[:, 1:], (0, 1), value=False)
    word_start = letter & ~previous_letter
    visible = ~torch.isin(ids, _SPACE.to(ids.device))
    before = torch.nn.functional.pad(_last_index(visible)[:, :-1], (1, 0), value=-1)
    opens_sentence = (before < 0) | torch.isin(ids.gather(1, before.clamp_min(0)), _SENTENCE_END.to(ids.device))
    pronoun_i = (ids == ord("I")) & ~next_letter
    entity_start = word_start & upper & ~opens_sentence & ~pronoun_i
    start_of_word = _last_index(word_start)
    labelled = entity_start.gather(1, start_of_word.clamp_min(0)) & (start_of_word >= 0)
    return (letter & labelled).float()
