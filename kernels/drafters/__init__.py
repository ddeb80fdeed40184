"""The drafters, one small file each, and the one factory that builds them from a spec type.

    ngram_simple.py   ngram-simple   copies what followed the last earlier occurrence of the last n tokens
    ngram_map.py      ngram-map-k    the same through a hash table of keys, each draft as long as the key's last accepted
                      ngram-map-k4v  ... and only when one of the (up to 4) m-grams after the key dominates
    ngram_mod.py      ngram-mod      a pool of 2^22 hashed n-grams -> next token, chained token by token
    ngram_cache.py    ngram-cache    the most frequent next token after the last 4..1 tokens (+ -lcs/-lcd files)
    suffix.py         suffix         suffix decoding: the best-counted path after the longest matches in the request's
                                     text and in earlier requests' outputs (specrun's own type; llama.cpp has none)
    draft_model.py    draft-simple   a second, smaller GGUF drafting in its own context
    draft_eagle3.py   draft-eagle3   an EAGLE-3 draft (-md), fed three of the target's layers
    draft_mtp.py      draft-mtp      the MTP (NextN) heads stored in the GGUF, fed the target's hidden rows

Every drafter implements kernels.types.Drafter (begin / propose / accept / close) and sees the
target only through a TargetView; its classmethod from_spec(target, spec, draft_path=,
heads_path=) builds it from a SpecParams. What a spec type is (its name, order, flags, bounds) is
its line in kernels.params.SPEC_TYPE_LIST, which names the class; everything here derives from it.
"""

from __future__ import annotations

import importlib

from specrun.gguf_spec.errors import SpecrunError

from ..params import SPEC_TYPE, SPEC_TYPE_LIST, SpecParams, SpecType, check_md
from ..types import Drafter
from .base import TargetView
from .draft_eagle3 import DraftEagle3
from .draft_model import DraftModel
from .draft_mtp import DraftMTP
from .ngram_cache import NgramCache
from .ngram_map import NgramMapK, NgramMapK4V
from .ngram_mod import NgramMod
from .ngram_simple import NgramSimple
from .suffix import Suffix

__all__ = ["DRAFTERS", "HIDDEN_TYPES", "DraftEagle3", "DraftMTP", "DraftModel", "NgramCache", "NgramMapK",
           "NgramMapK4V", "NgramMod", "NgramSimple", "Suffix", "TargetView", "draft_n_max", "drafter_key", "make_drafter"]


def _drafter_class(t: SpecType) -> type:
    module, name = t.drafter.rsplit(".", 1)
    cls = getattr(importlib.import_module(f".{module}", __name__), name)
    assert cls.spec_type == t.name and cls.needs_hidden == t.hidden, f"{t.drafter} does not draft {t.name} as listed"
    return cls


DRAFTERS = {t.name: _drafter_class(t) for t in SPEC_TYPE_LIST}   # spec type -> its drafter class

# the spec types whose drafters read the target's rows (Drafter.needs_hidden): draft-mtp, draft-eagle3
HIDDEN_TYPES = frozenset(t.name for t in SPEC_TYPE_LIST if t.hidden)


def draft_n_max(spec_type: str, spec: SpecParams) -> int:
    """The longest draft of a drafter, as llama.cpp bounds it (common_speculative_n_max): an n-gram
    drafter's own bound (ngram-simple / map-k / map-k4v: their size_m, ngram-mod: --spec-ngram-mod-n-max,
    ngram-cache: 8), a model drafts at most --spec-draft-n-max tokens (as does any drafter of
    another name, a test's). The engine adds its own bounds (context room, tokens left, its cap)."""
    own = SPEC_TYPE.get(spec_type)
    return own.n_max(spec) if own is not None else spec.n_max


def drafter_key(spec_type: str, spec: SpecParams) -> tuple:
    """The settings that make two drafters of a type different (an engine caches one per key)."""
    own = SPEC_TYPE.get(spec_type)
    return (spec_type,) if own is None else (spec_type, *own.key(spec))


def make_drafter(spec_type: str, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                 heads_path: str | None = None) -> Drafter:
    """A new drafter of spec_type. draft_path: the -md model of draft-simple or draft-eagle3;
    heads_path: an MTP-only GGUF for draft-mtp (None: the target's own heads, which must have been
    loaded)."""
    if spec_type not in DRAFTERS:
        raise SpecrunError(f"unknown spec type '{spec_type}'")
    check_md((spec_type,), bool(draft_path))
    return DRAFTERS[spec_type].from_spec(target, spec, draft_path=draft_path, heads_path=heads_path)
