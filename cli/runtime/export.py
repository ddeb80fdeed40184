"""specrun's speculative settings in another engine's own terms: what `specrun export --to
vllm|sglang|llama-server` prints. `export_command(plan) -> Export` is pure (nothing is read or
loaded); `weights(path)` reads what it needs from a GGUF's metadata (gguf_spec.source): the
Hugging Face repository the file was converted from.

The three tables below (one per engine) say, for each specrun spec type, what the engine runs
instead, and were checked against the sources cited beside them. A row is one of:
- exact: the same drafter and the same numbers in the engine's spelling;
- nearest: the engine's closest drafter, with one line on stderr naming what differs;
- none: no equivalent, an ExportError (one line, exit 1) that names what the engine does have.

| specrun --spec-type | vLLM --speculative-config         | SGLang --speculative-algorithm     | llama-server --spec-type |
|---------------------|-----------------------------------|------------------------------------|--------------------------|
| none                | (none)                            | (none)                             | (none)                   |
| draft-simple        | draft_model: exact                | STANDALONE: exact                  | draft-simple: exact      |
| draft-eagle3        | eagle3: exact (HF draft)          | EAGLE3: exact (HF draft)           | draft-eagle3: exact      |
| draft-mtp           | mtp: exact (the model's own heads)| NEXTN: exact (the model's own)     | draft-mtp: exact         |
| ngram-simple        | ngram: exact                      | NGRAM: nearest (a trie, not a scan)| ngram-simple: exact      |
| ngram-map-k         | ngram: nearest                    | NGRAM: nearest                     | ngram-map-k: exact       |
| ngram-map-k4v       | ngram: nearest                    | NGRAM: nearest                     | ngram-map-k4v: exact     |
| ngram-mod           | ngram: nearest                    | NGRAM: nearest                     | ngram-mod: exact         |
| ngram-cache         | none (ExportError)                | NGRAM match-type PROB: nearest     | ngram-cache: exact       |
| suffix              | suffix: exact (its settings)      | SUFFIX: nearest (settings unsent)  | none (ExportError)       |
| auto                | none: measured after loading      | none                               | none                     |
| several types       | none: one method per server       | none: one algorithm per server     | the same list: exact     |
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.source import source
from specrun.kernels.params import MODEL_TYPES, NGRAM_TYPES, SPEC_TYPE, SpecParams

ENGINES = ("vllm", "sglang", "llama-server")
TOKENIZER_PLACEHOLDER = "<HF-REPO>"           # the user fills it in: vLLM's/SGLang's --tokenizer(-path)
DRAFT_PLACEHOLDER = "<DRAFT-HF-REPO>"


class ExportError(SpecrunError):
    """A setting the target engine has no equivalent for."""


@dataclass(frozen=True, slots=True)
class Weights:
    """One GGUF as an exported command names it."""

    path: Path               # the resolved GGUF (absolute)
    hf_repo: str | None      # "google/gemma-3-270m": the repository its metadata names; None: none found
    hf_key: str | None       # the metadata key hf_repo came from
    has_mtp: bool            # {arch}.nextn_predict_layers > 0 (gguf_spec.read_layout)
    known_as: str | None = None   # "general.organization 'HuggingFaceTB', general.name 'Smollm2 135M'": a hint
    k_head: int | None = None     # K's head size (llama.cpp's n_embd_head_k); None: unknown


@dataclass(frozen=True, slots=True)
class Plan:
    """What to export: `specrun serve`'s settings, files resolved and the spec type decided
    (never auto, never inferred: runtime.loading.prepare has run)."""

    engine: str              # one of ENGINES
    model: Weights
    draft: Weights | None    # -md
    spec: SpecParams
    alias: str               # the model's name in requests and responses (serve's -a, else the -m name)
    host: str
    port: int
    n_ctx: int               # 0: the model's training context
    n_threads: int           # 0: not given
    passthrough: tuple[tuple[str, str], ...] = ()   # llama.cpp flags given, as llama-server spells them
    exact: bool = False      # specrun's exact mode (serve's default; --no-exact turns it off)


@dataclass(frozen=True, slots=True)
class Export:
    argv: tuple[str, ...]    # the command, one word each (shlex.join prints it)
    notes: tuple[str, ...]   # lines for stderr: what differs, what to fill in


def weights(path: str | os.PathLike) -> Weights:
    """A resolved GGUF's Weights (metadata only: gguf_spec.source)."""
    src = source(path)
    return Weights(Path(os.path.abspath(path)), src.hf_repo, src.hf_key, src.has_mtp, src.known_as, src.k_head)


def head_k_type(k_head: int | None) -> str:
    """The K cache type exact mode keeps for a head size: q8_0, or bf16 where Q8_0's 32-value blocks
    do not divide it (80, as phi-2's)."""
    return "bf16" if k_head is not None and k_head % 32 else "q8_0"


def export_command(plan: Plan) -> Export:
    """The command that serves plan's model with plan's speculative settings on plan.engine.
    raises: ExportError (one line) where the engine has no equivalent."""
    if plan.engine not in ENGINES:
        raise ExportError(f"unknown engine '{plan.engine}'; export --to one of: {', '.join(ENGINES)}")
    return {"vllm": _vllm, "sglang": _sglang, "llama-server": _llama_server}[plan.engine](plan)


# ---- llama-server ---------------------------------------------------------------------------------
# Checked against the llama.cpp that llama-cpp-python 0.3.36 vendors (build/peers/llama_cpp_python-0.3.36/
# vendor/llama.cpp): common/arg.cpp (the flag spellings: -m, -md, --spec-type, --spec-draft-n-max/-n-min/
# -p-min, --spec-ngram-simple-size-n/-size-m/-min-hits, --spec-ngram-map-k[4v]-size-n/-size-m/-min-hits,
# --spec-ngram-mod-n-match/-n-min/-n-max, -lcs, -lcd, -c, -t, --host, --port, --alias) and
# docs/speculative.md (the type names: draft-simple, draft-eagle3, draft-mtp, ngram-*). specrun's flags
# are llama-server's, so every row is exact.

def _llama_server(p: Plan) -> Export:
    s, notes = p.spec, []
    if "suffix" in s.types:
        raise ExportError("llama-server has no suffix decoding (--spec-type suffix is specrun's own); its nearest "
                          "drafters are the n-gram types (export --spec-type ngram-mod or ngram-simple), or "
                          "export --to vllm, whose method suffix is the same algorithm")
    argv = ["llama-server", "-m", str(p.model.path)]
    if p.draft is not None and set(MODEL_TYPES) & set(s.types):
        argv += ["-md", str(p.draft.path)]
    argv += ["--host", p.host, "--port", str(p.port), "-c", str(p.n_ctx)]
    if p.n_threads:
        argv += ["-t", str(p.n_threads)]
    argv += ["--alias", p.alias]
    for flag, value in p.passthrough:
        argv += [flag, value]
    if s.types:
        argv += ["--spec-type", ",".join(s.types)]
    if set(MODEL_TYPES) & set(s.types):
        argv += ["--spec-draft-n-max", str(s.n_max)]
        argv += ["--spec-draft-n-min", str(s.n_min)] if s.n_min else []
        argv += ["--spec-draft-p-min", f"{s.p_min:g}"] if s.p_min else []
    if "ngram-simple" in s.types:
        argv += ["--spec-ngram-simple-size-n", str(s.ngram_size_n), "--spec-ngram-simple-size-m", str(s.ngram_size_m)]
        argv += ["--spec-ngram-simple-min-hits", str(s.ngram_min_hits)] if s.ngram_min_hits != 1 else []
        if s.ngram_match == "longest":
            notes.append("--spec-ngram-simple-match longest: not exported; llama-server's ngram-simple copies from "
                         "the last earlier occurrence of the pattern")
    for t, m in (("k", s.ngram_map_k), ("k4v", s.ngram_map_k4v)):
        if f"ngram-map-{t}" in s.types:
            argv += [f"--spec-ngram-map-{t}-size-n", str(m.size_n), f"--spec-ngram-map-{t}-size-m", str(m.size_m)]
            argv += [f"--spec-ngram-map-{t}-min-hits", str(m.min_hits)] if m.min_hits != 1 else []
    if "ngram-mod" in s.types:
        m = s.ngram_mod
        argv += ["--spec-ngram-mod-n-match", str(m.n_match), "--spec-ngram-mod-n-min", str(m.n_min),
                 "--spec-ngram-mod-n-max", str(m.n_max)]
    if "ngram-cache" in s.types:
        c = s.ngram_cache
        if c.lookup_cache_static:
            argv += ["-lcs", os.path.abspath(c.lookup_cache_static)]
        if c.lookup_cache_dynamic:
            argv += ["-lcd", os.path.abspath(c.lookup_cache_dynamic)]
            notes.append(f"-lcd {c.lookup_cache_dynamic}: llama-server also writes what it generates into this "
                         "file (\"updated by generation\"); specrun only reads it")
    if s.n_min and not set(MODEL_TYPES) & set(s.types) and s.types:
        notes.append(f"--spec-draft-n-min {s.n_min}: not exported; llama-server applies it to draft-model, EAGLE-3 "
                     "and MTP drafts only, not to n-gram ones")
    if s.adaptive and s.types:
        notes.append("--spec-draft-adaptive: not exported; llama-server drafts up to the n-max / size-m given")
    if s.verify == "rejection":
        notes.append("--spec-verify rejection: not exported; llama-server verifies by matching the sampled token "
                     "(specrun's `match`), which is lossless too")
    if p.exact:
        # exact mode's K rows: Q8_0, or BF16 where Q8_0's 32-value blocks do not divide the head size
        # (kernels/llama.py), which llama-server would refuse as -ctk q8_0
        k = head_k_type(p.model.k_head)
        own = {"-ctk": k, "-ctv": "f16", "-fa": "on"}       # exact mode's cache and attention
        given = " ".join(f"{f} {v}" for f, v in p.passthrough if f in own and v != own[f])
        instead = f"; the {given} above goes to llama-server as given, where exact mode did not apply it" if given else ""
        notes.append("exact mode: not exported; llama-server has none (its verify batches may differ from one-token "
                     f"decoding); GGML_CPU_TILED_MM=0 in its environment and -nr -ctk {k} give it exact mode's kernels "
                     f"and KV types{instead} (--no-exact: this line goes)")
    return Export(tuple(argv), tuple(notes))


# ---- vLLM -----------------------------------------------------------------------------------------
# Checked against vLLM's vllm/config/speculative.py (github.com/vllm-project/vllm, commit 002e77c1):
# SpeculativeMethod ("ngram", "draft_model", "eagle", "eagle3", "mtp", "suffix", ...), `mtp` without
# `model` uses the target's own checkpoint, `ngram` takes prompt_lookup_min <= prompt_lookup_max (the
# n-gram window) and num_speculative_tokens (the draft length); and the docs
# https://docs.vllm.ai/en/latest/features/speculative_decoding/ (n_gram/, eagle/, mtp, draft_model)
# for `vllm serve MODEL --speculative-config JSON`. GGUF: https://docs.vllm.ai/en/latest/features/
# quantization/gguf/ (a single-file GGUF, with --tokenizer naming the original repository).

def _vllm(p: Plan) -> Export:
    s, notes = p.spec, []
    t = _one_type(p, "vLLM", "method")
    argv = ["vllm", "serve", *_target(p, "vLLM", "--tokenizer", notes),
            "--host", p.host, "--port", str(p.port), "--served-model-name", p.alias]
    if p.n_ctx:
        argv += ["--max-model-len", str(p.n_ctx)]
    cfg: dict[str, object] | None = None
    own = SPEC_TYPE[t] if t is not None else None
    if own is not None and own.md:
        cfg = {"method": own.vllm, "model": _draft_repo(p, "vLLM", notes), "num_speculative_tokens": s.n_max}
    elif own is not None and own.mtp_heads:
        cfg = {"method": own.vllm, "num_speculative_tokens": s.n_max}
        _mtp_notes(p, "vLLM", notes)
    elif own is not None and own.vllm is None:
        raise ExportError("vLLM has no n-gram cache (llama.cpp's lookup statistics, -lcs/-lcd files); its drafters "
                          "without a model are ngram (export --spec-type ngram-simple) and suffix; or export "
                          "--to llama-server")
    elif t == "suffix":
        x = s.suffix
        cfg = {"method": own.vllm, "num_speculative_tokens": x.max_depth, "suffix_decoding_max_tree_depth": x.max_depth,
               "suffix_decoding_max_cached_requests": x.max_cached_requests,
               "suffix_decoding_max_spec_factor": x.max_spec_factor, "suffix_decoding_min_token_prob": x.min_token_prob}
        _suffix_notes(p, "vLLM", notes)
    elif t in NGRAM_TYPES:
        n, k = _ngram_window(s, t)
        cfg = {"method": own.vllm, "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": n}
        _ngram_notes(p, t, "vLLM's ngram (the latest earlier match of the last N tokens, K tokens copied)", notes)
    if cfg is not None:
        argv += ["--speculative-config", json.dumps(cfg)]
        _draft_knobs(p, t, "vLLM", notes)
    _not_exported(p, "vLLM", notes)
    return Export(tuple(argv), tuple(notes))


# ---- SGLang ---------------------------------------------------------------------------------------
# Checked against SGLang's docs/advanced_features/speculative_decoding.md (github.com/sgl-project/sglang,
# commit 067ad4d3; https://docs.sglang.io/docs/advanced_features/speculative_decoding): --speculative-
# algorithm EAGLE | EAGLE3 | STANDALONE | NGRAM | NEXTN (alias of EAGLE, the model's own MTP heads: no
# --speculative-draft-model-path), --speculative-num-steps (draft depth), --speculative-eagle-topk (1: a
# chain, as llama.cpp drafts), --speculative-num-draft-tokens (verified per step, the tree's root
# included: with topk 1 it is num_steps + 1), --speculative-ngram-min/max-match-window-size,
# --speculative-ngram-max-bfs-breadth, --speculative-ngram-match-type BFS | PROB; and
# python/sglang/srt/server_args.py (commit 001067ff) for --model-path, --tokenizer-path, --context-length,
# --served-model-name, --host, --port, and a .gguf --model-path.

def _sglang(p: Plan) -> Export:
    s, notes = p.spec, []
    t = _one_type(p, "SGLang", "algorithm")
    argv = ["python", "-m", "sglang.launch_server", "--model-path",
            *_target(p, "SGLang", "--tokenizer-path", notes),
            "--host", p.host, "--port", str(p.port), "--served-model-name", p.alias]
    if p.n_ctx:
        argv += ["--context-length", str(p.n_ctx)]
    if t in MODEL_TYPES:
        argv += ["--speculative-algorithm", SPEC_TYPE[t].sglang]
        if SPEC_TYPE[t].mtp_heads:
            _mtp_notes(p, "SGLang", notes)
        else:
            argv += ["--speculative-draft-model-path", _draft_repo(p, "SGLang", notes)]
        argv += ["--speculative-num-steps", str(s.n_max), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(s.n_max + 1)]
    elif t == "suffix":
        argv += ["--speculative-algorithm", SPEC_TYPE[t].sglang, "--speculative-num-draft-tokens",
                 str(s.suffix.max_depth)]
        notes.append("--spec-type suffix: SGLang's SUFFIX is newer than the SGLang docs this export was checked "
                     "against; the --spec-suffix-* settings are not exported (check its own suffix flags)")
        _suffix_notes(p, "SGLang", notes)
    elif t in NGRAM_TYPES:
        c = s.ngram_cache
        if t == "ngram-cache" and (c.lookup_cache_static or c.lookup_cache_dynamic):
            raise ExportError("SGLang cannot read llama.cpp's n-gram cache files (-lcs/-lcd); its NGRAM drafter "
                              "builds its own cache from the text: leave -lcs/-lcd out, or export --to llama-server")
        n, k = _ngram_window(s, t)
        lo = 1 if t == "ngram-cache" else n
        argv += ["--speculative-algorithm", SPEC_TYPE[t].sglang, "--speculative-num-draft-tokens", str(k + 1),
                 "--speculative-ngram-min-match-window-size", str(lo), "--speculative-ngram-max-match-window-size",
                 str(n), "--speculative-ngram-max-bfs-breadth", "1"]
        if t == "ngram-cache":
            argv += ["--speculative-ngram-match-type", "PROB"]
        _ngram_notes(p, t, "SGLang's NGRAM (a cache of the text's n-grams shared by all requests, one chain "
                           "drafted, CUDA only)", notes, simple_exact=False)
    if t is not None:
        _draft_knobs(p, t, "SGLang", notes)
    _not_exported(p, "SGLang", notes)
    return Export(tuple(argv), tuple(notes))


# ---- shared ---------------------------------------------------------------------------------------

def _one_type(p: Plan, engine: str, word: str) -> str | None:
    """The one spec type (None for none); several are an ExportError: these engines run one."""
    if len(p.spec.types) > 1:
        raise ExportError(f"{engine} runs one speculative {word} per server, not {len(p.spec.types)} "
                          f"({','.join(p.spec.types)}); export one --spec-type, or --to llama-server, which "
                          "combines them")
    return p.spec.types[0] if p.spec.types else None


def _target(p: Plan, engine: str, tokenizer_flag: str, notes: list[str]) -> list[str]:
    """The model words: its Hugging Face repository when the GGUF names one (engine loads the original
    weights), else the GGUF itself with the tokenizer left for the user to name."""
    m = p.model
    if m.hf_repo:
        notes.append(f"{engine} loads {m.hf_repo} (the GGUF's {m.hf_key}), the weights {m.path.name} was converted "
                     f"from, not the GGUF itself: its quantization differs, so texts can differ from specrun's")
        return [m.hf_repo]
    known = f"; it says {m.known_as}" if m.known_as else ""
    notes.append(f"{m.path.name} names no Hugging Face repository (general.source.repo_url, general.source.url), "
                 f"so {engine} gets the GGUF itself: replace {TOKENIZER_PLACEHOLDER} with the repository it was "
                 f"converted from{known} ({engine} documents GGUF support as experimental and wants the original "
                 "tokenizer)")
    return [str(m.path), tokenizer_flag, TOKENIZER_PLACEHOLDER]


def _draft_repo(p: Plan, engine: str, notes: list[str]) -> str:
    d = p.draft
    assert d is not None, "prepare() requires -md for draft-simple and draft-eagle3"
    if d.hf_repo:
        notes.append(f"-md {d.path.name}: {engine} loads the draft {d.hf_repo} (its {d.hf_key})")
        return d.hf_repo
    notes.append(f"-md {d.path.name} names no Hugging Face repository and {engine} loads drafts from one: replace "
                 f"{DRAFT_PLACEHOLDER} with the draft's original repository")
    return DRAFT_PLACEHOLDER


def _mtp_notes(p: Plan, engine: str, notes: list[str]) -> None:
    if p.draft is not None and not p.model.has_mtp:
        notes.append(f"-md {p.draft.path.name}: not exported; {engine} reads the MTP heads from the model's own "
                     "checkpoint (the one the heads were extracted from)")


def _ngram_window(s: SpecParams, t: str) -> tuple[int, int]:
    """(the n-gram looked up, the most tokens drafted) of an n-gram type."""
    if t == "ngram-simple":
        return s.ngram_size_n, s.ngram_size_m
    if t in ("ngram-map-k", "ngram-map-k4v"):
        m = s.ngram_map_k if t == "ngram-map-k" else s.ngram_map_k4v
        return m.size_n, m.size_m
    if t == "ngram-mod":
        return s.ngram_mod.n_match, s.ngram_mod.n_max
    return 4, min(8, s.n_max)    # ngram-cache: 1..4-grams, at most 8 tokens (kernels/drafters/ngram_cache.py)


def _ngram_notes(p: Plan, t: str, nearest: str, notes: list[str], simple_exact: bool = True) -> None:
    s = p.spec
    what = {"ngram-simple": None if simple_exact else "the one latest occurrence in this request's text",
            "ngram-map-k": "a hash map of earlier keys, a key's draft no longer than its last accepted run",
            "ngram-map-k4v": "up to 4 continuations counted per key, drafted only when one wins by 2x "
                             f"(min-hits {s.ngram_map_k4v.min_hits})",
            "ngram-mod": f"one pool of hashed n-grams shared by every request, no draft shorter than "
                         f"n-min {s.ngram_mod.n_min}",
            "ngram-cache": "llama.cpp's lookup statistics over 1..4-grams"}.get(t)
    if what:
        notes.append(f"--spec-type {t} has no equivalent; nearest: {nearest}; not carried over: {what}")
    elif t == "ngram-simple" and s.ngram_min_hits != 1:
        notes.append(f"--spec-ngram-simple-min-hits {s.ngram_min_hits}: not exported; {nearest} has no such setting")


def _suffix_notes(p: Plan, engine: str, notes: list[str]) -> None:
    if p.spec.suffix.cache_file:
        notes.append(f"--spec-suffix-cache {p.spec.suffix.cache_file}: not exported; {engine} keeps its global tree "
                     "in memory only")


def _draft_knobs(p: Plan, t: str | None, engine: str, notes: list[str]) -> None:
    s = p.spec
    if t in MODEL_TYPES and s.n_min:
        notes.append(f"--spec-draft-n-min {s.n_min}: not exported; {engine} verifies every draft")
    if t in MODEL_TYPES and s.p_min:
        notes.append(f"--spec-draft-p-min {s.p_min:g}: not exported; {engine} drafts the full length")
    if s.adaptive:
        notes.append(f"--spec-draft-adaptive: not exported; {engine}'s draft length is the fixed one above")


def _not_exported(p: Plan, engine: str, notes: list[str]) -> None:
    if p.n_threads:
        notes.append(f"-t {p.n_threads}: not exported; {engine} runs the model on the GPU")
    if p.passthrough:
        flags = ", ".join(f for f, _ in p.passthrough)
        notes.append(f"{flags}: not exported; llama.cpp's own settings ({engine} chooses its own)")
