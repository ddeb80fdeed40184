"""`specrun make-test-model`, `specrun quantize`, `specrun extract-mtp`: synthetic qwen35 + MTP
models (or, with --eagle3, a synthetic llama target and its EAGLE-3 draft), llama.cpp's quantizer
with an MTP-aware type policy, and splitting a model into its trunk and its MTP heads. Status and progress go to stderr; these commands print nothing on
stdout."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from specrun.gguf_spec.extract import ExtractError, extract_mtp, extract_trunk
from specrun.gguf_spec.output import check_output, same_file
from specrun.gguf_spec.testmodel import SHAPES, Head, SynthConfig, SynthConfigError
from specrun.gguf_spec.testmodel_eagle3 import DTYPES as EAGLE3_QUANTS
from specrun.gguf_spec.testmodel_eagle3 import SHAPES as EAGLE3_SHAPES
from specrun.gguf_spec.testmodel_eagle3 import Eagle3Config, draft_dtype_for
from specrun.kernels.check_mtp import check_mtp
from specrun.kernels.quantize import (
    DEFAULT_MTP_TYPE,
    FTYPES,
    MTP_POLICIES,
    TENSOR_TYPES,
    parse_override,
    quantize,
)
from specrun.kernels.testmodel import (
    TEST_MODEL_QUANTS,
    build_eagle3_test_models,
    build_test_model,
    check_eagle3,
)

from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.options import MAX_THREADS


def _say(msg: str) -> None:
    """One status line on stderr, never wrapped or parsed as markup (patterns have brackets)."""
    err_console.print(msg, soft_wrap=True, markup=False, highlight=False)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@contextlib.contextmanager
def _progress(label: str):
    """A transient per-tensor progress bar on stderr; yields the on_progress callback. Only on a
    terminal: elsewhere rich ends a transient bar with an empty line (before an error's one line)."""
    if not err_console.is_terminal:
        yield lambda stage, done, total, tensor: None
        return
    with Progress(TextColumn(f"{label} [progress.description]{{task.description}}"), BarColumn(),
                  MofNCompleteColumn(), TextColumn("[dim]{task.fields[tensor]}"),
                  console=err_console, transient=True) as progress:
        tasks: dict[str, int] = {}

        def on_progress(stage: str, done: int, total: int, tensor: str) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total, tensor="")
            progress.update(tasks[stage], completed=done, total=total, tensor=tensor)

        yield on_progress


def _head(ctx, param, value):
    try:
        return Head.parse(value)
    except SynthConfigError as e:
        raise click.BadParameter(str(e)) from None


@click.command("make-test-model")
@click.argument("out", type=click.Path(dir_okay=False, writable=True, path_type=Path))
@click.option("--shape", type=click.Choice(list(SHAPES)), default="realistic", show_default=True,
              help="preset: realistic = 24 trunk layers, n_embd 512, n_ff 2048; tiny = 2, 256, 512 "
                   "(the flags below override it)")
@click.option("--head", "head", default="exact", show_default=True, callback=_head,
              help="exact (drafts always accepted), noisy:SIGMA (copy + N(0, SIGMA^2/fan_in)), random")
@click.option("--trunk-layers", type=int, default=None, help="trunk depth (MTP block comes after)")
@click.option("--n-embd", type=int, default=None, help="width, a multiple of 64 (256 for K-quants)")
@click.option("--n-ff", type=int, default=None, help="FFN width")
@click.option("--vocab", "n_vocab", type=int, default=None, help="vocabulary size, 257..16384 [default: 512]")
@click.option("--quant", type=click.Choice(TEST_MODEL_QUANTS, case_sensitive=False), default="f16",
              show_default=True, help="q8_0/q4_k_m are made by llama.cpp's quantizer, MTP types matched to the trunk")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eagle3", "eagle3", default=None, type=click.Path(dir_okay=False, writable=True, path_type=Path),
              metavar="DRAFT.gguf",
              help="instead: OUT is a llama target and DRAFT.gguf its EAGLE-3 draft (--head applies to the draft; "
                   "realistic = 24 layers, n_embd 512, n_ff 2048; tiny = 4, 256, 512; quants f32, f16, q8_0)")
@click.option("--draft-quant", type=click.Choice(EAGLE3_QUANTS, case_sensitive=False), default=None,
              help="with --eagle3: the draft's matrices (default: f16 beside a q8_0 target, since a q8_0 draft's "
                   "rounding makes the exact head drift after ~15 chained steps; else as --quant)")
@click.option("--draft-vocab", type=click.IntRange(2), default=None,
              help="with --eagle3: the draft's own head covers this many tokens, mapped through d2t")
@click.option("--check", is_flag=True, help="load the result with llama.cpp and print greedy MTP (or EAGLE-3) acceptance")
@click.option("-t", "--threads", "threads", type=click.IntRange(0, MAX_THREADS), default=0,
              help="CPU threads for quantizing (default: all) and --check (default: 1)")
@click.option("-v", "--verbose", is_flag=True, help="log llama.cpp to stderr")
@handle_errors
def make_test_model(out, shape, head, trunk_layers, n_embd, n_ff, n_vocab, quant, seed, eagle3, draft_quant,
                    draft_vocab, check, threads, verbose):
    """Write a synthetic qwen35 GGUF with one MTP block whose drafts llama.cpp accepts
    (exact), partly accepts (noisy) or rejects (random). Deterministic: same flags, same bytes.
    With --eagle3 DRAFT.gguf: a llama target and an EAGLE-3 draft with such a head."""
    setup_logging(verbose)
    if eagle3 is not None:
        _make_eagle3(out, eagle3, shape, head, trunk_layers, n_embd, n_ff, n_vocab, draft_vocab, quant, draft_quant,
                     seed, check, threads)
        return
    for flag, value in (("--draft-vocab", draft_vocab), ("--draft-quant", draft_quant)):
        if value is not None:
            raise click.UsageError(f"{flag} goes with --eagle3 DRAFT.gguf")
    base = SHAPES[shape]
    cfg = SynthConfig(head=head,
                      trunk_layers=base.trunk_layers if trunk_layers is None else trunk_layers,
                      n_embd=base.n_embd if n_embd is None else n_embd,
                      n_ff=base.n_ff if n_ff is None else n_ff,
                      n_vocab=base.n_vocab if n_vocab is None else n_vocab, seed=seed)
    with _progress("quantizing") as on_progress:
        build_test_model(out, cfg, quant.lower(), nthread=threads, on_progress=on_progress)
    _say(f"wrote {out} ({_mib(out.stat().st_size)}, qwen35 {quant.lower()}, "
                      f"{cfg.trunk_layers} trunk + 1 MTP block, {cfg.describe()})")
    if check:
        r = check_mtp(out, vocab=True, time_reps=20, n_threads=threads or 1)
        _say(f"greedy MTP acceptance: {r.greedy.rate:.1%} on the greedy sequence "
                          f"({r.greedy.n_agree}/{r.greedy.n}), {r.vocab.rate:.1%} over the vocabulary "
                          f"({r.vocab.n_agree}/{r.vocab.n}); one-token decode: target {r.t_target_ms:.2f} ms, "
                          f"MTP {r.t_mtp_ms:.2f} ms (trunk:MTP {r.cost_ratio:.1f})")


def _make_eagle3(out: Path, draft: Path, shape: str, head: Head, n_layer, n_embd, n_ff, n_vocab, draft_vocab,
                 quant: str, draft_quant: str | None, seed: int, check: bool, threads: int) -> None:
    base = EAGLE3_SHAPES[shape]
    cfg = Eagle3Config(head=head, n_layer=base.n_layer if n_layer is None else n_layer,
                       n_embd=base.n_embd if n_embd is None else n_embd, n_ff=base.n_ff if n_ff is None else n_ff,
                       n_vocab=base.n_vocab if n_vocab is None else n_vocab, draft_vocab=draft_vocab, seed=seed)
    quant = quant.lower()
    draft_quant = draft_dtype_for(quant) if draft_quant is None else draft_quant.lower()
    build_eagle3_test_models(out, draft, cfg, quant, draft_quant)
    layers = ", ".join(str(x) for x in cfg.extract_layers)
    _say(f"wrote {out} ({_mib(out.stat().st_size)}, llama {quant}, {cfg.n_layer} layers) and {draft} "
         f"({_mib(draft.stat().st_size)}, eagle3 {draft_quant}, extract layers {layers}; {cfg.describe()})")
    if check:
        r = check_eagle3(out, draft, n_threads=threads or 1)
        _say(f"greedy EAGLE-3 acceptance: {r.rate:.1%} ({r.n_accepted}/{r.n_drafted} at n-max {r.n_max}); "
             f"output {'equals' if r.equal else 'DIFFERS FROM'} --spec-type none")


def _mtp_type(ctx, param, value):
    v = value.strip().lower()
    if v not in MTP_POLICIES and v not in TENSOR_TYPES:
        raise click.BadParameter(f"'{value}' is not one of {', '.join(MTP_POLICIES + tuple(TENSOR_TYPES))}")
    return v


def _overrides(ctx, param, value):
    try:
        return tuple(parse_override(v) for v in value)
    except Exception as e:  # QuantizeError
        raise click.BadParameter(str(e)) from None


@click.command("quantize")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, writable=True, path_type=Path))
@click.argument("ftype", metavar="FTYPE", type=click.Choice(list(FTYPES), case_sensitive=False))
@click.option("--mtp-type", default=DEFAULT_MTP_TYPE, show_default=True, callback=_mtp_type,
              help="MTP blocks (and token_embd) at this type, eh_proj F16; 'same' = like a trunk layer "
                   "(exact for copied heads); 'none' = llama.cpp's plain mix")
@click.option("--tensor-type", "overrides", multiple=True, callback=_overrides, metavar="PATTERN=TYPE",
              help="per-tensor type override (regex), before the MTP policy; repeatable")
@click.option("--allow-requantize", is_flag=True, help="allow an already quantized input (loses quality)")
@click.option("-t", "--threads", "threads", type=click.IntRange(0, MAX_THREADS), default=0, help="CPU threads (default: all)")
@click.option("-v", "--verbose", is_flag=True, help="log llama.cpp to stderr")
@handle_errors
def quantize_cmd(src, dst, ftype, mtp_type, overrides, allow_requantize, threads, verbose):
    """Quantize SRC to DST with llama.cpp's quantizer (llama-quantize's mixes, e.g. Q4_K_M),
    keeping MTP heads at a precision that preserves draft acceptance."""
    setup_logging(verbose)
    with _progress("quantizing") as on_progress:
        r = quantize(src, dst, ftype.lower(), mtp_type=mtp_type, overrides=overrides, nthread=threads,
                     allow_requantize=allow_requantize, on_progress=on_progress)
    pins = ", ".join(f"{o.pattern}={o.type}" for o in r.overrides) or "none"
    _say(f"wrote {dst} ({_mib(r.bytes_in)} -> {_mib(r.bytes_out)}, {r.ftype}, "
                      f"{r.seconds:.1f} s); overrides: {pins}"
                      + (f"; token_embd {r.token_embd_type}" if r.token_embd_type else ""))


@click.command("extract-mtp")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "out", required=True, type=click.Path(dir_okay=False, writable=True, path_type=Path),
              help="output GGUF")
@click.option("--trunk-only", is_flag=True, help="write the model without its MTP blocks instead")
@click.option("--quant", type=click.Choice(list(FTYPES), case_sensitive=False), default=None,
              help="re-quantize the output with this llama.cpp mix (default: copy tensors as they are)")
@click.option("-t", "--threads", "threads", type=click.IntRange(0, MAX_THREADS), default=0, help="CPU threads (default: all)")
@click.option("-v", "--verbose", is_flag=True, help="log llama.cpp to stderr")
@handle_errors
def extract_mtp_cmd(model, out, trunk_only, quant, threads, verbose):
    """Write MODEL's MTP heads as an MTP-only GGUF (for `--spec-type draft-mtp -md OUT`), or with
    --trunk-only the model without them."""
    setup_logging(verbose)
    extract = extract_trunk if trunk_only else extract_mtp
    if quant is None:
        r = extract(model, out)
    else:
        if same_file(model, out):
            raise ExtractError(f"output {out} is the input file; choose another name")
        check_output(out, file_only=True)                # before the temporary file goes next to it
        fd, tmp_name = tempfile.mkstemp(suffix=".gguf", dir=out.resolve().parent)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            r = extract(model, tmp)
            with _progress("quantizing") as on_progress:
                quantize(tmp, out, quant.lower(), mtp_type="none", nthread=threads, allow_requantize=True,
                         on_progress=on_progress)
        finally:
            tmp.unlink(missing_ok=True)
    what = "trunk" if trunk_only else "MTP heads"
    layers = (f"blocks 0..{r.layout.n_layer - 1}" if trunk_only
              else f"blocks {r.layout.n_layer}..{r.layout.block_count - 1} + globals")
    _say(f"wrote {out} ({what}: {layers}, {r.n_tensors} tensors, {_mib(out.stat().st_size)})")
