"""llama.cpp's own grammar sampler (GBNF), wrapped for the verifier: one grammar state that
accepts the emitted tokens, cloned for each verify row, and asked which tokens it allows.

A GBNF that does not parse is a GrammarError with llama.cpp's reason on one line: the parser
returns NULL (it never aborts), but it prints its reason and the whole grammar with fprintf to
stderr, so that call runs with file descriptor 2 captured (under a lock) and the reason is read
back from it. What the native grammar can abort on is never reached from here: accept() takes a
token only after the grammar allowed it (llama.cpp aborts on an end-of-generation token the
grammar does not allow, and throws through C on any other token it does not allow).

JSON schemas become GBNF with llama-cpp-python's converter (a port of llama.cpp's
json-schema-to-grammar), as llama.cpp's -j/--json-schema and llama-server's json_schema do.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import re
import sys
import tempfile
import threading
from typing import Any

import llama_cpp as L
import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .llama import Model, _Heard

ROOT = "root"
MAX_NESTING = 2000   # ( ) levels a grammar may nest (see _init)

# llama_token_data {id, logit, p}: a numpy record array of these is a llama_token_data_array's data
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
assert _TOKEN_DATA.itemsize == ctypes.sizeof(L.llama_token_data)

_stderr_lock = threading.Lock()
_GRAMMAR_DOC = "llama.cpp's grammars/README.md describes GBNF"


class GrammarError(SpecrunError):
    """A grammar or JSON schema that llama.cpp cannot use; the message says why and what to fix."""


@contextlib.contextmanager
def _captured_stderr(out: list[str]):
    """Run the block with fd 2 going to a temporary file, and sys.stderr to a buffer (before a
    model is loaded, llama-cpp-python's own log callback prints there); their text is appended to
    out. Whatever else was written meanwhile (another thread's line) is written back by the caller."""
    with _stderr_lock, tempfile.TemporaryFile() as tmp:
        py_err, buf = sys.stderr, io.StringIO()
        py_err.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys.stderr = buf
            try:
                yield
            finally:
                sys.stderr = py_err
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        tmp.seek(0)
        out.append(tmp.read().decode("utf-8", errors="replace") + buf.getvalue())


def _reason(captured: str) -> str:
    """llama.cpp's reason for refusing a grammar, on one line (its parser prints the reason, then
    the grammar; init logs 'failed to parse grammar', an undefined rule or left recursion)."""
    m = re.search(r"error parsing grammar: (.*)", captured)
    if m:
        why = m.group(1).strip()
        why = re.sub(r"\s+", " ", why)
        return why[:200] + ("..." if len(why) > 200 else "")
    for pat in (r"(invalid grammar: .*)", r"(unsupported grammar, .*)", r"(grammar does not contain .*)"):
        m = re.search(pat, captured)
        if m:
            return m.group(1).strip()
    return "llama.cpp could not parse it"


def _passthrough(captured: str) -> None:
    """Lines of another origin captured with the parser's (see _captured_stderr), written back."""
    keep, skip = [], False
    for line in captured.splitlines(keepends=True):
        if "error parsing grammar" in line or "failed to parse grammar" in line or "grammar does not contain" in line \
                or "invalid grammar:" in line or "unsupported grammar," in line:
            skip = "error parsing grammar" in line   # the grammar's own text follows this line
            continue
        if not skip:
            keep.append(line)
    if keep:
        sys.stderr.write("".join(keep))


def _scan(gbnf: str) -> tuple[int, str | None]:
    """(deepest nesting of ( ) groups, the first repetition {m,n} with n < m or None), outside
    literals, character classes and comments: what llama.cpp's parser cannot survive (it recurses
    once per level, and loops without end on a repetition whose maximum is below its minimum)."""
    depth = deepest = 0
    i, n = 0, len(gbnf)
    while i < n:
        c = gbnf[i]
        if c in "\"[":                      # a literal "..." or a class [...]: skip it, escapes too
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c == "#":
            while i < n and gbnf[i] not in "\r\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        elif c == "{":
            end = gbnf.find("}", i)
            body = re.sub(r"#[^\r\n]*", "", gbnf[i + 1:end if end >= 0 else n])
            m = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", body)
            if m and int(m.group(2)) < int(m.group(1)):
                return deepest, "{" + re.sub(r"\s+", "", body) + "}"
        i += 1
    return deepest, None


def _init(vocab, gbnf: str, root: str):
    """llama_sampler_init_grammar; GrammarError (one line) when llama.cpp refuses the grammar."""
    if not gbnf.strip():
        raise GrammarError("the grammar is empty; give GBNF rules such as: root ::= \"yes\" | \"no\"")
    deep, backwards = _scan(gbnf)
    if deep > MAX_NESTING:
        # llama.cpp's parser recurses once per level: ~30,000 levels overflow an 8 MiB stack (a crash)
        raise GrammarError(f"the grammar nests ( ) groups {deep} levels deep (at most {MAX_NESTING}); flatten it, "
                           "or lower the JSON schema's maxLength / maxItems (each unit is one level)")
    if backwards:
        raise GrammarError(f"the grammar has a repetition {backwards} whose maximum is below its minimum; "
                           "write {m,n} with m <= n")
    captured: list[str] = []
    with _Heard() as heard, _captured_stderr(captured):   # heard: llama.cpp's error lines of this call
        ptr = L.llama_sampler_init_grammar(vocab, gbnf.encode("utf-8"), root.encode("utf-8"))
    # the parser's reason is on stderr; init's own (undefined rule, left recursion) is in llama.cpp's
    # log, which kernels.llama keeps once a model is loaded (before, it goes to stderr too)
    _passthrough(captured[0] if captured else "")
    text = (captured[0] if captured else "") + heard.reason()
    if not ptr:
        why = _reason(text)
        if "no vocab to parse token" in why:
            return None                      # token literals (<[id]>, <|tok|>) need a model: checked at load
        raise GrammarError(f"the grammar does not parse: {why}; fix the GBNF ({_GRAMMAR_DOC}; the rule "
                           f"'{root}' is where generation starts)")
    return ptr


def check_grammar(gbnf: str, root: str = ROOT) -> None:
    """Parse a GBNF without a model (flags and request bodies are checked before any work);
    GrammarError when it does not parse. Token literals are checked once a model is loaded."""
    ptr = _init(None, gbnf, root)
    if ptr:
        L.llama_sampler_free(ptr)


def schema_to_gbnf(schema: str | dict[str, Any], *, what: str = "the JSON schema") -> str:
    """A JSON schema (text or parsed) -> GBNF, as llama.cpp's -j / llama-server's json_schema.
    GrammarError (one line, naming `what`) when it is not JSON or the converter refuses it."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError(f"{what} is not JSON ({e}); give a schema such as '{{\"type\": \"object\"}}'") from None
    else:
        parsed = schema
    if not isinstance(parsed, dict):
        raise GrammarError(f"{what} must be a JSON object (a schema such as {{\"type\": \"object\"}}), "
                           f"not {type(parsed).__name__}")
    try:
        gbnf = json_schema_to_gbnf(json.dumps(parsed))
    except Exception as e:  # noqa: BLE001 - the converter refuses with assert, and fails on lookups and types
        why = re.sub(r"\s+", " ", str(e) or type(e).__name__)[:160]
        raise GrammarError(f"{what} cannot be turned into a grammar: {why}; use the JSON Schema subset "
                           "llama.cpp supports (type, properties, required, items, enum, const, pattern ^...$, "
                           "$ref to #/$defs, anyOf/oneOf, min/maxLength, min/maxItems)") from None
    check_grammar(gbnf)
    return gbnf


class Grammar:
    """One state of a GBNF grammar over a model's vocabulary (llama.cpp's grammar sampler).

    allowed(ids) -> bool [n]: which tokens the grammar allows next; accept(token) advances it by
    an allowed token; clone() branches it (a verify row's state), close() frees it (idempotent).
    """

    def __init__(self, model: Model, gbnf: str, root: str = ROOT, *, _ptr=None) -> None:
        self.model = model
        self._ptr = _ptr if _ptr is not None else _init(model.vocab, gbnf, root)
        if not self._ptr:   # pragma: no cover - _init raises, or returns None only without a vocab
            raise GrammarError("the grammar does not parse")
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    def clone(self) -> Grammar:
        ptr = L.llama_sampler_clone(self.ptr)
        if not ptr:
            raise GrammarError("llama_sampler_clone returned NULL for the grammar")
        return Grammar(self.model, "", _ptr=ptr)

    @property
    def ptr(self):
        if self._ptr is None:
            raise GrammarError("grammar already closed")
        return self._ptr

    def close(self) -> None:
        if getattr(self, "_ptr", None):
            L.llama_sampler_free(self._ptr)
        self._ptr = None

    __del__ = close

    def _apply(self, data: np.ndarray) -> None:
        arr = L.llama_token_data_array(data.ctypes.data_as(L.llama_token_data_p), data.shape[0], -1, False)
        L.llama_sampler_apply(self.ptr, ctypes.byref(arr))

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """ids: int [n] token ids -> bool [n], True where the grammar allows the token next
        (llama_sampler_apply leaves its logit finite). Each token is judged on its own."""
        data = np.zeros(len(ids), dtype=_TOKEN_DATA)
        data["id"] = ids
        self._apply(data)
        return data["logit"] != -np.inf

    def allows(self, token: int) -> bool:
        one = self._one
        one["id"], one["logit"] = token, 0.0
        self._apply(one)
        return bool(one["logit"][0] != -np.inf)

    def then(self, token: int) -> Grammar | None:
        """A new state: this one advanced by token; None when the grammar does not allow it here."""
        if not self.allows(token):
            return None
        g = self.clone()
        L.llama_sampler_accept(g.ptr, token)
        return g

    def accept(self, token: int) -> None:
        """Advance by one emitted token. requires: allows(token)."""
        if not self.allows(token):
            raise GrammarError(f"token {token} ({self.model.token_text(token)!r}) is not allowed by the grammar "
                               "here (an internal error: only allowed tokens are emitted)")
        L.llama_sampler_accept(self.ptr, token)
