"""What a generation is asked to do: llama.cpp's --spec-* options and the engine's settings.

Spec types are exactly llama.cpp's --spec-type strings; several may be combined, and they are
then tried in llama.cpp's order (n-grams first, then the draft model, then MTP heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specrun.gguf_spec.errors import SpecrunError

SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "ngram-simple")
SPEC_ALIASES = {"draft": "draft-simple"}
_ORDER = {"ngram-simple": 0, "draft-simple": 1, "draft-eagle3": 2, "draft-mtp": 3}  # llama.cpp: n-grams first


def parse_spec_types(text: str) -> tuple[str, ...]:
    """'ngram-simple,draft' -> ('ngram-simple', 'draft-simple'), in llama.cpp's order; 'none' -> ()."""
    out: list[str] = []
    for raw in (t.strip() for t in text.split(",")):
        name = SPEC_ALIASES.get(raw, raw)
        if name not in SPEC_TYPES:
            valid = ", ".join([*SPEC_TYPES, *SPEC_ALIASES])
            raise SpecrunError(f"unknown spec type '{raw}'; valid types: {valid}")
        if name != "none" and name not in out:
            out.append(name)
    return tuple(sorted(out, key=_ORDER.__getitem__))


@dataclass(frozen=True, slots=True)
class SpecParams:
    """llama.cpp's --spec-* options (defaults as its common.h)."""

    types: tuple[str, ...] = ()
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size_n: int = 12
    ngram_size_m: int = 48
    ngram_min_hits: int = 1
    verify: str = "auto"       # auto | match | rejection
    adaptive: bool = False     # each step's draft length from acceptance and pass cost (kernels/draftlen), 1..n_max


@dataclass(frozen=True, slots=True)
class EngineParams:
    n_ctx: int = 4096
    n_batch: int = 2048
    n_threads: int = 0
    exact: bool = True
    fast_prefill: bool = True          # exact mode: long prompts' whole 512-token blocks through an F16-KV
                                       # context, handed over (kernels/prefill.py); False saves its KV memory
    spec: SpecParams = field(default_factory=SpecParams)
    draft_model: str | None = None     # -md: a draft GGUF (draft-simple), EAGLE-3 (draft-eagle3) or MTP heads (draft-mtp)
    exact_caveat: str | None = None    # why exact mode may not be bit-exact for these weights (stats line)
