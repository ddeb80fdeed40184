"""What a generation is asked to do: llama.cpp's --spec-* options and the engine's settings.

Spec types are exactly llama.cpp's --spec-type strings; several may be combined, and they are
then tried in llama.cpp's order (n-grams first, then the draft model, then MTP heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specrun.gguf_spec.errors import SpecrunError

if TYPE_CHECKING:
    from .rpc import Placement

NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")  # no model needed
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", *NGRAM_TYPES)
SPEC_ALIASES = {"draft": "draft-simple"}
# llama.cpp's common_speculative_init: the n-grams first, in this order, then the model drafters
_ORDER = {t: i for i, t in enumerate((*NGRAM_TYPES, "draft-simple", "draft-eagle3", "draft-mtp"))}


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
class NgramMapParams:
    """--spec-ngram-map-k-* / --spec-ngram-map-k4v-* (llama.cpp's common_params_speculative_ngram_map)."""

    size_n: int = 12     # the key: the last size_n tokens
    size_m: int = 48     # the value: the size_m tokens after an earlier occurrence; bounds the draft
    min_hits: int = 1    # k4v: lookups of a key before it drafts (ngram-map-k does not read it, as llama.cpp)


@dataclass(frozen=True, slots=True)
class NgramModParams:
    """--spec-ngram-mod-* (llama.cpp's common_params_speculative_ngram_mod)."""

    n_match: int = 24    # the hashed n-gram's length
    n_min: int = 48      # a chain of lookups that stops before n_min tokens drafts nothing
    n_max: int = 64      # the longest chain (the draft's bound)


@dataclass(frozen=True, slots=True)
class NgramCacheParams:
    """-lcs / -lcd: n-gram cache files made by llama.cpp's llama-lookup-create (read only)."""

    lookup_cache_static: str | None = None
    lookup_cache_dynamic: str | None = None


@dataclass(frozen=True, slots=True)
class SpecParams:
    """llama.cpp's --spec-* options (defaults as its common.h). ngram_size_* are ngram-simple's."""

    types: tuple[str, ...] = ()
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size_n: int = 12
    ngram_size_m: int = 48
    ngram_min_hits: int = 1
    ngram_match: str | None = None   # ngram-simple's occurrence: "last" (llama.cpp's), "longest" (specrun's);
                                     # None: last, and longest for --spec-type auto's candidates
    ngram_map_k: NgramMapParams = NgramMapParams()
    ngram_map_k4v: NgramMapParams = NgramMapParams()
    ngram_mod: NgramModParams = NgramModParams()
    ngram_cache: NgramCacheParams = NgramCacheParams()
    verify: str = "auto"       # auto | match | rejection
    adaptive: bool = False     # each step's draft length from acceptance and pass cost (kernels/draftlen), 1..n_max


KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")   # llama.cpp arg.cpp's kv_cache_types
_KV_QUANTIZED = {"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}


@dataclass(frozen=True, slots=True)
class KVParams:
    """The target context's KV cache and attention with exact mode off: llama.cpp's -ctk, -ctv and
    -fa (on | off | auto), with llama-server's defaults. Exact mode keeps its own (a Q8_0 K cache, an
    F16 V cache, flash attention on: what makes verify rows equal one-token decodes)."""

    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"

    def check(self) -> None:
        """SpecrunError for what llama.cpp refuses (llama_init_from_model returns NULL): a type it does
        not know, or a quantized V cache with flash attention off."""
        for flag, t in (("-ctk", self.type_k), ("-ctv", self.type_v)):
            if t not in KV_TYPES:
                raise SpecrunError(f"{flag} {t}: not a KV cache type; use one of {', '.join(KV_TYPES)}")
        if self.flash_attn not in ("on", "off", "auto"):
            raise SpecrunError(f"-fa {self.flash_attn}: use on, off or auto")
        if self.type_v in _KV_QUANTIZED and self.flash_attn == "off":
            raise SpecrunError(f"-ctv {self.type_v} with -fa off: llama.cpp keeps a quantized V cache only under "
                               "flash attention; drop -fa off (auto turns it on) or use -ctv f16")


@dataclass(frozen=True, slots=True)
class EngineParams:
    n_ctx: int = 4096
    n_batch: int = 2048
    n_threads: int = 0
    exact: bool = True
    fast_prefill: bool = True          # exact mode: long prompts' aligned blocks through an F16-KV context over
                                       # repacked weights, handed over (kernels/prefill.py); False saves both
    prefill_worker: bool | None = None  # that context in a child process with llama.cpp's tiled matmul on
                                        # (kernels/prefill_worker.py); None: when the file has tensors it takes
    spec: SpecParams = field(default_factory=SpecParams)
    draft_model: str | None = None     # -md: a draft GGUF (draft-simple), EAGLE-3 (draft-eagle3) or MTP heads (draft-mtp)
    exact_caveat: str | None = None    # why exact mode may not be bit-exact for these weights (stats line)
    placement: Placement | None = None  # --rpc: the target's layers on these workers (drafters stay local)
    kv: KVParams = KVParams()          # --no-exact: the target's -ctk / -ctv / -fa (exact mode keeps its own)

    def __post_init__(self) -> None:
        if not self.exact:
            self.kv.check()
