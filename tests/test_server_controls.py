"""The server's logit controls as units, against llama-server 0.3.36 (tools/server/server-schema.cpp):
logit_bias in its two forms, with token ids or texts and `false` for never, on every endpoint, and
a 400 naming what is wrong for what llama-server would skip silently."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from specrun.cli.server.errors import ApiError
from specrun.cli.server.schemas import (
    ChatRequest,
    CompletionRequest,
    LlamaCompletionRequest,
    logit_bias_pairs,
)
from specrun.cli.server.state import ServerState

NEG = float("-inf")
ONE = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("bias, pairs", [
    ({"15043": 1.5, "7": -100}, ((15043, 1.5), (7, -100.0))),            # OpenAI's form; -100 is -100, as llama-server
    ({"15043": False}, ((15043, NEG),)),                                   # false: never
    ({" 12": 2, "+3": 1, "-4": 1}, ((12, 2.0), (3, 1.0), (-4, 1.0))),      # strtol's reading: whitespace, a sign
    ({"Hello": 1, "12a": 1, "12 ": 1, "0x10": 1}, (("Hello", 1.0), ("12a", 1.0), ("12 ", 1.0), ("0x10", 1.0))),
    ([[15043, 1.5], [" Hello", False], [3, 250]], ((15043, 1.5), (" Hello", NEG), (3, 250.0))),  # no -100..100 bound
    ({}, ()),
    ([], ()),
])
def test_logit_bias_forms(bias, pairs):
    assert logit_bias_pairs(bias) == pairs
    for req in (CompletionRequest, LlamaCompletionRequest):
        assert req.model_validate_json(json.dumps({"prompt": "x", "logit_bias": bias})).bias_pairs() == pairs
    assert ChatRequest.model_validate_json(json.dumps({"messages": ONE, "logit_bias": bias})).bias_pairs() == pairs


@pytest.mark.parametrize("bias, words", [
    ({"15": True}, 'logit_bias["15"]: the bias true is not a finite number or false (never)'),
    ({"15": None}, 'logit_bias["15"]: the bias null is not a finite number or false'),
    ({"15": "1"}, 'logit_bias["15"]: the bias "1" is not a finite number'),
    ({"": 1}, 'logit_bias[""]: "" is not a token id or a non-empty text'),
    ([[15]], "logit_bias[0]: [15] is not a [token, bias] pair; give {"),
    ([[15, 1, 2]], "logit_bias[0]: [15, 1, 2] is not a [token, bias] pair"),
    ([15, 1], "logit_bias[0]: 15 is not a [token, bias] pair"),
    ([[1.5, 1]], "logit_bias[0]: 1.5 is not a token id or a non-empty text"),
    ([[True, 1]], "logit_bias[0]: true is not a token id"),
    ([["", 1]], 'logit_bias[0]: "" is not a token id'),
    ([[3, True]], "logit_bias[0]: the bias true is not a finite number"),
    (15, "logit_bias must be an object or an array: {"),
    ("15+1", "logit_bias must be an object or an array"),
])
def test_what_llama_server_skips_is_a_400_naming_it(bias, words):
    for body in ({"prompt": "x", "logit_bias": bias}, {"messages": ONE, "logit_bias": bias}):
        req = LlamaCompletionRequest if "prompt" in body else ChatRequest
        with pytest.raises(ValidationError) as e:
            req.model_validate_json(json.dumps(body))
        assert words in str(e.value), str(e.value)


def test_infinite_and_nan_biases_are_refused():
    """Python's JSON reader takes Infinity and NaN, which JSON does not have: a 400, never a ban."""
    for raw in ('{"15": -Infinity}', '{"15": NaN}', '[[15, Infinity]]'):
        with pytest.raises(ValidationError, match="is not a finite number or false"):
            LlamaCompletionRequest.model_validate({"prompt": "x", "logit_bias": json.loads(raw)})


def test_text_biases_go_to_each_of_their_tokens(smollm_path):
    """A text is tokenized as llama-server's common_tokenize(vocab, text, false): no BOS, special
    tokens not parsed (so "<|im_end|>" is plain text, several tokens); each token gets the bias, in
    order, beside the ids given (repeats add up in the sampler, as llama.cpp's logit-bias sampler)."""
    from specrun.kernels.llama import Model

    m = Model(smollm_path)
    try:
        state = SimpleNamespace(model=m)
        hello = m.tokenize(" Hello world", add_special=False, parse_special=False).tolist()
        assert len(hello) == 2 and m.bos not in hello
        got = ServerState.bias_tokens(state, ((" Hello world", -2.0), (5, NEG)))
        assert got == tuple((t, -2.0) for t in hello) + ((5, NEG),)
        special = m.tokenize("<|im_end|>", add_special=False, parse_special=True).tolist()
        plain = ServerState.bias_tokens(state, (("<|im_end|>", NEG),))
        assert len(special) == 1 and len(plain) > 1 and special[0] not in [t for t, _ in plain]
        for key, words in [(m.n_vocab, f"token id {m.n_vocab} is out of the vocabulary (0..{m.n_vocab - 1})"),
                           (-4, "token id -4 is out of the vocabulary")]:
            with pytest.raises(ApiError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
                ServerState.bias_tokens(state, ((key, 1.0),))
            assert e.value.status == 400 and e.value.code == "invalid_value"
    finally:
        m.close()
