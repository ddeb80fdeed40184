"""`--spec-type auto`: choose the spec type and draft length for this model on this machine.

The engine is created with every spec type the files allow (available_types), then
resolve_auto() runs kernels.calibrate on the loaded engine (a few seconds: the verify-cost curve
and short greedy probes of the prompt) and returns the SpecParams to generate with; the reason
goes to stderr as one line.
"""

from __future__ import annotations

import os
from dataclasses import replace

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from specrun.kernels.calibrate import Choice, calibrate, n_steps
from specrun.kernels.engine import SpecParams

from .common import err_console

AUTO = ("auto",)   # what --spec-type auto parses to (cli/options.py)

# candidate draft lengths: model drafters pay a decode per drafted token; n-gram drafts are
# copies of 12..48 tokens (size_n..size_m) cut to n_max, so only longer n_max matter there
AUTO_N_MAX = {"draft-mtp": (1, 2, 3, 4, 6, 8), "draft-simple": (1, 2, 3, 4, 6, 8), "ngram-simple": (2, 4, 8, 16)}


def available_types(model_path: str | os.PathLike, draft_path: str | os.PathLike | None) -> tuple[str, ...]:
    """The spec types these files allow, in llama.cpp's order: ngram-simple always; draft-mtp when
    the model (or -md, a heads-only file) has MTP heads; draft-simple when -md is a whole model."""
    from specrun.gguf_spec.spec import load_spec

    types = ["ngram-simple"]
    if draft_path:
        d = load_spec(draft_path)
        has_trunk = any(t.name == "blk.0.attn_norm.weight" for t in d.tensors)
        if has_trunk:
            types.append("draft-simple")
        elif d.has_mtp:
            types.append("draft-mtp")
    if "draft-mtp" not in types and load_spec(model_path).has_mtp:
        types.append("draft-mtp")
    return tuple(types)


def auto_candidates(engine, base: SpecParams) -> list[SpecParams]:
    """Single-type candidates for what the engine has loaded, with base's other settings."""
    types = ["ngram-simple"]
    if "draft-simple" in engine.params.spec.types:
        types.append("draft-simple")
    if engine.mtp_enabled:
        types.append("draft-mtp")
    return [replace(base, types=(t,), n_max=k, adaptive=False)
            for t in types for k in AUTO_N_MAX[t] if k <= engine.n_max_cap]


def _base_spec(kw: dict) -> SpecParams:
    return SpecParams(n_min=kw.get("n_min", 0), p_min=kw.get("p_min", 0.0), ngram_size_n=kw.get("ngram_n", 12),
                      ngram_size_m=kw.get("ngram_m", 48), ngram_min_hits=kw.get("ngram_hits", 1),
                      verify=kw.get("verify", "auto"), adaptive=False)


def calibrate_with_progress(engine, prompt_tokens, candidates: list[SpecParams], **opts) -> Choice:
    """calibrate() with a transient progress bar on stderr."""
    total = n_steps(candidates, opts.get("reps", 3), opts.get("verify_reps", 5))
    with Progress(TextColumn("calibrating spec auto: {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("", total=total)
        return calibrate(engine, prompt_tokens, candidates,
                         on_step=lambda what: progress.update(task, advance=1, description=what), **opts)


def resolve_auto(engine, kw: dict, prompt_tokens=None) -> SpecParams:
    """The SpecParams that `--spec-type auto` stands for on this engine and prompt (None: a
    built-in free-text prompt, for chat and serve). Prints the choice and its reason on stderr.
    kw: the command's options (--spec-ngram-*, --spec-draft-p-min, --spec-verify... are kept;
    --spec-draft-adaptive applies to the chosen setting, the calibration itself runs without it)."""
    if prompt_tokens is None or len(prompt_tokens) == 0:
        from .bench_cmd import PROMPTS

        prompt_tokens = engine.tokenize(PROMPTS["free"])
    choice = calibrate_with_progress(engine, prompt_tokens, auto_candidates(engine, _base_spec(kw)))
    err_console.print(f"spec auto: {choice.reason}", markup=False, soft_wrap=True)
    return replace(choice.spec, adaptive=bool(kw.get("adaptive", False)) and bool(choice.spec.types))
