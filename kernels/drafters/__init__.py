"""The drafters, one small file each, and the one factory that builds them from a spec type.

    ngram_simple.py   ngram-simple   copies what followed the last earlier occurrence of the last n tokens
    ngram_map.py      ngram-map-k    the same through a hash table of keys, each draft as long as the key's last accepted
                      ngram-map-k4v  ... and only when one of the (up to 4) m-grams after the key dominates
    ngram_mod.py      ngram-mod      a pool of 2^22 hashed n-grams -> next token, chained token by token
    ngram_cache.py    ngram-cache    the most frequent next token after the last 4..1 tokens (+ -lcs/-lcd files)
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
from .ngram_cache import N_DRAFT, NgramCache
from .ngram_map import NgramMapK, NgramMapK4V
from .ngram_mod import NgramMod
from .ngram_simple import NgramSimple

__all__ = ["HIDDEN_TYPES", "DraftEagle3", "DraftMTP", "DraftModel", "NgramCache", "NgramMapK", "NgramMapK4V", "NgramMod",
           "NgramSimple", "TargetView", "draft_n_max", "drafter_key", "make_drafter"]

# the spec types whose drafters read the target's rows (Drafter.needs_hidden): draft-mtp, draft-eagle3
HIDDEN_TYPES = frozenset(c.spec_type for c in (DraftEagle3, DraftModel, DraftMTP, NgramCache, NgramMapK, NgramMapK4V,
                                               NgramMod, NgramSimple) if c.needs_hidden)


def draft_n_max(spec_type: str, spec: SpecParams) -> int:
    """The longest draft of a drafter, as llama.cpp bounds it (common_speculative_n_max): an n-gram
    drafter's own bound (ngram-simple / map-k / map-k4v: their size_m, ngram-mod: --spec-ngram-mod-n-max,
    ngram-cache: 8), a model drafts at most --spec-draft-n-max tokens. The engine adds its own
    bounds (context room, tokens left, its cap)."""
    return {"ngram-simple": spec.ngram_size_m, "ngram-map-k": spec.ngram_map_k.size_m,
            "ngram-map-k4v": spec.ngram_map_k4v.size_m, "ngram-mod": spec.ngram_mod.n_max,
            "ngram-cache": N_DRAFT}.get(spec_type, spec.n_max)


def drafter_key(spec_type: str, spec: SpecParams) -> tuple:
    """The settings that make two drafters of a type different (an engine caches one per key)."""
    if spec_type == "ngram-simple":
        return (spec_type, spec.ngram_size_n, spec.ngram_size_m, spec.ngram_match or "last")
    own = {"ngram-map-k": spec.ngram_map_k, "ngram-map-k4v": spec.ngram_map_k4v, "ngram-mod": spec.ngram_mod,
           "ngram-cache": spec.ngram_cache}.get(spec_type)
    return (spec_type,) if own is None else (spec_type, own)


def make_drafter(spec_type: str, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                 heads_path: str | None = None) -> Drafter:
    """A new drafter of spec_type. draft_path: the -md model of draft-simple or draft-eagle3;
    heads_path: an MTP-only GGUF for draft-mtp (None: the target's own heads, which must have been
    loaded)."""
    if spec_type == "ngram-simple":
        return NgramSimple(spec.ngram_size_n, spec.ngram_size_m, spec.ngram_min_hits, spec.ngram_match or "last")
    if spec_type in ("ngram-map-k", "ngram-map-k4v"):
        p = spec.ngram_map_k if spec_type == "ngram-map-k" else spec.ngram_map_k4v
        return (NgramMapK if spec_type == "ngram-map-k" else NgramMapK4V)(p.size_n, p.size_m, p.min_hits)
    if spec_type == "ngram-mod":
        return NgramMod(spec.ngram_mod.n_match, spec.ngram_mod.n_min, spec.ngram_mod.n_max)
    if spec_type == "ngram-cache":
        return NgramCache(spec.ngram_cache.lookup_cache_static, spec.ngram_cache.lookup_cache_dynamic)
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
