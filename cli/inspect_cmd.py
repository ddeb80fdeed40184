"""`specrun inspect MODEL`: what a GGUF holds (summary, quantization mix, the spec types it can
use, MTP heads, an EAGLE-3 draft's extract layers, tensors), as rich tables or one JSON object, and
with --draft (-md) whether another file can draft for it (a draft model or an EAGLE-3 draft)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from specrun.gguf_spec.compat import (
    Compat,
    check_draft_compatible,
    check_eagle3_compatible,
    check_mtp_heads_compatible,
    vocab_type,
)
from specrun.gguf_spec.spec import ModelSpec, TensorInfo, load_spec

from .runtime.console import handle_errors, resolve
from .runtime.loading import types_for

NO_MTP = "no MTP heads: --spec-type draft-mtp is not available for this model"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _shape(shape: tuple[int, ...]) -> str:
    return " x ".join(str(d) for d in shape)


def _tensor_json(t: TensorInfo, offset: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"name": t.name, "type": t.type, "shape": list(t.shape), "n_bytes": t.n_bytes}
    if offset:
        d["offset"] = t.offset
    return d


def spec_types(spec: ModelSpec, draft: ModelSpec | None) -> tuple[str, ...]:
    """What --spec-type can be with this model (and -md draft): none first; () for a file that
    drafts for another model (MTP heads alone, an EAGLE-3 draft)."""
    if spec.is_eagle3 or (spec.has_mtp and not spec.has_trunk):
        return ()
    return ("none", *types_for(spec, draft))


def _spec_types_line(spec: ModelSpec, draft: ModelSpec | None) -> str:
    types = spec_types(spec, draft)
    if spec.is_eagle3:
        return ("spec types: none of its own; an EAGLE-3 draft runs beside the model it was made for: "
                f"-md {spec.path.name} --spec-type draft-eagle3 (`specrun inspect MODEL -md {spec.path.name}` "
                "checks the fit)")
    if not types:
        return (f"spec types: none of its own; MTP heads run beside the model they came from: -md {spec.path.name} "
                "--spec-type draft-mtp")
    added = draft is not None and len(types) > len(spec_types(spec, None))
    return f"spec types: {', '.join(types)}" + (f" (with -md {draft.path.name})" if added else "")


def _eagle3_json(spec: ModelSpec) -> dict[str, Any] | None:
    e = spec.eagle3
    if e is None:
        return None
    return {"target_layers": list(e.target_layers), "target_hidden_size": e.target_hidden_size, "n_embd": e.n_embd,
            "n_layer": e.n_layer, "draft_vocab": e.draft_vocab, "own_token_embd": e.own_token_embd,
            "own_output": e.own_output, "norm_before_fc": e.norm_before_fc,
            "norm_before_residual": e.norm_before_residual}


def _as_json(spec: ModelSpec, tensors: bool, draft: tuple[ModelSpec, Compat] | None) -> dict[str, Any]:
    v = spec.vocab
    out: dict[str, Any] = {
        "path": str(spec.path),
        "architecture": spec.architecture,
        "name": spec.name,
        "size_label": spec.size_label,
        "file_type": spec.file_type,
        "context_length": spec.context_length,
        "n_embd": spec.n_embd,
        "n_layer": spec.n_layer,
        "n_head": spec.n_head,
        "n_head_kv": spec.n_head_kv,
        "vocab": None if v is None else {
            "model": v.model, "type": vocab_type(v), "pre": v.pre, "size": v.size, "bos_id": v.bos_id,
            "eos_id": v.eos_id, "eot_id": v.eot_id, "add_bos": v.add_bos, "add_eos": v.add_eos,
        },
        "chat_template": spec.has_chat_template,
        "n_tensors": spec.n_tensors,
        "n_bytes": spec.n_bytes,
        "quant_mix": [{"type": q.type, "n_tensors": q.n_tensors, "n_bytes": q.n_bytes} for q in spec.quant_mix],
        "mtp": {
            "nextn_predict_layers": spec.nextn_predict_layers,
            "available": spec.has_mtp,
            "blocks": [{"index": b.index, "tensors": [_tensor_json(t, False) for t in b.tensors]}
                       for b in spec.mtp_blocks],
        },
        "eagle3": _eagle3_json(spec),
        "spec_types": list(spec_types(spec, draft[0] if draft else None)),
    }
    if tensors:
        out["tensors"] = [_tensor_json(t, True) for t in spec.tensors]
    if draft is not None:
        d, c = draft
        out["draft"] = {"path": str(d.path), "compatible": c.ok, "reason": c.reason}
    return out


def _summary(spec: ModelSpec) -> Table:
    t = Table(title=f"{spec.path.name}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    v = spec.vocab
    rows = [
        ("path", str(spec.path)),
        ("architecture", spec.architecture),
        ("name", spec.name or "-"),
        ("size", spec.size_label or "-"),
        ("file type", spec.file_type or "-"),
        ("context length", f"{spec.context_length or '-'}"),
        ("embedding", f"{spec.n_embd or '-'}"),
        ("layers", f"{spec.n_layer or '-'}"),
        ("heads", f"{spec.n_head or '-'} (kv {spec.n_head_kv or '-'})"),
        ("vocab", "-" if v is None else
            f"{v.size} tokens, {v.model} ({vocab_type(v)}), pre {v.pre or '-'}, bos {v.bos_id}, eos {v.eos_id}, "
            f"eot {v.eot_id if v.eot_id is not None else '-'}, add_bos {str(v.add_bos).lower()}"),
        ("chat template", f"yes ({len(spec.chat_template)} chars)" if spec.chat_template is not None else "no"),
        ("tensors", f"{spec.n_tensors} ({_mib(spec.n_bytes)})"),
    ]
    for k, val in rows:
        t.add_row(k, Text(val))
    return t


def _quant_mix(spec: ModelSpec) -> Table:
    t = Table(title="quantization mix", title_justify="left")
    t.add_column("type")
    t.add_column("tensors", justify="right")
    t.add_column("size", justify="right")
    t.add_column("share", justify="right")
    total = spec.n_bytes or 1
    for q in spec.quant_mix:
        t.add_row(q.type, str(q.n_tensors), _mib(q.n_bytes), f"{100 * q.n_bytes / total:.1f}%")
    return t


def _eagle3(spec: ModelSpec) -> Table:
    e = spec.eagle3
    assert e is not None
    t = Table(title="EAGLE-3 draft", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    vocab = spec.vocab.size if spec.vocab else "?"
    rows = [
        ("extract layers", ", ".join(str(x) for x in e.target_layers) + " (low, mid, high: target layers whose "
                                                                       "inputs it reads)"),
        ("target hidden size", f"{e.target_hidden_size or '-'} (fc: {len(e.target_layers)} x that -> {e.n_embd})"),
        ("draft n_embd", f"{e.n_embd or '-'}, {e.n_layer or '-'} decoder layer(s)"),
        ("draft vocab", f"{e.draft_vocab} tokens, mapped to target ids by d2t" if e.draft_vocab
            else f"the target's ({vocab} tokens, no d2t)"),
        ("token embeddings", "its own" if e.own_token_embd else "the target's"),
        ("output head", "its own" if e.own_output else "the target's"),
        ("norms", f"norm_before_fc {str(e.norm_before_fc).lower()}, "
                  f"norm_before_residual {str(e.norm_before_residual).lower()}"),
    ]
    for k, val in rows:
        t.add_row(k, Text(val))
    return t


def _mtp(spec: ModelSpec) -> Table:
    t = Table(title=f"MTP heads (nextn_predict_layers = {spec.nextn_predict_layers})", title_justify="left")
    for col in ("block", "tensor", "type", "shape", "size"):
        t.add_column(col, overflow="fold", justify="right" if col == "size" else "left")
    for b in spec.mtp_blocks:
        for i, x in enumerate(b.tensors):
            t.add_row(str(b.index) if i == 0 else "", Text(x.name), x.type, _shape(x.shape), _mib(x.n_bytes))
    return t


def _tensors(spec: ModelSpec) -> Table:
    t = Table(title="tensors", title_justify="left")
    for col in ("name", "type", "shape", "bytes", "offset"):
        t.add_column(col, overflow="fold", justify="left" if col in ("name", "type", "shape") else "right")
    for x in spec.tensors:
        t.add_row(Text(x.name), x.type, _shape(x.shape), str(x.n_bytes), str(x.offset))
    return t


@click.command("inspect")
@click.argument("model")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every tensor (name, type, shape, bytes, offset).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of tables.")
@click.option("--draft", "-md", "--model-draft", "draft", metavar="DRAFT",
              help="Report whether DRAFT (path or registry name; a draft model or an EAGLE-3 draft) can draft for "
                   "MODEL, and the spec types the pair allows.")
@handle_errors
def inspect(model: str, show_tensors: bool, as_json: bool, draft: str | None) -> None:
    """Show what the GGUF MODEL (a path or a registry name) holds."""
    spec = load_spec(resolve(model))
    checked = None
    if draft is not None:
        d = load_spec(resolve(draft))
        check = (check_eagle3_compatible if d.is_eagle3 else
                 check_mtp_heads_compatible if d.has_mtp and not d.has_trunk else check_draft_compatible)
        checked = (d, check(spec, d))
    if as_json:
        click.echo(json.dumps(_as_json(spec, show_tensors, checked), indent=2))
        return
    out = Console(highlight=False)

    def line(text: str) -> None:
        out.print(text, markup=False, soft_wrap=True)

    out.print(_summary(spec))
    out.print(_quant_mix(spec))
    if spec.eagle3 is not None:
        out.print(_eagle3(spec))
    line(_spec_types_line(spec, checked[0] if checked else None))
    if spec.mtp_blocks:
        out.print(_mtp(spec))
        if not spec.has_mtp:
            line("MTP blocks without nextn.* tensors: --spec-type draft-mtp is not available for this model")
    else:
        line(NO_MTP)
    if show_tensors:
        out.print(_tensors(spec))
    if checked is not None:
        d, c = checked
        if c.ok:
            line(f"draft {d.path.name}: compatible with {spec.path.name}")
        else:
            line(f"draft {d.path.name}: INCOMPATIBLE with {spec.path.name}: {c.reason}")
