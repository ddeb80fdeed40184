"""What a generation is asked to do: llama.cpp's --spec-* options and the engine's settings.

Spec types are exactly llama.cpp's --spec-type strings, plus specrun's own `suffix` (suffix decoding,
which llama.cpp lacks); several may be combined, and they are then tried in llama.cpp's order (n-grams
first, then suffix, then the draft model, then MTP heads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specrun.gguf_spec.errors import SpecrunError

if TYPE_CHECKING:
    from .rpc import Placement

NGRAM_CACHE_N_DRAFT = 8   # ngram-cache's longest draft: fixed in llama.cpp ("TODO get from config?")


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
class SuffixParams:
    """--spec-suffix-*: suffix decoding's settings (specrun's own flags: llama.cpp has no suffix type;
    the defaults are vLLM's suffix_decoding_* ones, from Snowflake's ArcticInference)."""

    max_depth: int = 24               # a match and its draft together span at most this many tokens
    max_spec_factor: float = 1.0      # a draft is at most this many times the match's length
    min_token_prob: float = 0.1       # a drafted token's estimated probability (counts along the path) >= this
    max_cached_requests: int = 10000  # requests whose output the global tree keeps (least recent out); 0: no global tree
    cache_file: str | None = None     # --spec-suffix-cache: the global tree, loaded at start and saved at exit


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
    suffix: SuffixParams = SuffixParams()
    verify: str = "auto"       # auto | match | rejection
    adaptive: bool = False     # each step's draft length from acceptance and pass cost (kernels/draftlen), 1..n_max


@dataclass(frozen=True, slots=True)
class SpecType:
    """One --spec-type: what every layer needs to know of it. A new drafter is one file in
    kernels/drafters/ (a class with spec_type, needs_hidden and from_spec) and one line in
    SPEC_TYPE_LIST below."""

    name: str                # exactly llama.cpp's --spec-type string (llama-server's, for `specrun export`)
    order: int               # its place in llama.cpp's common_speculative_init (n-grams first; suffix after them)
    drafter: str             # "module.Class" in kernels/drafters/: the class whose from_spec() builds it
    vllm: str | None         # `specrun export`: vLLM's speculative method (None: vLLM has none)
    sglang: str              # `specrun export`: SGLang's --speculative-algorithm
    aliases: tuple[str, ...] = ()
    model: bool = False      # drafts with a model (a decode per drafted token); False: an n-gram lookup in the text
    md: str | None = None    # what -md must hold for it ("a draft model: add -md DRAFT.gguf ..."); None: no -md
    mtp_heads: bool = False  # reads MTP heads (the model's own, or -md HEADS.gguf)
    hidden: bool = False     # reads the target's rows (its drafter's needs_hidden)
    adaptive: bool = False   # --spec-draft-adaptive is its default (--no-spec-draft-adaptive: fixed lengths)
    # its longest draft, as llama.cpp's common_speculative_n_max (a model's: --spec-draft-n-max)
    n_max: Callable[[SpecParams], int] = lambda s: s.n_max
    # the settings that make two of its drafters differ (an engine caches one per key)
    key: Callable[[SpecParams], tuple] = lambda s: ()
    # its settings as a stats line names them ("size-n 12 size-m 48")
    label: Callable[[SpecParams], str] = lambda s: f"n-max {s.n_max}"

    @property
    def flag(self) -> str:
        """How --spec-type's messages spell it (its first alias: draft)."""
        return self.aliases[0] if self.aliases else self.name


def _map_label(p: NgramMapParams) -> str:
    return f"size-n {p.size_n} size-m {p.size_m}" + f" min-hits {p.min_hits}" * (p.min_hits > 1)


# every spec type, in the order --spec-type's help and errors list them; the defaults of their
# settings are SpecParams' and the Ngram*Params' above
SPEC_TYPE_LIST = (
    SpecType("draft-simple", 6, "draft_model.DraftModel", "draft_model", "STANDALONE", aliases=("draft",), model=True,
             md="a draft model: add -md DRAFT.gguf (a small model of the same family)"),
    SpecType("draft-eagle3", 7, "draft_eagle3.DraftEagle3", "eagle3", "EAGLE3", model=True, hidden=True,
             md="an EAGLE-3 draft: add -md EAGLE3.gguf (converted for this model)"),
    SpecType("draft-mtp", 8, "draft_mtp.DraftMTP", "mtp", "NEXTN", model=True, mtp_heads=True, hidden=True),
    SpecType("ngram-simple", 0, "ngram_simple.NgramSimple", "ngram", "NGRAM", n_max=lambda s: s.ngram_size_m,
             key=lambda s: (s.ngram_size_n, s.ngram_size_m, s.ngram_match or "last"),
             label=lambda s: f"size-n {s.ngram_size_n} size-m {s.ngram_size_m}"
                             + " longest match" * (s.ngram_match == "longest")),
    SpecType("ngram-map-k", 1, "ngram_map.NgramMapK", "ngram", "NGRAM", n_max=lambda s: s.ngram_map_k.size_m,
             key=lambda s: (s.ngram_map_k,), label=lambda s: _map_label(s.ngram_map_k)),
    SpecType("ngram-map-k4v", 2, "ngram_map.NgramMapK4V", "ngram", "NGRAM", n_max=lambda s: s.ngram_map_k4v.size_m,
             key=lambda s: (s.ngram_map_k4v,), label=lambda s: _map_label(s.ngram_map_k4v)),
    SpecType("ngram-mod", 3, "ngram_mod.NgramMod", "ngram", "NGRAM", n_max=lambda s: s.ngram_mod.n_max,
             key=lambda s: (s.ngram_mod,),
             label=lambda s: f"n-match {s.ngram_mod.n_match} n-min {s.ngram_mod.n_min} n-max {s.ngram_mod.n_max}"),
    SpecType("ngram-cache", 4, "ngram_cache.NgramCache", None, "NGRAM", n_max=lambda s: NGRAM_CACHE_N_DRAFT,
             key=lambda s: (s.ngram_cache,), label=lambda s: ""),
    # specrun's own (llama.cpp has none): after llama.cpp's n-grams, before the model drafters
    SpecType("suffix", 5, "suffix.Suffix", "suffix", "SUFFIX", adaptive=True, n_max=lambda s: max(1, s.suffix.max_depth - 1),
             key=lambda s: (s.suffix,),
             label=lambda s: f"max-depth {s.suffix.max_depth} max-spec-factor {s.suffix.max_spec_factor:g} "
                             f"min-token-prob {s.suffix.min_token_prob:g}"),
)
SPEC_TYPE = {t.name: t for t in SPEC_TYPE_LIST}
IN_ORDER = tuple(sorted(SPEC_TYPE_LIST, key=lambda t: t.order))   # llama.cpp's order
SPEC_TYPES = ("none", *SPEC_TYPE)
SPEC_ALIASES = {a: t.name for t in SPEC_TYPE_LIST for a in t.aliases}
NGRAM_TYPES = tuple(t.name for t in IN_ORDER if not t.model)   # no model needed: a lookup in the text
MODEL_TYPES = tuple(t.name for t in IN_ORDER if t.model)       # a model drafts (a decode per drafted token)


def spelled(types: Iterable[SpecType]) -> str:
    """'draft-simple (alias draft), draft-eagle3, ...': the names as help texts list them."""
    return ", ".join(t.name + (f" (alias {', '.join(t.aliases)})" if t.aliases else "") for t in types)


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
    return tuple(sorted(out, key=lambda t: SPEC_TYPE[t].order))


def adaptive_default(types: Iterable[str]) -> bool:
    """Whether drafts are adaptive when neither --spec-draft-adaptive nor its --no- form is given:
    when a type among them drafts adaptive by default (suffix)."""
    return any(SPEC_TYPE[t].adaptive for t in types if t in SPEC_TYPE)


def check_md(types: Iterable[str], has_md: bool) -> None:
    """SpecrunError when a type that drafts with -md's file has none: the one place that says so."""
    for t in types:
        own = SPEC_TYPE.get(t)
        if own is not None and own.md and not has_md:
            raise SpecrunError(f"--spec-type {own.flag} needs {own.md}")


def no_mtp_heads(model_path: object) -> SpecrunError:
    """draft-mtp asked of a model without MTP heads (and no -md HEADS.gguf): the one place that says so."""
    return SpecrunError(f"{model_path}: the model has no MTP heads, so --spec-type draft-mtp is not available; "
                        f"run `specrun inspect {model_path}` to see what it holds, or pass MTP heads with "
                        "-md HEADS.gguf")


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
