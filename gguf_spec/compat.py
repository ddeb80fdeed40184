"""Can `draft` draft for `target`? The rules of llama.cpp's `common_speculative_are_compatible`
(common/speculative.cpp): the same vocabulary type, the same add_bos/add_eos and, where added,
the same BOS/EOS ids, vocabulary sizes within 128 tokens, and the same token texts from id 5 up
to the smaller size. Where llama.cpp stops at the first failed rule, the reason here lists every
failed rule, with the numbers."""

from __future__ import annotations

from dataclasses import dataclass

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


def check_mtp_heads_compatible(target: ModelSpec, heads: ModelSpec) -> Compat:
    """Can `heads` (an -md file for draft-mtp) draft for `target`? It must hold MTP heads, as wide as
    the target's rows and over its vocabulary (llama.cpp GGML_ASSERTs "MTP input row width must
    match" and aborts the process otherwise)."""
    if not heads.has_mtp:
        return Compat(False, f"no MTP heads in {heads.path.name}; write a heads file with "
                             "`specrun extract-mtp MODEL.gguf -o HEADS.gguf` from a model that has them")
    t_vocab = target.vocab.size if target.vocab else None
    h_vocab = heads.vocab.size if heads.vocab else None
    if heads.n_embd != target.n_embd or (t_vocab is not None and h_vocab is not None and h_vocab != t_vocab):
        return Compat(False, f"MTP heads of width {heads.n_embd} / vocab {h_vocab} do not fit the target "
                             f"({target.n_embd} / {t_vocab}); extract the heads from this model's own GGUF")
    return Compat(True)


# target architectures whose llama.cpp 0.3.36 graph marks the input of every layer for export
# (src/models/*.cpp: res->t_layer_inp[il]); for any other, enabling an EAGLE-3 extract layer
# GGML_ASSERTs ("layer input tensor is null") and aborts the process
EAGLE3_TARGET_ARCHS = ("llama", "qwen3moe", "qwen3next", "qwen4exp", "lfm2", "gpt-oss", "muse-glimmer", "deepseek4")


def eagle3_problem(draft: ModelSpec) -> str | None:
    """Why `draft` is not an EAGLE-3 draft llama.cpp can run (checked before llama.cpp sees it:
    several of these abort the process there), or None."""
    if not draft.is_eagle3:
        if draft.has_mtp:
            return (f"it holds MTP heads (architecture {draft.architecture}), not an EAGLE-3 draft; "
                    f"use --spec-type draft-mtp -md {draft.path.name}")
        return (f"it is a {draft.architecture} model, not an EAGLE-3 draft (architecture eagle3); "
                f"use --spec-type draft -md {draft.path.name}")
    e = draft.eagle3
    assert e is not None
    if len(e.target_layers) != 3:
        return (f"it lists {len(e.target_layers)} extract layers {list(e.target_layers)} in eagle3.target_layers; "
                "llama.cpp's EAGLE-3 reads exactly 3")
    if e.target_hidden_size is None:
        return "it has no eagle3.target_hidden_size; convert it again with llama.cpp's convert_hf_to_gguf.py"
    if e.n_layer != 1:
        return f"it has {e.n_layer} decoder layers; llama.cpp's EAGLE-3 runs exactly 1"
    if e.draft_vocab is not None and not e.own_output:
        return f"its d2t maps {e.draft_vocab} draft tokens but it has no output head of its own"
    return None


def check_eagle3_compatible(target: ModelSpec, draft: ModelSpec) -> Compat:
    """Can the EAGLE-3 draft `draft` read `target`'s layers? Its three extract layers must lie
    below the target's n_layer, its target hidden size must be the target's n_embd, the target's
    architecture must export layer inputs (EAGLE3_TARGET_ARCHS), and a draft that borrows the
    target's token embeddings or head must be as wide as the target. Every failed rule is listed,
    with both numbers."""
    why = eagle3_problem(draft)
    if why:
        return Compat(False, why)
    e = draft.eagle3
    assert e is not None
    n_layer, n_embd = target.n_layer_trunk, target.n_embd
    problems = []
    if target.architecture not in EAGLE3_TARGET_ARCHS:
        problems.append(f"llama.cpp exports no layer inputs of a {target.architecture} target to an EAGLE-3 draft "
                        f"(only {', '.join(EAGLE3_TARGET_ARCHS)})")
    bad = [x for x in e.target_layers if n_layer is None or not 0 <= x < n_layer]
    if bad:
        problems.append(f"extract layers {list(e.target_layers)} do not fit the target's {n_layer} layers "
                        f"(0..{(n_layer or 0) - 1}): the draft was made for a deeper model")
    if e.target_hidden_size != n_embd:
        problems.append(f"the draft reads target rows of width {e.target_hidden_size} but the target's n_embd is {n_embd}")
    if (not e.own_token_embd or not e.own_output) and e.n_embd != n_embd:
        problems.append(f"the draft's n_embd {e.n_embd} differs from the target's n_embd {n_embd}, and it borrows the "
                        f"target's {'token embeddings' if not e.own_token_embd else 'output head'}")
    if target.vocab is not None and draft.vocab is not None and target.vocab.size != draft.vocab.size:
        problems.append(f"draft vocab ({draft.vocab.size} tokens) differs from target ({target.vocab.size})")
    elif target.vocab is not None and e.d2t_max is not None and e.d2t_max >= target.vocab.size:
        problems.append(f"d2t maps to token {e.d2t_max}, beyond the target's {target.vocab.size} tokens")
    if problems:
        return Compat(False, "; ".join(problems) + "; use the EAGLE-3 draft made for this model")
    return Compat(True)
