"""The library entry point for scripts: open a model with spec settings, generate, stream.

    from specrun.kernels import api

    with api.load("gemma-3-270m", spec_type="ngram-simple", ngram_size_n=3, ngram_size_m=16) as model:
        out = model.generate("def fib(n):", n_predict=64, temp=0)      # -> api.Result(text, tokens, stop, stats)
        for piece in model.stream("Once upon a time", n_predict=32, temp=0.8, seed=1):
            print(piece, end="")

What is exact: at temp 0, and at any temperature with a seed and verify="match" (or an n-gram
spec type), the tokens equal spec_type="none" token for token (kernels/engine.py says why).
The settings are llama.cpp's, as the CLI names them: spec_type is --spec-type, draft_model is -md,
n_max is --spec-draft-n-max, ngram_size_n / ngram_size_m are --spec-ngram-size-n / -m.

No click, no rich, no output: errors are SpecrunError subclasses with one-line messages, and the
library logs through `logging`. `--spec-type auto` is a CLI feature (it measures the machine).
"""

from __future__ import annotations

import codecs
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from specrun.gguf_spec.compat import (
    check_draft_compatible,
    check_eagle3_compatible,
    check_mtp_heads_compatible,
    eagle3_problem,
)
from specrun.gguf_spec.errors import IncompatibleDraft, SpecrunError
from specrun.gguf_spec.registry import resolve_model
from specrun.gguf_spec.spec import ModelSpec, load_spec

from .constrain import check_controls
from .engine import Engine, Generation
from .llama import Model
from .params import MODEL_TYPES, SPEC_TYPE, EngineParams, SpecParams, parse_spec_types
from .stats import GenStats
from .types import LLAMA_DEFAULT_SEED, SamplingParams

__all__ = ["LoadedModel", "ModelFileError", "Result", "SettingError", "SpecTypeError", "Stream", "load"]

log = logging.getLogger(__name__)

_SPEC_SETTINGS = tuple(f.name for f in fields(SpecParams) if f.name != "types")
_CONTROLS = tuple(f.name for f in fields(SamplingParams)
                  if f.name not in ("temp", "top_k", "top_p", "min_p", "seed"))


class SpecTypeError(SpecrunError):
    """A spec type the library cannot run: unknown, "auto", or missing what it drafts with."""


class SettingError(SpecrunError):
    """A keyword that is not a spec setting or a sampling control, or a value out of range."""


class ModelFileError(SpecrunError):
    """A GGUF that cannot be the main model (only MTP heads, or an EAGLE-3 draft)."""


@dataclass(frozen=True, slots=True)
class Result:
    """What one generation wrote.

    text:   the decoded tokens (end-of-generation tokens render as nothing; bad UTF-8 as U+FFFD)
    tokens: the generated token ids, an end-of-generation token included
    stop:   eog | n_predict | ctx (a full context) | interrupted (the stream was closed early)
    stats:  the engine's GenStats (acceptance, timings, the seed used); stats.lines() prints as the CLI
    """

    text: str
    tokens: tuple[int, ...]
    stop: str
    stats: GenStats


class Stream:
    """The text of one generation, piece by piece. Iterate it for str pieces (each complete UTF-8);
    `result` is set once the iteration ends or close() stops it (stop "interrupted")."""

    def __init__(self, gen: Generation, model: Model) -> None:
        self.result: Result | None = None
        self._gen = gen
        self._model = model
        self._tokens: list[int] = []
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text: list[str] = []
        self._pieces = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop generating (idempotent); `result` then holds what was written."""
        self._pieces.close()
        self._gen.close()                # a stream never started has not closed it
        self._finish()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> Iterator[str]:
        try:
            for toks in self._gen:
                self._tokens.extend(toks)
                raw = b"".join(self._model.piece(t) for t in toks if not self._model.is_eog(t))
                if piece := self._dec.decode(raw):
                    self._text.append(piece)
                    yield piece
            if tail := self._dec.decode(b"", final=True):
                self._text.append(tail)
                yield tail
        finally:
            self._gen.close()
            self._finish()

    def _finish(self) -> None:
        if self.result is not None:
            return
        self._text.append(self._dec.decode(b"", final=True))
        st = self._gen.stats
        self.result = Result("".join(self._text), tuple(self._tokens), st.stop or "interrupted", st)


class LoadedModel:
    """One loaded model and its drafters (an Engine). Not thread-safe: one generation at a time.
    The KV cache is kept between calls: a prompt that extends the last one evaluates only the new
    tokens. close() (or the with block) frees llama.cpp's memory; it is idempotent."""

    def __init__(self, engine: Engine, path: Path) -> None:
        self.engine = engine
        self.path = path

    @property
    def spec_types(self) -> tuple[str, ...]:
        """The spec types it drafts with, in llama.cpp's order; () for none."""
        return self.engine.params.spec.types

    @property
    def n_ctx(self) -> int:
        """The context size llama.cpp allocated (a multiple of 256 tokens)."""
        return self.engine.n_ctx

    def tokenize(self, text: str) -> list[int]:
        """text -> token ids with the model's BOS rule, as the CLI's -p."""
        return self.engine.tokenize(text).tolist()

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.engine.model.detokenize(tokens)

    def stream(self, prompt: str | Sequence[int], n_predict: int = -1, *, temp: float = 0.8, top_k: int = 40,
               top_p: float = 0.95, min_p: float = 0.05, seed: int | None = None, **controls: Any) -> Stream:
        """Start generating after prompt (text, tokenized as tokenize() does, or token ids); returns
        a Stream of text pieces. Sampling defaults are llama.cpp's; temp <= 0 is greedy. n_predict -1:
        until end of generation or a full context. seed None or -1: a random one (Result.stats.seed says
        which). controls: the other SamplingParams fields (repeat_penalty, repeat_last_n,
        presence_penalty, frequency_penalty, logit_bias, ignore_eos, grammar).
        Raises SettingError for an unknown keyword or a value out of range; SpecrunError for an
        empty prompt or one that does not fit the context."""
        unknown = sorted(set(controls) - set(_CONTROLS))
        if unknown:
            raise SettingError(f"unknown sampling setting {unknown[0]!r}; use one of temp, top_k, top_p, min_p, "
                               f"seed, {', '.join(_CONTROLS)}")
        sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                  seed=LLAMA_DEFAULT_SEED if seed is None or seed == -1 else seed, **controls)
        try:
            check_controls(sampling)
        except SpecrunError as e:
            raise SettingError(str(e)) from None
        if seed is not None and not -1 <= seed <= LLAMA_DEFAULT_SEED:
            raise SettingError(f"seed {seed}: give 0 to {LLAMA_DEFAULT_SEED}, or None (or -1) for a random one")
        tokens = self.engine.tokenize(prompt) if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int32)
        return Stream(self.engine.generate(tokens, n_predict, sampling), self.engine.model)

    def generate(self, prompt: str | Sequence[int], n_predict: int = -1, **sampling: Any) -> Result:
        """The whole generation at once: stream() joined. Same arguments as stream()."""
        with self.stream(prompt, n_predict, **sampling) as s:
            for _ in s:
                pass
        assert s.result is not None
        return s.result

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(model: str | os.PathLike, *, spec_type: str | Sequence[str] = "none",
         draft_model: str | os.PathLike | None = None, n_ctx: int = 4096, n_threads: int = 0, exact: bool = True,
         **spec: Any) -> LoadedModel:
    """Open model (a registry name such as "gemma-3-270m", or a GGUF path) for generation.

    spec_type: llama.cpp's --spec-type names or aliases, as "ngram-simple,draft" or a tuple; "none"
    drafts nothing. draft_model: -md, the GGUF that draft, draft-eagle3 or draft-mtp (heads only)
    drafts with. n_ctx: the context in tokens (0: the model's training context). n_threads: 0 for
    the idle cores (LLAMA_ARG_THREADS sets the default). exact: verify logits equal one-token decoding.
    spec: SpecParams' settings (n_max, n_min, p_min, ngram_size_n, ngram_size_m, ngram_min_hits,
    ngram_match, verify, adaptive, ngram_map_k, ngram_map_k4v, ngram_mod, ngram_cache).
    Raises SpecTypeError, SettingError, ModelFileError, IncompatibleDraft or GGUFError: one line each.
    """
    types = _spec_types(spec_type)
    unknown = sorted(set(spec) - set(_SPEC_SETTINGS))
    if unknown:
        raise SettingError(f"unknown spec setting {unknown[0]!r}; use one of {', '.join(_SPEC_SETTINGS)}")
    if spec.get("verify", "auto") not in ("auto", "match", "rejection"):
        raise SettingError(f"verify={spec['verify']!r}: use 'auto', 'match' or 'rejection'")
    path, draft_path = _check_files(model, draft_model, types)
    params = EngineParams(n_ctx=n_ctx, n_threads=n_threads, exact=exact, spec=SpecParams(types=types, **spec),
                          draft_model=str(draft_path) if draft_path else None)
    log.info("loading %s (spec types: %s)", path, ", ".join(types) or "none")
    return LoadedModel(Engine(str(path), params), path)


def _spec_types(spec_type: str | Sequence[str]) -> tuple[str, ...]:
    names = [spec_type] if isinstance(spec_type, str) else list(spec_type)
    text = ",".join(names)
    if "auto" in (t.strip() for t in text.split(",")):
        raise SpecTypeError("spec_type 'auto' is the CLI's (it calibrates on this machine); name the types, e.g. "
                            "spec_type='ngram-simple', or run `specrun -m MODEL --spec-type auto -p TEXT`, whose "
                            "'spec auto:' line names its choice")
    try:
        return parse_spec_types(text)
    except SpecrunError as e:
        raise SpecTypeError(str(e)) from None


def _check_files(model: str | os.PathLike, draft_model: str | os.PathLike | None,
                 types: tuple[str, ...]) -> tuple[Path, Path | None]:
    """Resolve the files and refuse, before llama.cpp loads them, what it would fail on or abort
    at: the checks of the CLI's runtime/loading.prepare(), without its notes and inference. The
    checks of the types alone come first: reading a GGUF's metadata takes seconds."""
    for t in types:
        own = SPEC_TYPE[t]
        if own.md and draft_model is None:
            raise SpecTypeError(f"spec_type '{own.flag}' needs {own.md.replace('-md ', 'draft_model=')}")
    if draft_model is not None and not set(types) & set(MODEL_TYPES):
        raise SpecTypeError(f"draft_model {Path(draft_model).name} is not used by spec_type "
                            f"{','.join(types) or 'none'}; add 'draft' (a draft model), 'draft-eagle3' (an EAGLE-3 "
                            "draft) or 'draft-mtp' (MTP heads)")
    path = resolve_model(model)
    target = load_spec(path)
    if target.has_mtp and not target.has_trunk:
        raise ModelFileError(f"{path} holds only MTP heads (no trunk), so it cannot be the main model; "
                             f"pass it as draft_model={path.name!r} with spec_type='draft-mtp'")
    if target.is_eagle3:
        raise ModelFileError(f"{path} is an EAGLE-3 draft, so it cannot be the main model; pass it as "
                             f"draft_model={path.name!r} with spec_type='draft-eagle3'")
    if draft_model is None:
        return path, None
    dpath = resolve_model(draft_model)
    _check_draft(target, load_spec(dpath), types, path.name, dpath.name)
    return path, dpath


def _check_draft(target: ModelSpec, draft: ModelSpec, types: tuple[str, ...], model: str, name: str) -> None:
    if "draft-eagle3" in types:
        why = eagle3_problem(draft) or (None if (c := check_eagle3_compatible(target, draft)).ok else c.reason)
        if why:
            raise IncompatibleDraft(f"EAGLE-3 draft {name} cannot draft for {model}: {why}")
    elif draft.is_eagle3:
        raise SpecTypeError(f"draft_model {name} is an EAGLE-3 draft; use spec_type='draft-eagle3'")
    if "draft-simple" in types:
        if draft.has_mtp and not draft.has_trunk:
            raise SpecTypeError(f"draft_model {name} holds only MTP heads (no trunk), not a draft model; "
                                "use spec_type='draft-mtp'")
        c = check_draft_compatible(target, draft)
        if not c.ok:
            raise IncompatibleDraft(f"draft model {name} cannot draft for {model}: {c.reason}")
    if "draft-mtp" in types and not any(SPEC_TYPE[t].md for t in types):   # -md holds the heads then
        c = check_mtp_heads_compatible(target, draft)
        if not c.ok:
            raise IncompatibleDraft(f"draft_model {name} cannot be the MTP heads of {model}: {c.reason}")

