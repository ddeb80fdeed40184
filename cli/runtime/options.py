"""Option bundles shared by run / chat / serve / bench, named as llama.cpp's common/arg.cpp, and
the only place where their values become the kernels' parameters (engine_params, spec_params,
sampling_params)."""

from __future__ import annotations

import functools

import click

from specrun.kernels.params import EngineParams, SpecParams, parse_spec_types
from specrun.kernels.types import LLAMA_DEFAULT_SEED, SamplingParams

AUTO = ("auto",)   # what --spec-type auto parses to; resolved after loading (runtime.auto)


def _spec_type(ctx, param, value):
    if value is None:
        return ()
    if value.strip() == "auto":
        return AUTO
    try:
        return parse_spec_types(value)
    except Exception as e:  # SpecrunError: an unknown name
        raise click.BadParameter(str(e)) from None


def model_options(f):
    @click.option("-m", "--model", "model", envvar="SPECRUN_MODEL", default="gemma-3-270m", show_default=True,
                  help="GGUF path, or a known model name (gemma-3-270m, smollm2-135m-instruct)")
    @click.option("-md", "--model-draft", "--spec-draft-model", "model_draft", default=None,
                  help="draft GGUF for --spec-type draft, or MTP heads (from `specrun extract-mtp`) for draft-mtp")
    @click.option("-c", "--ctx-size", "ctx_size", type=click.IntRange(0), default=4096, show_default=True,
                  help="context size in tokens (0: the model's training context)")
    @click.option("-b", "--batch-size", "batch_size", type=click.IntRange(1), default=2048, show_default=True)
    @click.option("-t", "--threads", "threads", type=click.IntRange(0), default=0,
                  help="CPU threads (default: all cores)")
    @click.option("--no-exact", "no_exact", is_flag=True,
                  help="llama.cpp's fastest kernels; verify logits may then differ from one-token decoding")
    @click.option("-v", "--verbose", is_flag=True, help="log llama.cpp and specrun internals to stderr")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def spec_options(f):
    @click.option("--spec-type", "spec_type", callback=_spec_type, default="none", show_default=True,
                  help="comma-separated: none, draft-simple (alias draft), draft-mtp, ngram-simple; or auto "
                       "(measured on this model and machine)")
    @click.option("--spec-draft-n-max", "n_max", type=click.IntRange(1), default=3, show_default=True,
                  help="most tokens drafted per step")
    @click.option("--spec-draft-n-min", "n_min", type=click.IntRange(0), default=0, show_default=True,
                  help="drafts shorter than this are not verified")
    @click.option("--spec-draft-p-min", "p_min", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                  help="stop drafting when the draft's top-1 probability falls below this (greedy drafts)")
    @click.option("--spec-ngram-simple-size-n", "ngram_n", type=click.IntRange(1), default=12, show_default=True)
    @click.option("--spec-ngram-simple-size-m", "ngram_m", type=click.IntRange(1), default=48, show_default=True)
    @click.option("--spec-ngram-simple-min-hits", "ngram_hits", type=click.IntRange(1), default=1, show_default=True)
    @click.option("--spec-verify", "verify", type=click.Choice(["auto", "match", "rejection"]), default="auto",
                  show_default=True, help="rejection = speculative sampling when the drafter has a distribution")
    @click.option("--spec-draft-adaptive", "adaptive", is_flag=True,
                  help="adapt the draft length to acceptance: +2 after a fully accepted draft, -1 after a "
                       "rejection, within 1..--spec-draft-n-max")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def sampling_options(f):
    @click.option("-n", "--n-predict", "n_predict", type=int, default=-1, show_default=True,
                  help="tokens to generate (-1: until end of generation or a full context)")
    @click.option("--temp", type=float, default=0.8, show_default=True, help="temperature (<= 0: greedy)")
    @click.option("--top-k", "top_k", type=int, default=40, show_default=True)
    @click.option("--top-p", "top_p", type=click.FloatRange(0, 1), default=0.95, show_default=True)
    @click.option("--min-p", "min_p", type=click.FloatRange(0, 1), default=0.05, show_default=True)
    @click.option("-s", "--seed", type=click.IntRange(0, LLAMA_DEFAULT_SEED), default=LLAMA_DEFAULT_SEED,
                  help="RNG seed (default: random)")
    @functools.wraps(f)
    def wrapper(*a, **k):
        return f(*a, **k)

    return wrapper


def spec_params(kw: dict) -> SpecParams:
    """The --spec-* options (those of spec_options; bench has its own subset). types may be AUTO."""
    return SpecParams(types=kw.get("spec_type", ()), n_max=kw.get("n_max", 3), n_min=kw.get("n_min", 0),
                      p_min=kw.get("p_min", 0.0), ngram_size_n=kw.get("ngram_n", 12),
                      ngram_size_m=kw.get("ngram_m", 48), ngram_min_hits=kw.get("ngram_hits", 1),
                      verify=kw.get("verify", "auto"), adaptive=kw.get("adaptive", False))


def engine_params(kw: dict, spec: SpecParams | None = None) -> EngineParams:
    """The model_options (and spec_options, unless spec is given) as EngineParams. The model
    names are resolved to paths, and every check made, when the engine is opened (runtime.loading)."""
    spec = spec_params(kw) if spec is None else spec
    if "draft-simple" in spec.types and not kw["model_draft"]:
        raise click.UsageError("--spec-type draft needs -md/--model-draft DRAFT.gguf")
    return EngineParams(n_ctx=kw["ctx_size"], n_batch=kw["batch_size"], n_threads=kw["threads"],
                        exact=not kw["no_exact"], spec=spec, draft_model=kw["model_draft"])


def sampling_params(kw: dict) -> SamplingParams:
    return SamplingParams(temp=kw["temp"], top_k=kw["top_k"], top_p=kw["top_p"], min_p=kw["min_p"],
                          seed=kw["seed"])
