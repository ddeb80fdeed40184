"""Split a GGUF with MTP (NextN) blocks into an MTP-only file and a trunk-only file.

llama.cpp's layout (gguf_spec.spec.read_layout): the MTP blocks are the last
`{arch}.nextn_predict_layers` blocks, so n_layer = block_count - nextn_predict_layers is the
trunk depth.

MTP-only ("heads") file, the same layout as llama.cpp's `convert_hf_to_gguf.py --mtp`:
  * every metadata key unchanged (block_count still counts the trunk, nextn_predict_layers > 0);
  * the tensors of blocks n_layer .. block_count-1 and every global tensor (token_embd,
    output_norm, output: what the MTP graph falls back on when the block has no
    nextn.embed_tokens / shared_head_*).
  llama.cpp's loaders for MTP architectures (qwen35 and the others in src/models/*.cpp) treat
  a file with nextn_predict_layers > 0 and no `blk.0.attn_norm.weight` as MTP-only and mark
  the trunk tensors not required. Load it with load_mtp = true and create the draft context
  on it with ctx_type = MTP and ctx_other = the target context.

Trunk-only file (`convert_hf_to_gguf.py --no-mtp`): blocks 0 .. n_layer-1 and the globals,
block_count = n_layer, no nextn_predict_layers key, per-layer arrays cut to n_layer entries.

Tensors are copied byte for byte (same types); requantizing is kernels.quantize's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import gguf

from .errors import SpecrunError
from .output import same_file, writing
from .spec import BoundedReader, MtpLayout, open_gguf, read_layout

_BLOCK = re.compile(r"^blk\.(\d+)\.")


class ExtractError(SpecrunError):
    """A split that cannot be written (e.g. the output would overwrite the input)."""


class NoMtpHeads(ExtractError):
    """The model has no MTP (NextN) blocks to extract or strip."""


@dataclass(frozen=True, slots=True)
class ExtractResult:
    path: Path
    layout: MtpLayout        # of the source
    n_tensors: int           # written
    n_bytes: int             # tensor data written


def _layer_of(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def _copy(reader: BoundedReader, dst: Path, layout: MtpLayout, keep_layer, kv_edit) -> ExtractResult:
    if same_file(dst, reader.path):                       # a hard or symbolic link to it too
        raise ExtractError(f"output {dst} is the input file; choose another name")
    writer = gguf.GGUFWriter(None, layout.arch)           # the file is opened by write_header_to_file
    align = reader.fields.get(gguf.Keys.General.ALIGNMENT)
    if align is not None:
        writer.data_alignment = int(align.contents())
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = kv_edit(field.name, field.contents())
        if value is not None:
            writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
    tensors = [t for t in reader.tensors if (il := _layer_of(t.name)) is None or keep_layer(il)]
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    with writing(dst) as out:
        writer.write_header_to_file(out)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
    return ExtractResult(dst, layout, len(tensors), sum(int(t.n_bytes) for t in tensors))


def extract_mtp(src: str | Path, dst: str | Path) -> ExtractResult:
    """Write the MTP-only GGUF of `src` to `dst` (see the module docstring)."""
    reader = open_gguf(src)
    layout = read_layout(reader)
    if layout.nextn_layers == 0:
        raise NoMtpHeads(f"{src} has no MTP heads ({layout.arch}.nextn_predict_layers is 0 or absent)")
    if not layout.has_trunk:
        raise NoMtpHeads(f"{src} is already an MTP-only file (it has no trunk tensors)")
    return _copy(reader, Path(dst), layout, lambda il: il >= layout.n_layer, lambda key, value: value)


def extract_trunk(src: str | Path, dst: str | Path) -> ExtractResult:
    """Write `src` without its MTP blocks to `dst` (see the module docstring)."""
    reader = open_gguf(src)
    layout = read_layout(reader)
    if layout.nextn_layers == 0:
        raise NoMtpHeads(f"{src} has no MTP heads ({layout.arch}.nextn_predict_layers is 0 or absent); "
                         "it is already trunk-only")
    if not layout.has_trunk:
        raise ExtractError(f"{src} is an MTP-only file (it has no trunk tensors); there is no trunk to extract")
    prefix = f"{layout.arch}."
    nextn_key = gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=layout.arch)
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=layout.arch)
    sections_key = gguf.Keys.Rope.DIMENSION_SECTIONS.format(arch=layout.arch)

    def kv_edit(key: str, value):
        if key == nextn_key:
            return None
        if key == count_key:
            return layout.n_layer
        if (key.startswith(prefix) and key != sections_key and isinstance(value, list)
                and len(value) == layout.block_count):
            return value[: layout.n_layer]           # per-layer arrays (recurrent_layers, ...)
        return value

    return _copy(reader, Path(dst), layout, lambda il: il < layout.n_layer, kv_edit)
