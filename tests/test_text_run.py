"""TextRun: the text and the tokens of a generation whose passes emit several tokens at once must be
plain decoding's (one token a pass), stop strings and turn tokens included (QA: a stop string
completed inside an accepted draft kept the draft's later tokens in `tokens` and stats.n_gen, so
usage, tokens_predicted and the stats line counted up to max_tokens)."""

from __future__ import annotations

import pytest

from specrun.cli.runtime.text import TextRun
from specrun.kernels.stats import GenStats

# token -> bytes; 5 and 6 are the two halves of "é" (0xC3 0xA9); 9 is a turn token, 0 end of generation
PIECES = {1: b"Hel", 2: b"lo", 3: b" w", 4: b"orld", 5: b"\xc3", 6: b"\xa9", 7: b"!", 8: b" ok", 9: b"<t>", 0: b""}


class FakeModel:
    def piece(self, t: int) -> bytes:
        return PIECES[t]

    def is_eog(self, t: int) -> bool:
        return t == 0


class FakeGen:
    """A Generation: chunks of tokens; closing sets stats.n_gen to what it emitted, as the engine does."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks, self.stats, self.n = chunks, GenStats(), 0

    def __iter__(self):
        for c in self.chunks:
            self.n += len(c)
            yield c
        self.stats.stop = "n_predict"

    def close(self) -> None:
        self.stats.n_gen = self.n


def complete(chunks, **kw):
    run = TextRun(FakeGen(chunks), FakeModel(), **kw)
    text = "".join(run)
    run.close()
    return text, run.result


SEQ = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]


@pytest.mark.parametrize("stops", [("wor",), ("lo w",), ("é",), ("é!",), ("\xa9",), ("orld\u00e9! o",), ("none of it",)])
@pytest.mark.parametrize("sizes", [[10], [3, 7], [2, 2, 6], [5, 5], [1, 9]])
def test_tokens_and_n_gen_end_where_plain_decoding_stops(stops, sizes):
    plain_text, plain = complete([[t] for t in SEQ], stops=stops)
    chunks, at = [], 0
    for n in sizes:
        chunks.append(SEQ[at:at + n])
        at += n
    text, got = complete(chunks, stops=stops)
    assert (text, got.text, got.stop, got.stopping_word) == (plain_text, plain.text, plain.stop, plain.stopping_word)
    assert got.tokens == plain.tokens and got.stats.n_gen == plain.stats.n_gen == len(plain.tokens)


def test_a_turn_token_inside_a_pass_ends_the_count_there():
    _, plain = complete([[t] for t in [1, 2, 9, 3, 4]], stop_tokens=frozenset({9}))
    _, got = complete([[1, 2, 9, 3, 4]], stop_tokens=frozenset({9}))
    assert got.tokens == plain.tokens == [1, 2] and got.stop == plain.stop == "turn"
    assert got.stats.n_gen == plain.stats.n_gen == 3        # the turn token was generated, not what followed
