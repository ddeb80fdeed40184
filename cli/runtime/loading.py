"""Options -> engines: the one path from a front end's EngineParams to loaded llama.cpp engines.

Every check happens here, once, for run, chat, serve and bench alike: model names resolve to
files (registry names are assembled on first use), each GGUF is read by gguf_spec first (a precise
one-line error for a file llama.cpp would only call unloadable), an MTP-only file or an EAGLE-3
draft is refused as the main model, an EAGLE-3 draft is checked against its target (llama.cpp
aborts on several mismatches), `-md` without `--spec-type` takes the type its file holds (said on stderr),
`--spec-type auto` becomes every type the files allow, and the exact-mode caveat for F16/F32
weights is attached for the stats line. While llama.cpp loads, Ctrl-C exits 130 at once.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from specrun.gguf_spec.compat import (
    check_draft_compatible,
    check_eagle3_compatible,
    check_mtp_heads_compatible,
    eagle3_problem,
)
from specrun.gguf_spec.errors import IncompatibleDraft, SpecrunError
from specrun.gguf_spec.spec import ModelSpec, load_spec
from specrun.kernels.engine import Engine
from specrun.kernels.params import MODEL_TYPES, NGRAM_TYPES, SPEC_TYPE, EngineParams, check_md, no_mtp_heads

from .console import err_console, exit_on_interrupt, note, resolve
from .options import AUTO, INFER


def available_types(model_path: str | os.PathLike, draft_path: str | os.PathLike | None) -> tuple[str, ...]:
    """The spec types these files allow (types_for)."""
    return types_for(load_spec(model_path), load_spec(draft_path) if draft_path else None)


def types_for(model: ModelSpec, draft: ModelSpec | None) -> tuple[str, ...]:
    """The spec types a model (and an -md file) allow, in llama.cpp's order: the n-gram types
    always; draft-simple when -md is a whole model that can draft for it; draft-eagle3 when -md is an EAGLE-3 draft that
    fits the model; draft-mtp when the model (or -md, a heads-only file) has MTP heads."""
    types = list(NGRAM_TYPES)
    if draft is not None:
        if draft.is_eagle3:
            if check_eagle3_compatible(model, draft).ok:
                types.append("draft-eagle3")
        elif draft.has_trunk:
            if check_draft_compatible(model, draft).ok:
                types.append("draft-simple")
        elif check_mtp_heads_compatible(model, draft).ok:
            types.append("draft-mtp")
    if "draft-mtp" not in types and model.has_mtp:
        types.append("draft-mtp")
    return tuple(types)


def float_weight_caveat(spec: ModelSpec) -> str | None:
    """Exact mode cannot make F16/F32 matmuls batch-invariant (llama.cpp's tinyBLAS path for >= 2 rows
    has no run-time switch): say so when the model multiplies by such weights."""
    names = {t.name for t in spec.tensors}
    tied = "output.weight" not in names                       # the lm_head is then token_embd
    mtp = {t.name for b in spec.mtp_blocks for t in b.tensors}  # drafting only, not the verify pass
    mats = [t for t in spec.tensors if len(t.shape) >= 2 and t.type in ("F16", "F32", "BF16")
            and (tied or not t.name.startswith("token_embd")) and "conv1d" not in t.name and t.name not in mtp]
    if not mats:
        return None
    return (f"{len(mats)} weight matrices are {mats[0].type}, so verify logits may differ from one-token "
            "decoding by rounding (`specrun check-exact` measures it); quantized weights are bit-exact")


def draft_types(params: EngineParams, draft: ModelSpec | None, draft_name: str) -> tuple[str, ...]:
    """The spec types to run: those given, or, without --spec-type (INFER), the one -md's file holds
    (MTP heads: draft-mtp; a whole model: draft-simple), said in one line on stderr, as llama.cpp
    infers it from the draft GGUF; none without -md. An -md that the given types never use is noted."""
    types = params.spec.types
    check_md(types, draft is not None)
    if "draft-eagle3" in types:
        why = eagle3_problem(draft)
        if why:
            raise SpecrunError(f"-md {draft_name} cannot be used with --spec-type draft-eagle3: {why}")
    elif draft is not None and draft.is_eagle3 and types != INFER and types != AUTO \
            and {"draft-simple", "draft-mtp"} & set(types):
        raise SpecrunError(f"-md {draft_name} is an EAGLE-3 draft (architecture eagle3), not "
                           f"{'a draft model' if 'draft-simple' in types else 'MTP heads'}; "
                           "use --spec-type draft-eagle3")
    if types == INFER:
        if draft is None:
            return ()
        heads = draft.has_mtp and not draft.has_trunk
        inferred, what = (("draft-eagle3", "an EAGLE-3 draft") if draft.is_eagle3 else
                          ("draft-mtp", "MTP heads") if heads else ("draft-simple", "a whole model"))
        note(f"spec type: {inferred}, inferred from -md {draft_name} ({what}); --spec-type chooses another")
        return (inferred,)
    if draft is not None and types != AUTO and not set(MODEL_TYPES) & set(types):
        note(f"-md {draft_name}: not used, as --spec-type {','.join(types) or 'none'} has no draft type; "
             "add draft (a draft model), draft-eagle3 (an EAGLE-3 draft) or draft-mtp (MTP heads)")
    return types


def main_model(model: str) -> tuple[Path, ModelSpec]:
    """Resolve model (a registry name or a path) and check that its GGUF can be the main model
    (whole, not only MTP heads nor an EAGLE-3 draft), before llama.cpp sees it. Raises SpecrunError."""
    path = resolve(model)
    spec = load_spec(path)
    if spec.has_mtp and not spec.has_trunk:
        raise SpecrunError(f"{path} holds only MTP heads (no trunk), so it cannot be the main model; "
                           f"use it as -md {path.name} beside the model it was extracted from")
    if spec.is_eagle3:
        raise SpecrunError(f"{path} is an EAGLE-3 draft, so it cannot be the main model; use it as "
                           f"-md {path.name} --spec-type draft-eagle3 beside the model it was made for")
    return path, spec


def prepare(model: str, params: EngineParams) -> tuple[Path, EngineParams]:
    """Resolve and check the files of model (a registry name or a path) and params.draft_model;
    returns the model's path and the params to build engines with (paths resolved, the spec type
    inferred from -md when none was given, auto expanded to the available types, the exact-mode
    caveat set). Raises SpecrunError, one line."""
    path, spec = main_model(model)
    draft = None
    if params.draft_model:
        name = Path(params.draft_model).name
        params = replace(params, draft_model=str(resolve(params.draft_model)))
        draft = load_spec(params.draft_model)
    if draft is not None and draft.is_eagle3 and (params.spec.types == INFER or "draft-eagle3" in params.spec.types):
        c = check_eagle3_compatible(spec, draft)
        if not c.ok:
            raise IncompatibleDraft(f"EAGLE-3 draft {name} cannot draft for {path.name}: {c.reason}")
    params = replace(params, spec=replace(params.spec, types=draft_types(params, draft, name if draft else "")))
    types = params.spec.types
    if draft is not None and "draft-simple" in types:   # before any loading, and for export too
        if draft.has_mtp and not draft.has_trunk:      # llama.cpp dies of SIGSEGV drafting with it
            raise IncompatibleDraft(f"-md {name} holds only MTP heads (no trunk), not a draft model; use "
                                    "--spec-type draft-mtp")
        c = check_draft_compatible(spec, draft)
        if not c.ok:
            raise IncompatibleDraft(f"draft model {name} cannot draft for {path.name}: {c.reason}")
    if "draft-mtp" in types and types != AUTO:
        if draft is not None and not draft.is_eagle3 and not any(SPEC_TYPE[t].md for t in types):
            c = check_mtp_heads_compatible(spec, draft)     # the engine reads the heads of -md then
            if not c.ok:
                raise IncompatibleDraft(f"-md {name} cannot be the MTP heads of {path.name}: {c.reason}")
        elif not spec.has_mtp:
            raise no_mtp_heads(path)
    if params.spec.types == AUTO:
        params = replace(params, spec=replace(params.spec, types=available_types(path, params.draft_model)))
    if params.placement is not None and "draft-mtp" in params.spec.types and not params.draft_model:
        note(f"--rpc: the MTP heads go to the workers with the layers, a round trip per draft token; "
             f"`specrun extract-mtp {path.name} -o heads.gguf` and -md heads.gguf keep drafting here")
    return path, replace(params, exact_caveat=float_weight_caveat(spec) if params.exact else None)


def open_engines(model: str, params: EngineParams, n: int = 1, *, start_prefill: bool = False) -> list[Engine]:
    """n engines over one loaded model (the first owns it; server slots share it, and its prompt
    worker, if it has one: kernels/prefill_worker.py), with a transient status line on stderr.
    start_prefill: start that worker, or load the in-process fast context's repacked twin, now (a
    server) rather than at the first long prompt. See prepare() for the checks."""
    path, params = prepare(model, params)
    label = f"loading {path.name}" + (f" ({n} slots)" if n > 1 else "")
    with exit_on_interrupt(), err_console.status(label, spinner="dots"):
        engines = [Engine(str(path), params)]
        try:
            shared = engines[0].share_prefill() if n > 1 else None
            for _ in range(n - 1):
                engines.append(Engine(str(path), params, model=engines[0].model, prefill=shared))
            if start_prefill:
                engines[0].start_prefill()
        except BaseException:
            for e in reversed(engines):
                e.close()
            raise
    if 0 < params.n_ctx < engines[0].n_ctx:
        note(f"-c {params.n_ctx}: llama.cpp rounds a context up to a multiple of 256 tokens; it holds "
             f"{engines[0].n_ctx}")
    n_train = engines[0].model.n_ctx_train
    if 0 < n_train < params.n_ctx:     # llama.cpp: "n_ctx_seq (...) > n_ctx_train (...) -- possible training ..."
        note(f"-c {params.n_ctx}: more than {path.name}'s training context ({n_train} tokens); the text may degrade "
             f"past it (llama.cpp: possible training context overflow); -c 0 takes the training context")
    return engines


def open_engine(model: str, params: EngineParams) -> Engine:
    return open_engines(model, params, 1)[0]
