"""Option bundles shared by run / chat / serve / bench, named as llama.cpp's common/arg.cpp, and
the only place where their values become the kernels' parameters (engine_params, spec_params,
sampling_params) and, for run and chat, RunOptions (run_options).

A llama.cpp flag that cannot apply here is still accepted: engine_params() says in one line on
stderr why, and what happens instead (e.g. `-ngl 99`: every layer runs on the CPU). One that would
change the text (`--override-kv`, `-ot`, a sampler specrun does not have) is refused by name in one
line, exit 2 (refuse_model_overrides, refuse_samplers)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import click
from click.core import ParameterSource

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.output import check_output
from specrun.kernels import rpc
from specrun.kernels.constrain import check_controls
from specrun.kernels.drafters.suffix import read_cache
from specrun.kernels.grammar import GrammarError, check_grammar, schema_to_gbnf
from specrun.kernels.params import (
    KV_TYPES,
    SPEC_TYPE_LIST,
    EngineParams,
    KVParams,
    NgramCacheParams,
    NgramMapParams,
    NgramModParams,
    SpecParams,
    SuffixParams,
    adaptive_default,
    parse_spec_types,
    spelled,
)
from specrun.kernels.types import LLAMA_DEFAULT_SEED, SamplingParams

from .console import err_console, note, setup_logging
from .prompts import process_escapes, read_prompt

AUTO = ("auto",)     # what --spec-type auto parses to; resolved after loading (runtime.auto)
INFER = ("infer",)   # no --spec-type: loading.prepare() infers it from -md's file (llama.cpp's rule), else none

DEFAULT_CHAT_MODEL = "smollm2-135m-instruct"   # the registry model with a chat template
UBATCH_DEFAULT = 512
MAX_THREADS = 512     # ggml.h GGML_MAX_N_THREADS: more crash the CPU backend (-t 100000: SIGSEGV)
# the --spec-* defaults (llama.cpp's common.h), written once in kernels.params
SPEC_DEFAULT, MAP_DEFAULT, MOD_DEFAULT = SpecParams(), NgramMapParams(), NgramModParams()
SUFFIX_DEFAULT = SuffixParams()


def _spec_type(ctx, param, value):
    if value is None:
        return INFER
    if value.strip() == "auto":
        return AUTO
    if "auto" in (t.strip() for t in value.split(",")):
        raise click.BadParameter(f"{value!r}: auto chooses among every type this model can use, so it stands "
                                 "alone: --spec-type auto")
    try:
        return parse_spec_types(value)
    except Exception as e:  # SpecrunError: an unknown name
        raise click.BadParameter(str(e)) from None


def _on_off_auto(ctx, param, value):
    """llama.cpp's is_truthy / is_falsey / is_autoy -> 'on' | 'off' | 'auto'."""
    if value is None:
        return None
    for word, spellings in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                            ("auto", ("auto", "-1"))):
        if value in spellings:
            return word
    raise click.BadParameter(f"unknown value '{value}': use on, off or auto")


def _gpu_layers(ctx, param, value):
    """A number of layers, 'auto' or 'all' (llama.cpp's -ngl)."""
    if value is None or value in ("auto", "all"):
        return value
    try:
        int(value)
    except ValueError:
        raise click.BadParameter(f"'{value}' is not a number of layers, 'auto' or 'all'") from None
    return value


def _seed(ctx, param, value):
    """llama.cpp's -s: 0..4294967295; -1 (its stoul wraps it to LLAMA_DEFAULT_SEED) or the default: random."""
    if value is None or value == -1:
        return LLAMA_DEFAULT_SEED
    if not 0 <= value <= LLAMA_DEFAULT_SEED:
        raise click.BadParameter(f"{value} is not a seed: use 0..{LLAMA_DEFAULT_SEED}, or -1 for a random one")
    return value


def _n_predict(ctx, param, value):
    """llama.cpp's -n: N tokens; -1 (until end of generation) or -2 (until the context is full), the
    same here, as specrun never shifts the context."""
    if value is not None and value < -2:
        raise click.BadParameter(f"{value} is not a number of tokens: give N >= 0, -1 (until end of generation or "
                                 "a full context) or -2 (until the context is full)")
    return value


def _numa(ctx, param, value):
    """llama.cpp's --numa TYPE (an empty TYPE is distribute)."""
    if value is None or value in ("distribute", "isolate", "numactl"):
        return value
    if value == "":
        return "distribute"
    raise click.BadParameter(f"unknown value '{value}': use distribute, isolate or numactl")


def kv_options(f):
    """-fa, -ctk, -ctv: the KV cache and attention, applied with --no-exact (kv_params)."""
    f = click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(KV_TYPES), default=None,
                     help="KV cache type for V with --no-exact (default f16; exact mode keeps f16; a quantized "
                          "V cache needs flash attention)")(f)
    f = click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(KV_TYPES), default=None,
                     help="KV cache type for K with --no-exact (default f16; exact mode keeps q8_0)")(f)
    return click.option("-fa", "--flash-attn", "flash_attn", callback=_on_off_auto, default=None,
                        metavar="on|off|auto", help="flash attention with --no-exact (default auto; exact mode "
                                                    "keeps it on)")(f)


def model_options(f=None, *, default: str = "gemma-3-270m"):
    """The model and context flags; @model_options, or @model_options(default=NAME) for a command
    whose -m defaults to another model (chat: DEFAULT_CHAT_MODEL)."""
    if f is None:
        return functools.partial(model_options, default=default)

    @click.option("-m", "--model", "model", envvar="SPECRUN_MODEL", default=default, show_default=True,
                  help="GGUF path, or a known model name (gemma-3-270m, smollm2-135m-instruct)")
    @click.option("-md", "--model-draft", "--spec-draft-model", "model_draft", default=None,
                  help="draft GGUF for --spec-type draft, an EAGLE-3 draft for draft-eagle3, or MTP heads (from "
                       "`specrun extract-mtp`) for draft-mtp; without --spec-type, the type is inferred from the file")
    @click.option("-c", "--ctx-size", "ctx_size", type=click.IntRange(0), default=4096, show_default=True,
                  help="context size in tokens (0: the model's training context)")
    @click.option("-b", "--batch-size", "batch_size", type=click.IntRange(1), default=2048, show_default=True)
    @click.option("-ub", "--ubatch-size", "ubatch_size", type=click.IntRange(1), default=None,
                  help=f"physical batch size (accepted; the engine uses llama.cpp's {UBATCH_DEFAULT})")
    @click.option("-t", "--threads", "threads", type=click.IntRange(0, MAX_THREADS), default=0,
                  help="CPU threads (default: the cores other work leaves idle)")
    @click.option("-tb", "--threads-batch", "threads_batch", type=int, default=None,
                  help="threads for prompt processing (accepted; the engine uses -t's)")
    @click.option("-ngl", "--gpu-layers", "--n-gpu-layers", "gpu_layers", callback=_gpu_layers, default=None,
                  metavar="N|auto|all", help="layers on the GPU (accepted; specrun runs every layer on the CPU)")
    @click.option("-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft", "gpu_layers_draft",
                  callback=_gpu_layers, default=None, metavar="N|auto|all",
                  help="draft model layers on the GPU (accepted; the CPU runs them)")
    @kv_options
    @click.option("--mlock", "mlock", is_flag=True, help="accepted; the model is memory-mapped as by default")
    @click.option("--mmap/--no-mmap", "mmap", default=None, help="accepted; the model is memory-mapped")
    @click.option("-lm", "--load-mode", "load_mode", default=None,
                  type=click.Choice(["auto", "none", "mmap", "mlock", "mmap+mlock", "dio"]),
                  help="llama.cpp's model loading mode (accepted; the model is memory-mapped)")
    @click.option("--no-exact", "no_exact", is_flag=True,
                  help="llama.cpp's fastest kernels; verify logits may then differ from one-token decoding")
    @click.option("--fast-prefill/--no-fast-prefill", "fast_prefill", default=True, show_default=True,
                  help="exact mode: evaluate a prompt of 256+ tokens with repacked weights and "
                       "an F16 KV cache (llama.cpp's fast kernels), then hand it to the exact context; off saves "
                       "the repacked copy's and that cache's memory")
    @click.option("--rpc", "rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                  help="put the model's layers on these RPC workers (`specrun rpc-worker`, llama.cpp's rpc-server); "
                       "draft models stay on this machine")
    @click.option("-ts", "--tensor-split", "tensor_split", default=None, metavar="N0,N1,...",
                  help="with --rpc: the share of the layers each worker holds, e.g. 3,1 (default: by free memory)")
    @click.option("-v", "--verbose", is_flag=True, help="log llama.cpp and specrun internals to stderr")
    @llama_model_flags
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def llama_model_flags(f):
    """llama.cpp's model and process flags that scripts pass (model_options: run, chat, serve, bench):
    those that cannot change the text are accepted and noted (unapplied); --override-kv and -ot are
    refused (refuse_model_overrides)."""
    f = click.option("-ot", "--override-tensor", "override_tensor", multiple=True, metavar="PATTERN=BUFTYPE,...",
                     help="refused: specrun chooses each weight's buffer (exact mode depends on it)")(f)
    f = click.option("--override-kv", "override_kv", multiple=True, metavar="KEY=TYPE:VALUE,...",
                     help="refused: it changes the model's metadata; write a copy with gguf-new-metadata")(f)
    f = click.option("-ncmoe", "--n-cpu-moe", "n_cpu_moe", type=click.IntRange(0), default=None, metavar="N",
                     help="accepted; every weight is on the CPU")(f)
    f = click.option("-cmoe", "--cpu-moe", "cpu_moe", is_flag=True, help="accepted; every weight is on the CPU")(f)
    f = click.option("--swa-full", "swa_full", is_flag=True,
                     help="accepted; the contexts keep a full-size SWA cache already")(f)
    f = click.option("--numa", "numa", callback=_numa, default=None, metavar="distribute|isolate|numactl",
                     help="accepted; threads run where the OS places them")(f)
    f = click.option("--no-warmup", "no_warmup", is_flag=True, help="accepted; run, chat and serve do no warm-up")(f)
    f = click.option("--perf/--no-perf", "perf", default=None,
                     help="accepted; specrun prints its own statistics on stderr")(f)
    return click.option("--log-disable", "log_disable", is_flag=True,
                        help="accepted; llama.cpp's log is off unless -v")(f)


def console_options(f):
    """llama-cli's terminal flags (run, chat): none changes the text; unapplied() notes each."""
    f = click.option("--prompt-cache-ro", "prompt_cache_ro", is_flag=True, help="accepted; no session file")(f)
    f = click.option("--prompt-cache-all", "prompt_cache_all", is_flag=True, help="accepted; no session file")(f)
    f = click.option("--prompt-cache", "prompt_cache", default=None, metavar="FNAME",
                     help="accepted; the prompt is evaluated on each run, and no session file is written")(f)
    f = click.option("-co", "--color", "color", is_flag=False, flag_value="on", default=None, callback=_on_off_auto,
                     metavar="[on|off|auto]", help="accepted; stdout's text is never colored (NO_COLOR=1 for stderr)")(f)
    f = click.option("--simple-io", "simple_io", is_flag=True, help="accepted; input and output are plain lines")(f)
    return click.option("--no-display-prompt", "no_display_prompt", is_flag=True,
                        help="accepted; specrun never prints the prompt")(f)


def _suffix_cache(ctx, param, value):
    """--spec-suffix-cache FILE: a file that exists must be a suffix cache; its folder must exist (it is
    written at exit). The model's tokenizer is checked when the model loads."""
    if value is None:
        return None
    try:
        check_output(value, file_only=True)
        if Path(value).exists():
            read_cache(value)
    except SpecrunError as e:
        raise click.BadParameter(str(e)) from None
    return value


def suffix_options(f):
    """specrun's own flags of --spec-type suffix (llama.cpp has no suffix type; the names follow its
    --spec-ngram-* ones, the defaults vLLM's suffix_decoding_*); read with ngram_family_params."""
    d = SUFFIX_DEFAULT
    f = click.option("--spec-suffix-cache", "suffix_cache", default=None, metavar="FILE", callback=_suffix_cache,
                     help="suffix: keep the global tree (earlier requests' outputs) in FILE: loaded at start, "
                          "saved at exit")(f)
    f = click.option("--spec-suffix-max-cached-requests", "suffix_max_cached", type=click.IntRange(0),
                     default=d.max_cached_requests, show_default=True,
                     help="suffix: requests whose output the global tree keeps, the least recent out first "
                          "(0: no global tree, each request drafts from its own text only)")(f)
    f = click.option("--spec-suffix-min-token-prob", "suffix_min_prob", type=click.FloatRange(0, 1),
                     default=d.min_token_prob, show_default=True,
                     help="suffix: stop a draft before a token whose estimated probability (counts along the "
                          "path) is below this")(f)
    f = click.option("--spec-suffix-max-spec-factor", "suffix_factor", type=click.FloatRange(0, min_open=True),
                     default=d.max_spec_factor, show_default=True,
                     help="suffix: a draft is at most this many times the matched text's length")(f)
    return click.option("--spec-suffix-max-depth", "suffix_depth", type=click.IntRange(2, 1024),
                        default=d.max_depth, show_default=True,
                        help="suffix: the longest match and draft together (the suffix tree's depth; a draft "
                             "is at most this minus 1)")(f)


def ngram_family_options(f):
    """llama.cpp's flags of ngram-map-k, ngram-map-k4v, ngram-mod and ngram-cache (common/arg.cpp: its
    spellings, defaults and ranges), and specrun's own of suffix; read with ngram_family_params."""
    f = suffix_options(f)
    size = click.IntRange(1, 1024)
    f = click.option("-lcd", "--lookup-cache-dynamic", "lookup_dynamic", default=None, metavar="FNAME",
                     type=click.Path(exists=True, dir_okay=False),
                     help="ngram-cache: an n-gram cache file (llama-lookup-create) checked strictly; read only")(f)
    f = click.option("-lcs", "--lookup-cache-static", "lookup_static", default=None, metavar="FNAME",
                     type=click.Path(exists=True, dir_okay=False),
                     help="ngram-cache: an n-gram cache file (llama-lookup-create) that validates drafts")(f)
    mod = MOD_DEFAULT
    for name, default, lo, what in (("n-max", mod.n_max, 0, "the longest chain of lookups (its draft's bound)"),
                                    ("n-min", mod.n_min, 0, "a chain that breaks before N tokens drafts nothing"),
                                    ("n-match", mod.n_match, 1, "the length of the hashed n-grams")):
        f = click.option(f"--spec-ngram-mod-{name}", f"mod_{name.replace('-', '_')}", type=click.IntRange(lo, 1024),
                         default=default, show_default=True, help=f"ngram-mod: {what}")(f)
    for t in ("k4v", "k"):
        f = click.option(f"--spec-ngram-map-{t}-min-hits", f"map_{t}_hits", type=click.IntRange(1),
                         default=MAP_DEFAULT.min_hits, show_default=True, help=f"ngram-map-{t}: lookups of a key before it drafts" +
                         (" (accepted; llama.cpp's ngram-map-k does not read it)" if t == "k" else ""))(f)
        f = click.option(f"--spec-ngram-map-{t}-size-m", f"map_{t}_m", type=size, default=MAP_DEFAULT.size_m,
                         show_default=True, help=f"ngram-map-{t}: the most tokens drafted after a key (its draft's bound)")(f)
        f = click.option(f"--spec-ngram-map-{t}-size-n", f"map_{t}_n", type=size, default=MAP_DEFAULT.size_n,
                         show_default=True, help=f"ngram-map-{t}: the key, the last N tokens looked up")(f)
    return f


def ngram_family_params(kw: dict) -> dict:
    """ngram_family_options' values as SpecParams fields."""
    m, mod = MAP_DEFAULT, MOD_DEFAULT
    return dict(ngram_map_k=NgramMapParams(kw.get("map_k_n", m.size_n), kw.get("map_k_m", m.size_m),
                                           kw.get("map_k_hits", m.min_hits)),
                ngram_map_k4v=NgramMapParams(kw.get("map_k4v_n", m.size_n), kw.get("map_k4v_m", m.size_m),
                                             kw.get("map_k4v_hits", m.min_hits)),
                ngram_mod=NgramModParams(kw.get("mod_n_match", mod.n_match), kw.get("mod_n_min", mod.n_min),
                                         kw.get("mod_n_max", mod.n_max)),
                ngram_cache=NgramCacheParams(kw.get("lookup_static"), kw.get("lookup_dynamic")),
                suffix=suffix_params(kw))


def suffix_params(kw: dict) -> SuffixParams:
    """suffix_options' values as SuffixParams."""
    d = SUFFIX_DEFAULT
    return SuffixParams(kw.get("suffix_depth", d.max_depth), kw.get("suffix_factor", d.max_spec_factor),
                        kw.get("suffix_min_prob", d.min_token_prob), kw.get("suffix_max_cached", d.max_cached_requests),
                        kw.get("suffix_cache"))


def spec_options(f):
    @click.option("--spec-type", "spec_type", callback=_spec_type, default=None,
                  help=f"comma-separated: none, {spelled(SPEC_TYPE_LIST)}; or auto "
                       "(measured on this model and machine)  [default: none; with -md, the type its file holds]")
    @click.option("--spec-draft-n-max", "n_max", type=click.IntRange(1), default=SPEC_DEFAULT.n_max,
                  show_default=True,
                  help="most tokens a draft model, EAGLE-3 draft or MTP heads draft per step (n-gram drafts: "
                       "--spec-ngram-simple-size-m)")
    @click.option("--spec-draft-n-min", "n_min", type=click.IntRange(0), default=SPEC_DEFAULT.n_min,
                  show_default=True,
                  help="drafts shorter than this are not verified")
    @click.option("--spec-draft-p-min", "p_min", type=click.FloatRange(0, 1), default=SPEC_DEFAULT.p_min,
                  show_default=True,
                  help="stop drafting when the draft's top-1 probability falls below this (greedy drafts)")
    @click.option("--spec-ngram-simple-size-n", "ngram_n", type=click.IntRange(1), default=SPEC_DEFAULT.ngram_size_n,
                  show_default=True,
                  help="n-gram drafts: the length of the pattern looked up in the text so far")
    @click.option("--spec-ngram-simple-size-m", "ngram_m", type=click.IntRange(1), default=SPEC_DEFAULT.ngram_size_m,
                  show_default=True,
                  help="n-gram drafts: the most tokens copied after the match (an n-gram draft's length bound)")
    @click.option("--spec-ngram-simple-min-hits", "ngram_hits", type=click.IntRange(1),
                  default=SPEC_DEFAULT.ngram_min_hits, show_default=True)
    @click.option("--spec-ngram-simple-match", "ngram_match", type=click.Choice(["last", "longest"]), default=None,
                  help="which earlier occurrence of the pattern an n-gram draft copies from: last (llama.cpp's) or "
                       "longest, the one whose preceding tokens match the most (specrun's)  [default: last; "
                       "auto: longest]")
    @ngram_family_options
    @click.option("--spec-verify", "verify", type=click.Choice(["auto", "match", "rejection"]), default="auto",
                  show_default=True, help="rejection = speculative sampling when the drafter has a distribution")
    @click.option("--spec-auto-refresh", "auto_refresh", is_flag=True,
                  help="--spec-type auto: measure this machine's costs again (they are cached per model file, "
                       "machine, threads and settings) and overwrite the cached ones")
    @click.option("--spec-draft-adaptive/--no-spec-draft-adaptive", "adaptive", default=None,
                  help="each step's draft length: the one with the most expected tokens per second at the "
                       "drafter's running acceptance and the measured cost of a verify pass, within 1..n-max "
                       "(size-m for n-grams)  [default: on for suffix, off for the others]")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def sampling_options(f):
    @click.option("-n", "--n-predict", "--predict", "n_predict", type=int, callback=_n_predict, default=-1,
                  show_default=True, help="tokens to generate (-1 or -2: until end of generation or a full context)")
    @click.option("--temp", type=float, default=0.8, show_default=True, help="temperature (<= 0: greedy)")
    @click.option("--top-k", "top_k", type=int, default=40, show_default=True)
    @click.option("--top-p", "top_p", type=click.FloatRange(0, 1), default=0.95, show_default=True)
    @click.option("--min-p", "min_p", type=click.FloatRange(0, 1), default=0.05, show_default=True)
    @click.option("-s", "--seed", type=int, callback=_seed, default=None,
                  help="RNG seed (default, or -1: random; the seed used is printed)")
    @click.option("--repeat-penalty", "repeat_penalty", type=float, default=1.0, show_default=True,
                  help="penalize repeated tokens: a logit l > 0 becomes l / N, l <= 0 becomes l * N (1.0: off)")
    @click.option("--repeat-last-n", "repeat_last_n", type=int, default=64, show_default=True,
                  help="the last N tokens (prompt included) the penalties look at (0: off)")
    @click.option("--presence-penalty", "presence_penalty", type=float, default=0.0, show_default=True,
                  help="subtract N from the logit of every token in the last --repeat-last-n (0.0: off)")
    @click.option("--frequency-penalty", "frequency_penalty", type=float, default=0.0, show_default=True,
                  help="subtract N times its count from the logit of every token in the last --repeat-last-n "
                       "(0.0: off)")
    @click.option("--ignore-eos", "ignore_eos", is_flag=True,
                  help="never stop at end of generation (its tokens get logit -inf, as llama.cpp)")
    @click.option("-l", "--logit-bias", "logit_bias", multiple=True, metavar="TOKEN_ID(+/-)BIAS",
                  help="add BIAS to a token's logit, e.g. 15043+1 or 15043-inf (never); repeatable")
    @click.option("--grammar", "grammar", default=None, metavar="GBNF",
                  help="a GBNF grammar the text must follow (llama.cpp's grammar sampler)")
    @click.option("--grammar-file", "grammar_file", default=None, metavar="FILE", help="read the GBNF from a file")
    @click.option("-j", "--json-schema", "json_schema", default=None, metavar="SCHEMA",
                  help="a JSON schema the text must follow, e.g. '{\"type\": \"object\"}' for any JSON object")
    @click.option("-jf", "--json-schema-file", "json_schema_file", default=None, metavar="FILE",
                  help="read the JSON schema from a file")
    @llama_sampler_flags
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


CHAIN = "specrun's sampler chain is fixed (penalties, top-k, top-p, min-p, temperature)"
# llama.cpp's samplers that specrun lacks, each turned on by one option (arg.cpp's spellings; llama.cpp's off
# value): (key, spellings, type, name, off, what to use instead)
SAMPLERS = (("mirostat", ("--mirostat",), click.IntRange(0, 2), "Mirostat", "0", "--temp with --top-p or --min-p"),
            ("typical", ("--typical", "--typical-p"), float, "locally typical sampling", "1.0", "--top-p or --min-p"),
            ("dry_multiplier", ("--dry-multiplier",), float, "DRY", "0",
             "--repeat-penalty, --presence-penalty or --frequency-penalty"),
            ("xtc_probability", ("--xtc-probability",), float, "XTC", "0", "a higher --temp"),
            ("top_nsigma", ("--top-nsigma", "--top-n-sigma"), float, "top-n-sigma", "-1", "--min-p"))
# their parameters, which do nothing while the sampler is off: (key, flag)
SAMPLER_PARAMS = (("mirostat_lr", "--mirostat-lr"), ("mirostat_ent", "--mirostat-ent"), ("dry_base", "--dry-base"),
                  ("dry_allowed_length", "--dry-allowed-length"), ("dry_penalty_last_n", "--dry-penalty-last-n"),
                  ("dry_sequence_breaker", "--dry-sequence-breaker"), ("xtc_threshold", "--xtc-threshold"))


def llama_sampler_flags(f):
    """llama.cpp's samplers that specrun's chain lacks (sampling_options: run, chat, serve), with
    arg.cpp's spellings and arity: a value that turns one on is refused (refuse_samplers); llama.cpp's
    off value is accepted silently, and a parameter of a sampler that is off is noted (unapplied)."""
    params = "accepted while its sampler is off (specrun has none)"
    for opts, key, kind in ((("--xtc-threshold",), "xtc_threshold", float),
                            (("--dry-penalty-last-n",), "dry_penalty_last_n", int),
                            (("--dry-allowed-length",), "dry_allowed_length", int),
                            (("--dry-base",), "dry_base", float),
                            (("--mirostat-ent",), "mirostat_ent", float),
                            (("--mirostat-lr",), "mirostat_lr", float)):
        f = click.option(*opts, key, type=kind, default=None, metavar="N", help=params)(f)
    f = click.option("--dry-sequence-breaker", "dry_sequence_breaker", multiple=True, metavar="STRING",
                     help=params)(f)
    for key, opts, kind, name, off, _ in reversed(SAMPLERS):
        f = click.option(*opts, key, type=kind, default=None, metavar="N",
                         help=f"refused unless {off} (off): specrun has no {name}")(f)
    return click.option("--samplers", "samplers", default=None, metavar="SAMPLERS",
                        help="refused: the chain is penalties, top-k, top-p, min-p, temperature")(f)


def _sampler_on(key: str, kw: dict) -> bool:
    """Whether llama.cpp would run the sampler SAMPLERS names by key, with these values (its
    src/llama-sampler.cpp: each returns at once when off)."""
    v = kw.get(key)
    if v is None:
        return False
    if key == "typical":
        return v < 1.0
    if key == "dry_multiplier":
        return v != 0.0 and kw.get("dry_penalty_last_n") != 0
    if key == "xtc_probability":
        threshold = kw.get("xtc_threshold")
        return v > 0.0 and (threshold is None or threshold <= 0.5)
    if key == "top_nsigma":
        return v > 0.0
    return v != 0       # mirostat 1 or 2


def refuse_samplers(kw: dict) -> None:
    """A llama.cpp sampler that specrun lacks, turned on, is a UsageError naming it (exit 2)."""
    if kw.get("samplers") is not None:
        raise click.UsageError(f"--samplers {kw['samplers']}: refused; {CHAIN}; turn one off instead: --top-k 0, "
                               "--top-p 1, --min-p 0, --repeat-penalty 1")
    for key, (flag, *_), _, name, off, instead in SAMPLERS:
        if _sampler_on(key, kw):
            raise click.UsageError(f"{flag} {kw[key]:g}: refused; {CHAIN} and has no {name}; drop the flag "
                                   f"({flag} {off} is off) and use {instead}")


def refuse_model_overrides(kw: dict) -> None:
    """--override-kv and -ot change the model or where its weights are computed, so the text: a
    UsageError naming the flag (exit 2)."""
    if kw.get("override_kv"):
        raise click.UsageError(f"--override-kv {kw['override_kv'][0]}: refused; it changes the model's metadata, and so "
                               "the text, and specrun reads each GGUF as it is; write the change into a copy with "
                               "gguf-new-metadata")
    if kw.get("override_tensor"):
        raise click.UsageError(f"-ot {kw['override_tensor'][0]}: refused; specrun chooses each weight's buffer (exact "
                               "mode: none repacked), and another could change the text; every weight is on the CPU "
                               "already")


def template_options(f):
    """The chat template: chat, run -cnv and serve (read with chat_template_choice)."""
    @click.option("--chat-template", "chat_template", default=None, metavar="NAME|JINJA",
                  help="one of llama.cpp's built-in template names (chatml, llama3, gemma...), or Jinja text "
                       "(a file path also works) instead of the model's own")
    @click.option("--chat-template-file", "chat_template_file", default=None, metavar="FILE",
                  help="a Jinja chat template file instead of the model's own")
    @click.option("--jinja/--no-jinja", "jinja", default=None,
                  help="accepted; specrun always renders chat templates with Jinja")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def chat_options(f):
    """The conversation's options: `specrun chat`, and `specrun -cnv` (run's conversation mode)."""
    @click.option("-sys", "--system-prompt", "system_prompt", default=None, help="the system message")
    @click.option("-sysf", "--system-prompt-file", "system_prompt_file", default=None, metavar="FILE",
                  help="read the system message from a file")
    @template_options
    @click.option("-st", "--single-turn", "single_turn", is_flag=True,
                  help="answer one message, then exit")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How a conversation starts: `specrun chat`, and run's conversation mode."""

    system_prompt: str | None           # -sys TEXT, or -sysf FILE's text
    first_message: str | None           # answered before any line is read (-p/-f in conversation mode)
    chat_template: str | None           # --chat-template NAME|JINJA|FILE (None: the model's own)
    chat_template_file: str | None      # --chat-template-file FILE (at most one of the two)
    single_turn: bool                   # -st: leave after the first answer
    quiet: bool                         # chat -q: no statistics line after each answer


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The command line of `specrun run` and `specrun chat`, checked: built once (run_cmd.run_options)
    before any model loads; run, chat and the REPL read nothing else."""

    model: str                          # -m: a registry name or a GGUF path (a conversation without -m: the chat model)
    params: EngineParams                # model and --spec-* options; --spec-type auto is resolved after loading
    sampling: SamplingParams            # the sampling options, penalties, bias and grammar checked
    n_predict: int                      # -n: -1 and -2 run to end of generation or a full context
    auto_refresh: bool                  # --spec-auto-refresh: auto measures this machine's costs again
    verbose: bool                       # -v: llama.cpp's and specrun's logs on stderr
    conversation: str                   # "on" (-cnv, -i, a conversation flag, chat), "off" (-no-cnv, --json),
                                        # "auto": on when the model has a chat template, as llama-cli
    prompt: str | None                  # -p, -f or stdin, escapes processed (None: none given, stdin a terminal)
    stops: tuple[str, ...]              # -r: reverse prompts, escapes processed (a raw completion's)
    as_json: bool                       # --json: one JSON object instead of the streamed text
    chat: ChatOptions | None            # the conversation's settings (None when conversation is "off")


def given(name: str) -> bool:
    """Whether the option `name` of the running command was given (command line or environment)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def chat_model(kw: dict) -> str:
    """-m for a conversation: the one given, else the registry model that has a chat template
    (the default model, gemma-3-270m, is a base model without one)."""
    return kw["model"] if given("model") else DEFAULT_CHAT_MODEL


def read_system_prompt(kw: dict) -> str | None:
    """-sys TEXT, or -sysf FILE (one trailing newline dropped, as llama.cpp)."""
    text, path = kw.get("system_prompt"), kw.get("system_prompt_file")
    if text is not None and path is not None:
        raise click.UsageError("give the system prompt with -sys or -sysf, not both")
    if path is None:
        return text
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror}", param_hint="-sysf") from None
    return text[:-1] if text.endswith("\n") else text


def chat_template_choice(kw: dict) -> tuple[str | None, str | None]:
    """(--chat-template value, --chat-template-file path); at most one; --no-jinja noted."""
    if kw.get("jinja") is False:
        note("--no-jinja: ignored; specrun renders every chat template with Jinja")
    tmpl, path = kw.get("chat_template"), kw.get("chat_template_file")
    if tmpl is not None and path is not None:
        raise click.UsageError("give the chat template with --chat-template or --chat-template-file, not both")
    return tmpl, path


def spec_params(kw: dict) -> SpecParams:
    """The --spec-* options (those of spec_options; bench has its own subset). types may be AUTO or INFER."""
    d = SPEC_DEFAULT
    return SpecParams(types=kw.get("spec_type", ()), n_max=kw.get("n_max", d.n_max), n_min=kw.get("n_min", d.n_min),
                      p_min=kw.get("p_min", d.p_min), ngram_size_n=kw.get("ngram_n", d.ngram_size_n),
                      ngram_size_m=kw.get("ngram_m", d.ngram_size_m), ngram_min_hits=kw.get("ngram_hits", d.ngram_min_hits),
                      ngram_match=kw.get("ngram_match"), verify=kw.get("verify", d.verify),
                      adaptive=adaptive_of(kw), **ngram_family_params(kw))


def adaptive_of(kw: dict) -> bool:
    """--spec-draft-adaptive / --no-spec-draft-adaptive as given, else the spec types' default (suffix: on)."""
    given = kw.get("adaptive")
    return given if given is not None else adaptive_default(kw.get("spec_type", ()))


def unapplied(kw: dict) -> list[str]:
    """One line for each llama.cpp flag given that cannot apply here: why, and what happens instead."""
    exact = not kw["no_exact"]
    out = []
    for key, flag, what in (("gpu_layers", "-ngl", "every layer"), ("gpu_layers_draft", "-ngld", "the draft model")):
        v = kw.get(key)
        if v is not None and v not in ("0", "auto"):
            out.append(f"{flag} {v}: ignored; specrun runs {what} on the CPU (its kernels load models with "
                       "n_gpu_layers 0)")
    if kw.get("flash_attn") == "off" and exact:
        out.append("-fa off: exact mode keeps flash attention on, so that verify logits equal one-token "
                   "decoding's; it applies with --no-exact")
    for key, flag, kept in (("cache_type_k", "-ctk", "q8_0"), ("cache_type_v", "-ctv", "f16")):
        t = kw.get(key)
        if t is not None and exact and t != kept:
            out.append(f"{flag} {t}: exact mode keeps a q8_0 K cache (bf16 where q8_0's blocks do not divide "
                       "the head size) and an f16 V cache, so that one-token decodes never take flash "
                       "attention's split-KV path; it applies with --no-exact")
    ub = kw.get("ubatch_size")
    if ub is not None and ub != UBATCH_DEFAULT:
        out.append(f"-ub {ub}: not applied; the engine evaluates in llama.cpp's micro-batches of {UBATCH_DEFAULT} "
                   "tokens: it has no setting for it yet")
    tb, t = kw.get("threads_batch"), kw.get("threads", 0)
    if tb is not None and (tb > 0 or t > 0) and tb != t:
        out.append(f"-tb {tb}: not applied; prompt processing uses -t's threads ({t or 'all cores'}): the engine "
                   "has no separate setting yet")
    load = [f for f, on in (("--mlock", kw.get("mlock")), ("--no-mmap", kw.get("mmap") is False)) if on]
    if kw.get("load_mode") not in (None, "auto", "mmap"):
        load.append(f"-lm {kw['load_mode']}")
    if load:
        out.append(f"{', '.join(load)}: not applied; the model is memory-mapped, as by default: the kernels do not "
                   "pass llama.cpp's load mode yet")
    out.extend(_unapplied_llama_flags(kw))
    return out


def _unapplied_llama_flags(kw: dict) -> list[str]:
    """unapplied()'s lines for llama_model_flags, console_options and llama_sampler_flags."""
    out = []
    moe = [f for f, on in (("--cpu-moe", kw.get("cpu_moe")), (f"-ncmoe {kw.get('n_cpu_moe')}",
                                                              kw.get("n_cpu_moe") is not None)) if on]
    if moe:
        out.append(f"{', '.join(moe)}: no effect; every weight is on the CPU already")
    if kw.get("swa_full"):
        out.append("--swa-full: no effect; specrun's contexts keep a full-size SWA cache already (llama.cpp's "
                   "library default)")
    if kw.get("numa") is not None:
        out.append(f"--numa {kw['numa']}: not applied; the kernels do not call ggml's NUMA setup: threads run where "
                   "the OS places them")
    if kw.get("no_warmup"):
        out.append("--no-warmup: no effect; run, chat and serve do no warm-up pass (bench keeps its untimed one)")
    if kw.get("perf") is not None:
        out.append(f"--{'' if kw['perf'] else 'no-'}perf: no effect; specrun prints its own statistics on stderr, "
                   "not libllama's timings")
    if kw.get("log_disable"):
        out.append("--log-disable: no effect; llama.cpp's log is already off (-v turns it on); specrun's notes and "
                   "statistics stay on stderr")
    if kw.get("no_display_prompt"):
        out.append("--no-display-prompt: no effect; specrun prints only the generated text, never the prompt")
    if kw.get("simple_io"):
        out.append("--simple-io: no effect; specrun reads plain lines when stdin is not a terminal and writes plain "
                   "text")
    if kw.get("color") is not None:
        out.append(f"-co {kw['color']}: no effect; stdout carries the text uncolored; stderr is colored on a "
                   "terminal (NO_COLOR=1 turns it off)")
    cache = [f for f, on in ((f"--prompt-cache {kw.get('prompt_cache')}", kw.get("prompt_cache") is not None),
                             ("--prompt-cache-all", kw.get("prompt_cache_all")),
                             ("--prompt-cache-ro", kw.get("prompt_cache_ro"))) if on]
    if cache:
        out.append(f"{', '.join(cache)}: not applied; specrun evaluates the prompt on each run and keeps no session "
                   "file")
    params = []     # the parameters of samplers that are off (refuse_samplers refused any that is on)
    for key, flag in SAMPLER_PARAMS:
        v = kw.get(key)
        for one in ((v or ()) if key == "dry_sequence_breaker" else () if v is None else (v,)):
            params.append(f"{flag} {one:g}" if isinstance(one, float) else f"{flag} {one}")
    if params:
        out.append(f"{', '.join(params)}: no effect; their samplers are off, as in llama.cpp with these values, and "
                   "specrun has none of them")
    return out


def engine_params(kw: dict, spec: SpecParams | None = None) -> EngineParams:
    """The model_options (and spec_options, unless spec is given) as EngineParams; a note on stderr
    for each flag that cannot apply. The model names are resolved to paths, and every check made,
    when the engine is opened (runtime.loading)."""
    refuse_model_overrides(kw)
    spec = spec_params(kw) if spec is None else spec
    if "draft-simple" in spec.types and not kw["model_draft"]:
        raise click.UsageError("--spec-type draft needs -md/--model-draft DRAFT.gguf")
    for line in unapplied(kw):
        note(line)
    return EngineParams(n_ctx=kw["ctx_size"], n_batch=kw["batch_size"], n_threads=kw["threads"],
                        exact=not kw["no_exact"], fast_prefill=kw.get("fast_prefill", True), spec=spec,
                        draft_model=kw["model_draft"], placement=rpc_placement(kw), kv=kv_params(kw))


def kv_params(kw: dict) -> KVParams:
    """-ctk / -ctv / -fa as given, llama-server's defaults for the rest (they apply with --no-exact)."""
    return KVParams(type_k=kw.get("cache_type_k") or "f16", type_v=kw.get("cache_type_v") or "f16",
                    flash_attn=kw.get("flash_attn") or "auto")


def rpc_placement(kw: dict) -> rpc.Placement | None:
    """--rpc / --tensor-split, checked (the build has RPC, every worker answers, the split adds
    up: one-line SpecrunErrors); a worker lost later ends the process with one line, exit 1 (the
    server sets its own handler)."""
    p = rpc.placement(kw.get("rpc"), kw.get("tensor_split"))
    if p is not None:
        rpc.on_worker_lost(_exit_lost)
        note(f"rpc: every layer on the workers {p}; drafters on this machine")
    return p


def _exit_lost(e: rpc.WorkerLost) -> None:
    """On llama.cpp's RPC thread: what was generated stays on stdout; one line; exit 1."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        err_console.print(f"\nerror: {e}", style="red", markup=False, soft_wrap=True)
    os._exit(1)


def parse_logit_bias(spec: str) -> tuple[int, float]:
    """llama.cpp's -l TOKEN_ID(+/-)BIAS: '15043+1' -> (15043, 1.0), '15043-inf' -> (15043, -inf)."""
    m = re.fullmatch(r"\s*(-?\d+)\s*([+-])\s*(\S+)\s*", spec)
    bias = None
    if m:
        try:
            bias = float(m.group(3)) * (-1.0 if m.group(2) == "-" else 1.0)
        except ValueError:
            bias = None
    if bias is None or math.isnan(bias):
        raise SpecrunError(f"--logit-bias '{spec}': not TOKEN_ID(+/-)BIAS; write e.g. 15043+1, 15043-0.5 or "
                           "15043-inf (never emit token 15043)")
    if bias == math.inf:
        raise SpecrunError(f"--logit-bias '{spec}': a bias of +inf would leave nothing to sample; give a finite "
                           "number (or -inf to ban the token)")
    return int(m.group(1)), bias


def _read(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecrunError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})") from None


def grammar_of(kw: dict) -> str | None:
    """The GBNF of --grammar, --grammar-file, -j or -jf (at most one), checked: a grammar that does
    not parse or a schema llama.cpp cannot convert is a SpecrunError (one line, exit 1)."""
    given_ = [(k, f) for k, f in (("grammar", "--grammar"), ("grammar_file", "--grammar-file"),
                                  ("json_schema", "-j/--json-schema"), ("json_schema_file", "-jf/--json-schema-file"))
              if kw.get(k) is not None]
    if len(given_) > 1:
        raise click.UsageError(f"give one grammar: {' and '.join(f for _, f in given_)} do not go together")
    if not given_:
        return None
    key, flag = given_[0]
    if key == "grammar":
        text = kw[key]
    elif key == "grammar_file":
        text = _read(kw[key], flag)
    else:
        schema = kw[key] if key == "json_schema" else _read(kw[key], flag)
        return schema_to_gbnf(schema, what=f"{flag}'s schema")
    try:
        check_grammar(text)
    except GrammarError as e:
        raise GrammarError(f"{flag}: {e}") from None
    return text


def sampling_params(kw: dict) -> SamplingParams:
    """The sampling_options as SamplingParams; a bad penalty, logit bias or grammar is a SpecrunError
    (one line, exit 1), before the model loads; a sampler specrun lacks, turned on, a UsageError (exit 2)."""
    refuse_samplers(kw)
    s = SamplingParams(temp=kw["temp"], top_k=kw["top_k"], top_p=kw["top_p"], min_p=kw["min_p"],
                       seed=kw["seed"], repeat_penalty=kw.get("repeat_penalty", 1.0),
                       repeat_last_n=kw.get("repeat_last_n", 64), presence_penalty=kw.get("presence_penalty", 0.0),
                       frequency_penalty=kw.get("frequency_penalty", 0.0),
                       logit_bias=tuple(parse_logit_bias(b) for b in kw.get("logit_bias", ())),
                       ignore_eos=kw.get("ignore_eos", False))
    check_controls(s, {f: "--" + f.replace("_", "-") for f in ("temp", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                                                             "presence_penalty", "frequency_penalty", "logit_bias")})
    return replace(s, grammar=grammar_of(kw))


_CHAT_FLAGS = {"system_prompt": "-sys", "system_prompt_file": "-sysf", "single_turn": "-st",
               "chat_template": "--chat-template", "chat_template_file": "--chat-template-file"}


def run_options(kw: dict, *, prompt: str | None = None, file: str | None = None, escape: bool = True,
                reverse_prompt: tuple[str, ...] = (), keep: int | None = None, as_json: bool = False,
                conversation: bool | None = None, interactive: bool = False, chat: bool = False,
                quiet: bool = False) -> RunOptions:
    """The composition root of run and chat: click's values (kw: the shared option bundles) checked
    once and made RunOptions, before any model loads. Each note on how a flag was taken is said
    here, in the order the flags are read. chat: `specrun chat` (a conversation, no prompt)."""
    setup_logging(kw["verbose"])
    if chat:
        tmpl, tmpl_file = chat_template_choice(kw)
        return _options(kw, model=chat_model(kw), conversation="on", prompt=None, stops=(), as_json=False,
                        chat=ChatOptions(read_system_prompt(kw), None, tmpl, tmpl_file, kw["single_turn"], quiet))
    if interactive:
        # llama-cli's -i takes turns at the terminal; specrun's turns are conversation mode's
        if conversation is False:
            raise click.UsageError("-i and -no-cnv do not go together: specrun's interactive mode is conversation "
                                   "mode; drop -no-cnv to chat, or -i to generate once")
        note("-i: interactive mode is conversation mode (-cnv) here: each line is a message in the chat template")
        conversation = True
    chat_flags = [flag for key, flag in _CHAT_FLAGS.items() if kw.get(key)]
    if keep is not None:
        note(f"--keep {keep}: no effect; specrun does not shift the context: run stops at a full context, and "
             "chat drops whole turns (the system prompt stays)")
    if conversation or (conversation is None and chat_flags):
        if as_json:
            raise click.UsageError("--json and -cnv/--conversation do not go together")
        if reverse_prompt:
            note(REVERSE_PROMPT_NOTE)
        # llama-cli: -p (or -f) is the first user message; -sys gives the system message
        text = read_prompt(prompt, file, escape=escape) if prompt is not None or file is not None else None
        system = read_system_prompt(kw)
        tmpl, tmpl_file = chat_template_choice(kw)
        return _options(kw, model=chat_model(kw), conversation="on", prompt=text, stops=(), as_json=False,
                        chat=ChatOptions(system, text, tmpl, tmpl_file, kw["single_turn"], quiet=False))
    if chat_flags:
        note(f"{', '.join(chat_flags)}: ignored without conversation mode (-no-cnv)")
    # without -cnv / -no-cnv: conversation mode when the model has a chat template (known once it
    # is loaded), as llama-cli; --json prints a raw completion's tokens, so it stays one
    auto = conversation is None and not as_json
    terminal = sys.stdin is not None and sys.stdin.isatty()
    text = None if auto and prompt is None and file is None and terminal else read_prompt(prompt, file, escape=escape)
    stops = tuple(process_escapes(r) if escape else r for r in reverse_prompt)
    # on a terminal the conversation goes on after the first answer; from a script, one answer
    chat = ChatOptions(None, text, None, None, single_turn=not terminal, quiet=False) if auto else None
    return _options(kw, model=kw["model"], conversation="auto" if auto else "off", prompt=text, stops=stops,
                    as_json=as_json, chat=chat)


REVERSE_PROMPT_NOTE = "-r: not applied in conversation mode; an answer ends at the chat template's end of turn"


def _options(kw: dict, *, model: str, conversation: str, prompt: str | None, stops: tuple[str, ...],
             as_json: bool, chat: ChatOptions | None) -> RunOptions:
    """The kernels' parameters (runtime.options: the one place that builds them), sampling first."""
    sampling = sampling_params(kw)
    return RunOptions(model=model, params=engine_params(kw), sampling=sampling, n_predict=kw["n_predict"],
                      auto_refresh=kw["auto_refresh"], verbose=kw["verbose"], conversation=conversation,
                      prompt=prompt, stops=stops, as_json=as_json, chat=chat)
