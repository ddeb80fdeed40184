"""Synthetic qwen35 + MTP test models in any quant: f32/f16 straight from the writer
(gguf_spec.testmodel), q8_0/q4_k_m through llama.cpp's quantizer (kernels.quantize)."""

from __future__ import annotations

from pathlib import Path

from specrun.gguf_spec.testmodel import SynthConfig, write_test_model

from .quantize import ProgressFn, QuantizeError, quantize

TEST_MODEL_QUANTS = ("f32", "f16", "q8_0", "q4_k_m")


def build_test_model(path: str | Path, cfg: SynthConfig, quant: str = "f16", *, nthread: int = 0,
                     on_progress: ProgressFn | None = None) -> Path:
    """Write a synthetic qwen35 + MTP model (gguf_spec.testmodel) in `quant`. f32/f16 come from
    the writer; q8_0/q4_k_m from an F32 file through llama.cpp's quantizer with the "same" MTP
    policy, so an exact head stays exact."""
    quant = quant.strip().lower()
    if quant not in TEST_MODEL_QUANTS:
        raise QuantizeError(f"unknown test-model quant '{quant}'; choose one of {', '.join(TEST_MODEL_QUANTS)}")
    path = Path(path)
    if quant in ("f32", "f16"):
        return write_test_model(path, cfg, quant)
    if "_k" in quant and (cfg.n_embd % 256 or cfg.n_ff % 256):
        raise QuantizeError(f"{quant} needs n_embd and n_ff to be multiples of 256 (K-quant super-blocks); "
                            f"got n_embd {cfg.n_embd}, n_ff {cfg.n_ff}")
    tmp = path.with_name(path.name + ".f32.tmp")
    try:
        write_test_model(tmp, cfg, "f32")
        quantize(tmp, path, quant, mtp_type="same", nthread=nthread, on_progress=on_progress)
    finally:
        tmp.unlink(missing_ok=True)
    return path
