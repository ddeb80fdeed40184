"""The drafters, one small file each, and the one factory that builds them from a spec type.

    ngram_simple.py   ngram-simple   copies what followed the last earlier occurrence of the last n tokens
    draft_model.py    draft-simple   a second, smaller GGUF drafting in its own context
    draft_eagle3.py   draft-eagle3   an EAGLE-3 draft (-md), fed three of the target's layers
    draft_mtp.py      draft-mtp      the MTP (NextN) heads stored in the GGUF, fed the target's hidden rows

Every drafter implements kernels.types.Drafter (begin / propose / accept / close) and sees the
target only through a TargetView.
"""

from __future__ import annotations

from specrun.gguf_spec.errors import SpecrunError

from ..params import SpecParams
from ..types import Drafter
from .base import TargetView
from .draft_eagle3 import DraftEagle3
from .draft_model import DraftModel
from .draft_mtp import DraftMTP
from .ngram_simple import NgramSimple

__all__ = ["DraftEagle3", "DraftMTP", "DraftModel", "NgramSimple", "TargetView", "draft_n_max", "drafter_key", "make_drafter"]


def draft_n_max(spec_type: str, spec: SpecParams) -> int:
    """The longest draft of a drafter, as llama.cpp bounds it (common_speculative_n_max): an n-gram
    draft is a copy of size_n..size_m tokens (--spec-ngram-simple-size-m), a model drafts at most
    --spec-draft-n-max tokens. The engine adds its own bounds (context room, tokens left, its cap)."""
    return spec.ngram_size_m if spec_type == "ngram-simple" else spec.n_max


def drafter_key(spec_type: str, spec: SpecParams) -> tuple:
    """The settings that make two drafters of a type different (an engine caches one per key)."""
    if spec_type == "ngram-simple":
        return (spec_type, spec.ngram_size_n, spec.ngram_size_m)
    return (spec_type,)


def make_drafter(spec_type: str, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                 heads_path: str | None = None) -> Drafter:
    """A new drafter of spec_type. draft_path: the -md model of draft-simple or draft-eagle3;
    heads_path: an MTP-only GGUF for draft-mtp (None: the target's own heads, which must have been
    loaded)."""
    if spec_type == "ngram-simple":
        return NgramSimple(spec.ngram_size_n, spec.ngram_size_m, spec.ngram_min_hits)
    if spec_type == "draft-simple":
        if not draft_path:
            raise SpecrunError("--spec-type draft needs a draft model: add -md DRAFT.gguf "
                               "(a small model of the same family)")
        return DraftModel(target, draft_path)
    if spec_type == "draft-eagle3":
        if not draft_path:
            raise SpecrunError("--spec-type draft-eagle3 needs an EAGLE-3 draft: add -md EAGLE3.gguf "
                               "(converted for this model)")
        return DraftEagle3(target, draft_path)
    if spec_type == "draft-mtp":
        return DraftMTP(target, heads_path)
    raise SpecrunError(f"unknown spec type '{spec_type}'")
