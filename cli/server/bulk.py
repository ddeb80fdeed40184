"""Work on millions of items (token ids, pieces of an answer) in steps, off the event loop.

A worker thread that runs one C call (set(ids), list.tolist(), b"".join, freeing a list of
millions of ints) holds the GIL until the call returns, and so keeps the event loop's thread
from running for as long. These helpers cut such work into steps of STEP items: the loop gets
the GIL between two steps. PartsResponse sends a large answer in its parts, never joined.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from starlette.responses import Response

STEP = 1 << 15   # items per C call
JSON_STEP = 1 << 12   # items of a long list per json.dumps call (json_value: its items may be lists)
TEXT_STEP = 1 << 18   # characters of a long text per C call


def as_list(a: np.ndarray) -> list[int]:
    """a.tolist(), a step at a time."""
    out: list[int] = []
    for i in range(0, len(a), STEP):
        out += a[i:i + STEP].tolist()
    return out


def distinct(ids: Sequence[int]) -> set[int]:
    """set(ids), a step at a time."""
    out: set[int] = set()
    for i in range(0, len(ids), STEP):
        out.update(ids[i:i + STEP])
    return out


def release(items: list) -> None:
    """Empty items from its end, a step at a time (freeing millions of objects is one long C call)."""
    while items:
        del items[-STEP:]


def text(ids: Sequence[int], piece: Callable[[int], bytes]) -> str:
    """The UTF-8 text of the pieces of ids (bytes that are not UTF-8 as U+FFFD), each distinct id's
    piece asked once."""
    pieces = {t: piece(t) for t in distinct(ids)}
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    parts = [decoder.decode(b"".join(map(pieces.__getitem__, ids[i:i + STEP]))) for i in range(0, len(ids), STEP)]
    parts.append(decoder.decode(b"", final=True))
    return "".join(parts)


def json_array(entries: Sequence[int], entry: Callable[[int], str]) -> list[bytes]:
    """The JSON array of entry(x) for x in entries (each distinct x's entry made once), in parts."""
    made = {x: entry(x) for x in distinct(entries)}
    parts = [",".join(map(made.__getitem__, entries[i:i + STEP])).encode() for i in range(0, len(entries), STEP)]
    out = [b"["]
    for i, p in enumerate(parts):
        out += [b",", p] if i else [p]
    return [*out, b"]"]


def json_string(s: str) -> list[bytes]:
    """json.dumps(s, ensure_ascii=False) in UTF-8 (JSONResponse's bytes), in parts."""
    return [b'"', *(json.dumps(s[i:i + TEXT_STEP], ensure_ascii=False)[1:-1].encode()
                    for i in range(0, len(s), TEXT_STEP)), b'"']


def _dumps(v: Any) -> bytes:
    """JSONResponse's bytes for v."""
    return json.dumps(v, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def json_value(v: Any) -> list[bytes]:
    """JSONResponse's bytes for v (plain JSON values), in parts: each value of a dict, each item of
    a short list of containers (choices), and a long list JSON_STEP items at a time are encoded
    by a call of their own, so that no one call holds the GIL over a huge answer (a logit_bias
    of 262,144 pairs echoed in generation_settings)."""
    if isinstance(v, dict):
        out = [b"{"]
        for i, (k, x) in enumerate(v.items()):
            out += [b"," if i else b"", _dumps(str(k)) + b":", *json_value(x)]
        return [*out, b"}"]
    if isinstance(v, list | tuple) and len(v) <= 64 and any(isinstance(x, dict | list | tuple) for x in v):
        out = [b"["]
        for i, x in enumerate(v):
            out += [b"," if i else b"", *json_value(x)]
        return [*out, b"]"]
    if isinstance(v, list | tuple) and len(v) > JSON_STEP:
        out = [b"["]
        for i in range(0, len(v), JSON_STEP):
            out += [b"," if i else b"", _dumps(list(v[i:i + JSON_STEP]))[1:-1]]
        return [*out, b"]"]
    return [_dumps(v)]


class PartsResponse(Response):
    """A response whose body is given in parts, sent one by one with its Content-Length (one join
    of tens of megabytes would be one long C call)."""

    def __init__(self, parts: Iterable[bytes], media_type: str = "application/json") -> None:
        self.parts = [p for p in parts if p]
        super().__init__(media_type=media_type)
        self.headers["content-length"] = str(sum(map(len, self.parts)))

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for i, p in enumerate(self.parts):
            await send({"type": "http.response.body", "body": p, "more_body": i < len(self.parts) - 1})
        if not self.parts:
            await send({"type": "http.response.body", "body": b""})
