"""The fast prompt context (kernels/prefill.py) and the KV-state re-encoding (kernels/kvstate.py).

What must hold: a prompt's result (tokens and logits) is a function of its tokens alone, whatever
the caches held before (fresh, after another prompt, after a chat turn); speculative output still
equals plain decoding through the hand-over; a model whose state cannot be handed over falls back
to the exact path with one warning, and one whose repacked twin does not load keeps its exact
weights for the fast context; --no-fast-prefill is the exact path of before.
"""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import numpy as np
import pytest

from specrun.kernels import kvstate
from specrun.kernels.drafters import DraftModel
from specrun.kernels.engine import Engine
from specrun.kernels.kvstate import KVStateError, hadamard, quantize_k, quantize_q8_0, to_streams
from specrun.kernels.llama import LlamaError, Model
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.prefill import BLOCK, MIN_BLOCK, MIN_PROMPT, fast_blocks, fast_len
from specrun.kernels.types import SamplingParams

_CODE = (Path(__file__).parent / "data" / "copy_source.txt").read_text()
GREEDY = SamplingParams(temp=0.0)
SEEDED = SamplingParams(temp=0.8, seed=77)


# ---- units -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "want"), [(0, 0), (1, 0), (255, 0), (256, 192), (257, 256), (512, 448), (513, 512),
                                         (514, 512), (577, 576),
                                         (1024, 960), (1025, 1024), (1100, 1088), (1600, 1536)])
def test_fast_len_all_but_the_last_tokens(n, want):
    assert fast_len(n) == want
    assert fast_len(n) % MIN_BLOCK == 0 and fast_len(n) <= max(n - 1, 0)
    assert fast_len(n) == 0 or n - fast_len(n) <= MIN_BLOCK


@pytest.mark.parametrize(("end", "want"), [
    (0, []),
    (64, [(0, 64)]),
    (192, [(0, 128), (128, 64)]),
    (704, [(0, 512), (512, 128), (640, 64)]),
    (960, [(0, 512), (512, 256), (768, 128), (896, 64)]),
    (1088, [(0, 512), (512, 512), (1024, 64)]),
])
def test_fast_blocks_by_hand(end, want):
    assert fast_blocks(end) == want


@pytest.mark.parametrize("end", range(0, 4097, MIN_BLOCK))
def test_fast_blocks_cover_aligned_and_are_a_prefix_of_longer_ones(end):
    """Contiguous from 0 to end, each aligned at a multiple of its size, at most one block under
    BLOCK of each size; every whole-BLOCK block of a shorter prompt is one of a longer one's."""
    b = fast_blocks(end)
    assert [s for s, _ in b] == [0, *(s + n for s, n in b[:-1])][:len(b)] and sum(n for _, n in b) == end
    assert all(s % n == 0 and n >= MIN_BLOCK and BLOCK % n == 0 for s, n in b)
    small = [n for _, n in b if n < BLOCK]
    assert len(small) == len(set(small)) and small == sorted(small, reverse=True)
    whole = [x for x in b if x[1] == BLOCK]
    assert fast_blocks(end + BLOCK)[:len(whole)] == whole


def test_quantize_q8_0_by_hand():
    x = np.arange(64, dtype=np.float32).reshape(1, 64) - 10         # blocks: -10..21, 22..53
    q = quantize_q8_0(x)
    assert q.shape == (1, 68)                                       # 2 blocks of 2 + 32 bytes
    d = q[0, [0, 1, 34, 35]].view("<f2").astype(np.float32)
    np.testing.assert_allclose(d, [21 / 127, 53 / 127], rtol=1e-3)
    qs = q[0, 2:34].view(np.int8)
    assert qs[0] == round(-10 * 127 / 21) == -60 and qs[31] == 127
    assert (quantize_q8_0(np.zeros((2, 32), np.float32))[:, 2:] == 0).all()   # scale 0: no division


def test_hadamard_is_llama_cpps():
    h = hadamard(64)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)        # orthonormal and symmetric
    assert h[0, 0] == np.float32(1 / 8) and h[1, 1] == np.float32(-1 / 8) and h[2, 1] == np.float32(1 / 8)


def _blob(n_cells: int, n_embd: int, n_layer: int = 1, *, magic=kvstate.IO_MAGIC, typ=1, v_trans=0,
          seq=0) -> bytes:
    """A one-sequence state as llama-kv-cache.cpp writes it (see kernels/kvstate.py)."""
    rng = np.random.default_rng(0)
    out = [np.array([magic], "<u4").tobytes(), np.int32(0).tobytes(), np.uint32(1).tobytes(),
           np.uint32(n_cells).tobytes()]
    out += [np.array([p, 1, seq], "<i4").tobytes() for p in range(n_cells)]
    out.append(np.array([v_trans, n_layer], "<u4").tobytes())
    for _ in range(2 * n_layer):
        out += [np.int32(typ).tobytes(), np.uint64(2 * n_embd).tobytes(),
                rng.standard_normal((n_cells, n_embd)).astype("<f2").tobytes()]
    return b"".join(out)


def test_quantize_k_rotates_and_requantizes_k_rows_and_copies_v_rows():
    blob = _blob(3, 128, n_layer=2)
    out = quantize_k(blob, (128, 0))
    hdr = 8 + 8 + 12 * 3 + 8
    assert out[:hdr] == blob[:hdr]                                  # header and cells unchanged
    row_q, row_f = 128 // 32 * 34, 128 * 2
    assert len(out) == hdr + 2 * (12 + 3 * row_q) + 2 * (12 + 3 * row_f)
    # the first K row: dequantized, it is H128 times the F16 row
    assert np.frombuffer(out[hdr:hdr + 4], "<i4")[0] == kvstate.GGML_Q8_0
    assert np.frombuffer(out[hdr + 4:hdr + 12], "<u8")[0] == row_q
    q = np.frombuffer(out[hdr + 12:hdr + 12 + row_q], np.uint8).reshape(4, 34)
    deq = (q[:, 2:].view(np.int8).astype(np.float32) * q[:, :2].copy().view("<f2").astype(np.float32)).ravel()
    x = np.frombuffer(blob[hdr + 12:hdr + 12 + 256], "<f2").astype(np.float32)
    want = x @ hadamard(128)
    assert np.abs(deq - want).max() <= np.abs(want).max() / 127 + 1e-6
    assert not np.allclose(deq, x, atol=0.05)                       # the rotation was applied
    # the V sections (after the 2 K layers): the same bytes, type and row size as given
    v_in = hdr + 2 * (12 + 3 * row_f)
    v_out = hdr + 2 * (12 + 3 * row_q)
    assert out[v_out:] == blob[v_in:]


def test_quantize_k_refuses_a_rotated_v_cache():
    with pytest.raises(KVStateError, match="blocks of 64"):
        quantize_k(_blob(2, 64), (64, 64))


def test_to_streams_adds_an_empty_record_per_other_stream_in_each_cache():
    one = _blob(3, 64, n_layer=2)
    sec = one[8:]                                      # after magic and seq_id: one cache's section
    iswa = one + sec                                   # an iSWA model's state: two sections
    out = to_streams(iswa, 3)
    want_sec = np.uint32(3).tobytes() + sec[4:] + np.zeros(2, "<u4").tobytes()
    assert out == one[:8] + want_sec + want_sec
    assert to_streams(one, 1) is one


@pytest.mark.parametrize(("blob", "msg"), [(_blob(2, 64, magic=1), "magic"), (_blob(2, 64, v_trans=1), "transposed"),
                                           (_blob(2, 64)[:-5], "ends at byte")])
def test_to_streams_refuses_other_layouts(blob, msg):
    with pytest.raises(KVStateError, match=msg):
        to_streams(blob, 2)
    several = to_streams(_blob(2, 64), 2)
    with pytest.raises(KVStateError, match="a state of 2 streams"):
        to_streams(several, 4)


@pytest.mark.parametrize(("kw", "msg"), [({"magic": 1}, "magic"), ({"typ": 8}, "type 8"),
                                         ({"v_trans": 1}, "transposed"), ({"seq": 1}, "one plain sequence")])
def test_quantize_k_refuses_other_layouts(kw, msg):
    with pytest.raises(KVStateError, match=msg):
        quantize_k(_blob(2, 64, **kw))
    with pytest.raises(KVStateError, match="ends at byte"):
        quantize_k(_blob(2, 64)[:-5])


# ---- real models -----------------------------------------------------------------------------

def _toks(gen) -> list[int]:
    return [t for c in gen for t in c]


def _run(e: Engine, prompt, n=24, sampling=GREEDY, **kw):
    gen = e.generate(prompt, n, sampling, logprobs=0, **kw)
    toks = _toks(gen)
    return toks, [lp.logprob for lp in gen.logprobs], gen.stats


# Gemma's long prompts are the suite's slowest: its half runs in `make test-full`
@pytest.fixture(scope="module", params=[pytest.param("gemma", marks=pytest.mark.full), "smollm"])
def engines(request, gemma_path, smollm_path):
    """(engine with the fast prompt context, the same without it, prompts) for one model.
    Gemma 3 has sliding-window layers (a handed-over state keeps only the window)."""
    path = str(gemma_path if request.param == "gemma" else smollm_path)
    # the fast context in this process, whose parts these tests look at (Gemma's Q6_K would send it to a
    # child process: tests/test_prefill_worker.py)
    fast = Engine(path, EngineParams(n_ctx=2048, prefill_worker=False))
    slow = Engine(path, EngineParams(n_ctx=2048, fast_prefill=False))
    text = "Copy this file verbatim.\n\n" + _CODE + "\n\nCopy:\n\n" + _CODE
    toks = fast.tokenize(text)
    # the shortest prompts that show each property: "short" (256 + 44) crosses MIN_PROMPT,
    # "block_and_more" (512 + 64 + 24) has a block after the first BLOCK, "copy" (about 300) is a copy task
    prompts = {"two_blocks": toks[:1100], "one_block": toks[:700], "block_and_more": toks[:600], "short": toks[:300],
               "tiny": toks[:100],
               "copy": fast.tokenize("Copy this file verbatim.\n\n" + _CODE[:800] + "\n\nCopy:\n\n" + _CODE[:150])}
    assert len(prompts["copy"]) >= MIN_PROMPT
    yield fast, slow, prompts
    fast.close()
    slow.close()


@pytest.mark.slow
@pytest.mark.full
def test_fast_path_is_used_and_opt_out_is_the_exact_path(engines):
    fast, slow, P = engines
    fast.reset()
    fast.fast.close()
    _, _, st = _run(fast, P["short"], 4)
    assert (st.n_prompt_fast, st.n_prompt) == (300, 300) and st.fast_kv_mib > 0     # its tail too
    assert "through the fast prompt context" in st.lines()[0]
    # over the model's repacked twin, shared by every engine over that model (server slots)
    # (the model itself when nothing in the file is repacked on this CPU: SmolLM2's Q4_1 on x86)
    twin = fast.model.repacked()
    assert fast.fast.weights is twin and twin.repacked_mib == st.fast_weights_mib
    assert (twin is fast.model) == (st.fast_weights_mib == 0) == ("repacked weights" not in st.lines()[0])
    if "gemma" in fast.model.path and platform.machine() in ("x86_64", "AMD64"):   # Q4_K: repacked on x86
        assert st.fast_weights_mib > 0
    other = Engine(fast.model.path, fast.params, model=fast.model)
    try:
        assert other.fast.weights is None
        other.start_prefill()                      # a server's slot: the twin at load, not at a prompt
        assert other.fast.weights is fast.fast.weights
        _run(other, P["short"], 1)
        assert other.fast.weights is fast.fast.weights
    finally:
        other.close()
    _, _, st = _run(slow, P["short"], 4)
    assert st.n_prompt_fast == 0 and slow.fast is None
    fast.reset()
    _, _, st = _run(fast, P["tiny"], 4)                             # under MIN_PROMPT (256) tokens: never
    assert st.n_prompt_fast == 0


@pytest.mark.slow
@pytest.mark.full          # a dozen 1,100-1,600-token prompts: `make test-full`
def test_result_depends_on_the_tokens_only(engines):
    """Fresh, after a longer prompt, after a shorter one, after the same prompt with an answer
    appended (a chat turn), across a block boundary: same tokens, same log-probabilities."""
    fast, _, P = engines
    prompt = P["two_blocks"]
    fast.reset()
    ref = _run(fast, prompt)[:2]
    again = _run(fast, prompt)
    assert again[:2] == ref and again[2].n_prompt == 0              # the same prompt again: all reused
    # the same blocks, another tail (its last token): the tail is evaluated again, never reused
    other_tail = np.concatenate([prompt[:-1], prompt[-2:-1]])
    fast.reset()
    fresh = _run(fast, other_tail)[:2]
    fast.reset()
    _run(fast, prompt, 4)
    st = _run(fast, other_tail)
    assert st[:2] == fresh and st[2].n_prompt == fast.fast.n_evaluated == len(prompt) - fast_len(len(prompt))
    # after a shorter prompt (fast_len 640: a 128-token block where this one has 512), a short one (fast_len 256) and a tiny one (none)
    for other in (P["one_block"], P["short"], P["tiny"]):
        fast.reset()
        _run(fast, other, 8)
        assert _run(fast, prompt)[:2] == ref, len(other)
    # a chat turn: the prompt plus its answer plus a follow-up crosses from 1100 to 1100+24+n
    fast.reset()
    assert not fast.fast.tokens                                     # reset forgets the fast blocks too
    toks, _, _ = _run(fast, prompt)
    follow = np.concatenate([prompt, np.asarray(toks, np.int32), fast.tokenize("\nAgain:", add_special=False)])
    incremental = _run(fast, follow)[:2]
    fast.reset()
    fast.fast.close()                                               # nothing held anywhere
    assert _run(fast, follow)[:2] == incremental
    # growing: 1030 -> 1619 tokens reuses the first 2 blocks of the fast context; 1100 -> 1619 too, and
    # evaluates [1024, 1088) again as part of a 512-token block
    long = np.concatenate([prompt, prompt[1:520]])
    assert fast_blocks(fast_len(len(long)))[2] == (1024, 512)
    fast.reset()
    fast.fast.close()
    ref = _run(fast, long)[:2]
    for first in (1030, 1100):
        fast.reset()
        _run(fast, long[:first], 4)
        assert _run(fast, long)[:2] == ref, first
        assert fast.fast.n_evaluated == len(long) - 1024       # the blocks from 1024, and the tail


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, pytest.param(SEEDED, marks=pytest.mark.full)], ids=["greedy", "seeded"])
def test_spec_equals_none_through_the_hand_over(engines, sampling):
    """Both branches: the target as its own draft (always right at temp 0) and n-grams on a copy."""
    fast, _, P = engines
    prompt = P["copy"]
    fast.reset()
    plain = _run(fast, prompt, 40, sampling, spec=SpecParams(verify="match"))[0]
    ngram = _run(fast, prompt, 40, sampling, spec=SpecParams(types=("ngram-simple",), ngram_size_n=3,
                                                             ngram_size_m=16, verify="match"))
    assert ngram[0] == plain
    selfdraft = DraftModel(fast.target, fast.params.draft_model or fast.model.path)
    try:
        fast.reset()
        out, _, st = _run(fast, prompt, 40, sampling, spec=SpecParams(types=("draft-simple",), n_max=8,
                                                                     verify="match"), drafters=[selfdraft])
    finally:
        selfdraft.close()
    assert out == plain
    if sampling.greedy:
        assert st.drafters[0].n_acc_tokens == st.drafters[0].n_gen_tokens > 0


@pytest.mark.slow
@pytest.mark.full          # a fault path, three evaluations of the prompt: `make test-full`
def test_a_state_that_cannot_be_handed_over_falls_back(engines, monkeypatch, caplog):
    fast, slow, P = engines
    prompt = P["short"]
    want = _run(slow, prompt)[:2]
    e = Engine(fast.model.path, fast.params, model=fast.model)
    try:
        def refuse(blob, rot, k_type):
            raise KVStateError("KV cells with extensions (M-RoPE)")
        monkeypatch.setattr("specrun.kernels.prefill.quantize_k", refuse)
        with caplog.at_level(logging.WARNING, logger="specrun.kernels.engine"):
            got = _run(e, prompt)
        assert got[:2] == want and got[2].n_prompt_fast == 0 and e.fast is None
        assert [r.message for r in caplog.records].count(
            "fast prompt evaluation is off for this model: KV cells with extensions (M-RoPE)") == 1
    finally:
        e.close()


@pytest.mark.slow
@pytest.mark.full          # a fault path: `make test-full`
def test_a_twin_that_does_not_load_keeps_the_exact_weights(engines, monkeypatch, caplog):
    """The repacked second load fails (memory): one warning, the fast context runs the exact
    model's weights, and the same prompt again gives the same answer."""
    fast, _, P = engines

    def refuse(self):
        raise LlamaError("could not load this model; llama.cpp says: failed to allocate CPU_REPACK buffer")
    monkeypatch.setattr(Model, "repacked", refuse)
    e = Engine(fast.model.path, fast.params, model=fast.model)
    try:
        with caplog.at_level(logging.WARNING, logger="specrun.kernels.prefill"):
            toks, _, st = _run(e, P["short"], 8)
        assert e.fast.weights is fast.model and st.n_prompt_fast == 300 and st.fast_weights_mib == 0
        assert "repacked weights" not in st.lines()[0]
        assert sum("keeps the weights not repacked" in r.message for r in caplog.records) == 1
        e.reset()
        assert _run(e, P["short"], 8)[0] == toks
    finally:
        e.close()


@pytest.mark.slow
@pytest.mark.full     # make test: test_engine.py's cancel between chunks
def test_cancel_between_blocks_then_retry(engines):
    fast, _, P = engines
    prompt = P["block_and_more"]
    fast.reset()
    ref = _run(fast, prompt)[:2]
    fast.reset()
    fast.fast.close()
    calls = []
    gen = fast.generate(prompt, 8, GREEDY, cancel=lambda: calls.append(1) or True)
    assert _toks(gen) == [] and gen.stats.stop == "interrupted" and len(calls) == 1
    assert len(fast.fast.tokens) == BLOCK                           # the first block stays
    assert _run(fast, prompt)[:2] == ref
