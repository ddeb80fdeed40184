"""Can `draft` draft for `target`? The rules of llama.cpp's `common_speculative_are_compatible`
(common/speculative.cpp): the same vocabulary type, the same add_bos/add_eos and, where added,
the same BOS/EOS ids, vocabulary sizes within 128 tokens, and the same token texts from id 5 up
to the smaller size. Where llama.cpp stops at the first failed rule, the reason here lists every
failed rule, with the numbers."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import IncompatibleDraft
from .spec import ModelSpec, Vocab

SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

# tokenizer.ggml.model -> llama_vocab_type (llama-vocab.cpp); llama.cpp compares the type
_VOCAB_TYPE = {"no_vocab": "NONE", "none": "NONE", "llama": "SPM", "bert": "WPM", "gpt2": "BPE",
               "hybriddna": "BPE", "whitespace": "BPE", "gemma4": "BPE", "t5": "UGM", "rwkv": "RWKV",
               "test": "TEST", "plamo2": "PLAMO2"}
_FIX = "use a draft from the same model family"


@dataclass(frozen=True, slots=True)
class Compat:
    ok: bool
    reason: str | None = None      # None when ok


def vocab_type(v: Vocab) -> str:
    return _VOCAB_TYPE.get(v.model, v.model)


def _special(kind: str, add_t: bool, id_t: int | None, add_d: bool, id_d: int | None) -> str | None:
    if add_t != add_d or (add_t and id_t != id_d):
        return (f"draft {kind} (add {str(add_d).lower()}, id {id_d}) differs from target's "
                f"(add {str(add_t).lower()}, id {id_t})")
    return None


def check_draft_compatible(target: ModelSpec, draft: ModelSpec) -> Compat:
    t, d = target.vocab, draft.vocab
    if t is None or d is None:
        which = "target" if t is None else "draft"
        return Compat(False, f"the {which} has no vocabulary (no tokenizer.ggml.tokens); {_FIX}")
    problems = []
    if vocab_type(t) != vocab_type(d):
        problems.append(f"draft vocab type {vocab_type(d)} ({d.model}) differs from target's "
                        f"{vocab_type(t)} ({t.model})")
    problems.append(_special("BOS", t.add_bos, t.bos_id, d.add_bos, d.bos_id))
    problems.append(_special("EOS", t.add_eos, t.eos_id, d.add_eos, d.eos_id))
    if abs(t.size - d.size) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(f"draft vocab ({d.size} tokens) differs from target ({t.size}) "
                        f"by more than {SPEC_VOCAB_MAX_SIZE_DIFFERENCE}")
    problems = [p for p in problems if p]
    if not problems:
        start, end = SPEC_VOCAB_CHECK_START_TOKEN_ID, min(t.size, d.size)
        if t.tokens[start:end] != d.tokens[start:end]:
            i = next(i for i in range(start, end) if t.tokens[i] != d.tokens[i])
            problems.append(f"draft token {i} is {d.tokens[i]!r} but target token {i} is {t.tokens[i]!r}")
    if problems:
        return Compat(False, "; ".join(problems) + f"; {_FIX}")
    return Compat(True)


def require_draft_compatible(target: ModelSpec, draft: ModelSpec) -> None:
    """raises: IncompatibleDraft with the reason (naming both files) when check_draft_compatible fails."""
    c = check_draft_compatible(target, draft)
    if not c.ok:
        raise IncompatibleDraft(f"draft {draft.path.name} cannot draft for {target.path.name}: {c.reason}")
