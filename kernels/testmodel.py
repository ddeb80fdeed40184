"""Synthetic qwen35 + MTP test models in any quant: f32/f16 straight from the writer
(gguf_spec.testmodel), q8_0/q4_k_m through llama.cpp's quantizer (kernels.quantize). And synthetic
llama targets with an EAGLE-3 draft (gguf_spec.testmodel_eagle3), with a greedy check that runs
them through the engine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specrun.gguf_spec.output import check_output
from specrun.gguf_spec.testmodel import SynthConfig, write_test_model
from specrun.gguf_spec.testmodel_eagle3 import DTYPES as EAGLE3_DTYPES
from specrun.gguf_spec.testmodel_eagle3 import Eagle3Config, write_eagle3_pair

from .engine import Engine
from .llama import MAX_EXACT_BATCH
from .params import EngineParams, SpecParams
from .quantize import ProgressFn, QuantizeError, quantize
from .types import SamplingParams

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
    check_output(path, file_only=True)                  # before the F32 file goes next to it
    tmp = path.with_name(path.name + ".f32.tmp")
    try:
        write_test_model(tmp, cfg, "f32")
        quantize(tmp, path, quant, mtp_type="same", nthread=nthread, on_progress=on_progress)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---- EAGLE-3 ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Eagle3Check:
    """Greedy draft-eagle3 on a synthetic pair, run by the engine (llama.cpp computes every number)."""

    n_drafted: int
    n_accepted: int
    equal: bool          # output == --spec-type none, token for token
    n_max: int

    @property
    def rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


def build_eagle3_test_models(target: str | Path, draft: str | Path, cfg: Eagle3Config,
                             quant: str = "q8_0", draft_quant: str | None = None) -> tuple[Path, Path]:
    """Write a synthetic llama target in quant and its EAGLE-3 draft in draft_quant (f32 / f16 /
    q8_0, written directly; default: f16 beside a q8_0 target, see gguf_spec.testmodel_eagle3)."""
    quants = [q.strip().lower() if q else None for q in (quant, draft_quant)]
    for q in quants:
        if q is not None and q not in EAGLE3_DTYPES:
            raise QuantizeError(f"the EAGLE-3 test models are written as {', '.join(EAGLE3_DTYPES)}, not '{q}'")
    return write_eagle3_pair(target, draft, cfg, quants[0], quants[1])


def check_eagle3(target: str | Path, draft: str | Path, *, n_max: int = MAX_EXACT_BATCH - 1, n_predict: int = 128,
                 n_threads: int = 1) -> Eagle3Check:
    """Generate greedily with and without the draft (exact mode) and count what the target kept.
    The longest chain exact mode verifies by default: an exact head must hold for all of it."""
    spec = SpecParams(types=("draft-eagle3",), n_max=n_max, verify="match")
    greedy = SamplingParams(temp=0.0)
    with Engine(str(target), EngineParams(n_ctx=1024, n_threads=n_threads, draft_model=str(draft),
                                          spec=spec)) as e:
        prompt = e.tokenize("The quick brown fox jumps over the lazy dog.")
        plain = [t for ts in e.generate(prompt, n_predict, greedy, spec=SpecParams()) for t in ts]
        gen = e.generate(prompt, n_predict, greedy, spec=spec)
        got = [t for ts in gen for t in ts]
    return Eagle3Check(gen.stats.n_drafted, gen.stats.n_accepted, got == plain, n_max)
