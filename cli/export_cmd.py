"""`specrun export --to vllm|sglang|llama-server [serve's model and spec flags]`: print the command
that serves the same model with the same speculative settings on another engine (one line on stdout;
what differs, or what to fill in, one line each on stderr).

The flags are `specrun serve`'s (-m, -md, --spec-*, -c, -t, --host, --port, -a), parsed and checked
as serve checks them (runtime.loading.prepare: names resolved, the spec type inferred from -md, an
EAGLE-3 draft checked against its model), from the GGUFs' metadata only: no weights are loaded. The
mapping tables, and the docs they were checked against, are in runtime/export.py.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.registry import KNOWN_MODELS
from specrun.kernels.params import EngineParams

from .runtime.console import handle_errors, note
from .runtime.export import ENGINES, Plan, export_command, weights
from .runtime.loading import prepare
from .runtime.options import AUTO, given, kv_params, model_options, spec_options, spec_params

# llama.cpp flags of model_options that llama-server takes as they are: (option name, flag). Its
# --mlock and --no-mmap are now -lm/--load-mode (common/arg.cpp), see _given_llama_flags.
_PASSTHROUGH = (("gpu_layers", "-ngl"), ("gpu_layers_draft", "-ngld"), ("flash_attn", "-fa"),
                ("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"), ("batch_size", "-b"), ("ubatch_size", "-ub"),
                ("threads_batch", "-tb"), ("load_mode", "-lm"), ("rpc", "--rpc"), ("tensor_split", "-ts"))


@click.command("export")
@click.option("--to", "engine", default=None, metavar="|".join(ENGINES),
              help="the engine whose command to print")
@model_options
@spec_options
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SPECRUN_HOST",
              help="the address the exported server binds (serve's)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, envvar="SPECRUN_PORT",
              help="its port (serve's default, so clients keep their base URL)")
@click.option("-a", "--alias", default=None, help="the model's name in requests (default: the -m name, as serve)")
@handle_errors
def export(engine, host, port, alias, **kw):
    """Print the command that serves this model, with these speculative settings, on vLLM, SGLang or
    llama-server (stdout: the command only; stderr: what differs)."""
    if engine is None:
        raise SpecrunError(f"--to is required: one of {', '.join(ENGINES)}")
    if engine not in ENGINES:
        raise SpecrunError(f"--to {engine}: unknown engine; use one of {', '.join(ENGINES)}")
    spec = spec_params(kw)
    if spec.types == AUTO:
        raise SpecrunError("--spec-type auto is chosen by measuring this model on this machine once it is loaded, "
                           "and export loads nothing; run `specrun run --spec-type auto ...`, then export the type "
                           "it names on stderr (`spec auto: ...`)")
    if "draft-simple" in spec.types and not kw["model_draft"]:
        raise SpecrunError("--spec-type draft needs -md/--model-draft DRAFT.gguf (the draft model to export)")
    kv = kv_params(kw)
    kv.check()     # -ctk / -ctv / -fa go to llama-server as given, exact mode or not: what it would refuse
    path, params = prepare(kw["model"], EngineParams(n_ctx=kw["ctx_size"], n_threads=kw["threads"], spec=spec,
                                                     draft_model=kw["model_draft"], exact=not kw["no_exact"], kv=kv))
    model = weights(path)      # prepare checked the MTP heads draft-mtp reads, as run and serve
    draft = weights(params.draft_model) if params.draft_model else None
    name = alias or (kw["model"] if kw["model"] in KNOWN_MODELS else Path(path).stem)
    plan = Plan(engine=engine, model=model, draft=draft, spec=params.spec, alias=name, host=host, port=port,
                n_ctx=kw["ctx_size"], n_threads=kw["threads"], passthrough=_given_llama_flags(kw),
                exact=not kw["no_exact"])
    out = export_command(plan)
    for line in out.notes:
        note(line)
    click.echo(shlex.join(out.argv))


def _given_llama_flags(kw: dict) -> tuple[tuple[str, str], ...]:
    """The llama.cpp flags given on the command line, as llama-server 0.3.36 spells them (--mlock:
    -lm mlock; --no-mmap: -lm none; an -lm given wins)."""
    out = [(flag, str(kw[key])) for key, flag in _PASSTHROUGH if given(key) and kw.get(key) is not None]
    if not given("load_mode") and (kw.get("mlock") or kw.get("mmap") is False):
        out.append(("-lm", "mlock" if kw.get("mlock") else "none"))
    return tuple(out)
