"""`specrun run` (the default command): one-shot generation, streamed to stdout."""

from __future__ import annotations

import codecs
import json
import sys
from dataclasses import replace

import click

from .auto import AUTO, available_types, resolve_auto
from .common import err_console, handle_errors, resolve, setup_logging
from .options import engine_params, model_options, sampling_options, sampling_params, spec_options


def read_prompt(prompt: str | None, file: str | None) -> str:
    if prompt is not None and file is not None:
        raise click.UsageError("give the prompt with -p or -f, not both")
    if file == "-":
        return sys.stdin.read()
    if file is not None:
        try:
            with open(file, encoding="utf-8") as fh:
                return fh.read()
        except OSError as e:
            raise click.BadParameter(f"cannot read {file}: {e.strerror}", param_hint="-f/--file") from None
        except UnicodeDecodeError:
            raise click.BadParameter(f"{file} is not UTF-8 text", param_hint="-f/--file") from None
    if prompt is None:
        text = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        if not text:
            raise click.UsageError("no prompt: give one with -p TEXT or -f FILE (or pipe it on stdin)")
        return text
    return prompt


def load_engine(kw: dict):
    """Resolve the model names, build the engine with a transient status line on stderr."""
    from specrun.gguf_spec.spec import load_spec
    from specrun.kernels.engine import Engine

    params = engine_params(kw)
    model = resolve(kw["model"])
    spec = load_spec(model)  # a precise one-line GGUFError for a file llama.cpp would only call unloadable
    if spec.has_mtp and not any(t.name == "blk.0.attn_norm.weight" for t in spec.tensors):
        raise click.ClickException(f"{model} holds only MTP heads (no trunk), so it cannot be the main model; "
                                   f"use it as -md {model.name} beside the model it was extracted from")
    if params.draft_model:
        params = replace(params, draft_model=str(resolve(params.draft_model)))
        load_spec(params.draft_model)
    if params.spec.types == AUTO:
        params = replace(params, spec=replace(params.spec, types=available_types(model, params.draft_model)))
    with err_console.status(f"loading {model.name}", spinner="dots"):
        engine = Engine(str(model), params)
    engine.exact_caveat = float_weight_caveat(spec) if params.exact else None
    return engine


def float_weight_caveat(spec) -> str | None:
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
            "decoding by ~1e-5 (`specrun check-exact` measures it); quantized weights are bit-exact")


class TextStream:
    """Token pieces -> text, holding back incomplete UTF-8 sequences."""

    def __init__(self, model) -> None:
        self.model = model
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, tokens) -> str:
        return self.dec.decode(b"".join(self.model.piece(t) for t in tokens if not self.model.is_eog(t)))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


@click.command("run")
@model_options
@spec_options
@sampling_options
@click.option("-p", "--prompt", default=None, help="the prompt text")
@click.option("-f", "--file", "file", default=None, help="read the prompt from a file")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object (text, tokens, stats) instead")
@click.option("-cnv", "--conversation", is_flag=True,
              help="chat interactively, as `specrun chat` (-p/-f then give the system prompt)")
@handle_errors
def run(prompt, file, as_json, conversation, **kw):
    """Generate text from a prompt (streamed to stdout; statistics on stderr)."""
    if conversation:
        from .chat_cmd import chat_loop

        if as_json:
            raise click.UsageError("--json and -cnv/--conversation do not go together")
        system = read_prompt(prompt, file) if prompt is not None or file is not None else None
        return chat_loop(kw, system_prompt=system, chat_template=None, quiet=False)
    setup_logging(kw["verbose"])
    text = read_prompt(prompt, file)
    sampling = sampling_params(kw)
    with load_engine(kw) as engine:
        prompt_tokens = engine.tokenize(text)
        if kw["spec_type"] == AUTO:
            engine.set_spec(resolve_auto(engine, kw, prompt_tokens))
        stream = TextStream(engine.model)
        out_tokens: list[int] = []
        pieces: list[str] = []
        try:
            for toks in engine.generate(prompt_tokens, kw["n_predict"], sampling):
                out_tokens.extend(toks)
                s = stream.push(toks)
                if as_json:
                    pieces.append(s)
                elif s:
                    sys.stdout.write(s)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            engine.stats.stop = "interrupted"
        tail = stream.flush()
        st = engine.stats
        if as_json:
            pieces.append(tail)
            json.dump({"text": "".join(pieces), "tokens": out_tokens, "n_prompt": len(prompt_tokens),
                       "stats": st.to_dict()}, sys.stdout)
            sys.stdout.write("\n")
        else:
            sys.stdout.write(tail + "\n")
            sys.stdout.flush()
            for line in st.lines():
                err_console.print(line, markup=False, soft_wrap=True)
