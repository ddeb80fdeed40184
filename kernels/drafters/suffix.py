"""The `suffix` drafter: suffix decoding (arXiv 2411.04975), as Snowflake's ArcticInference runs it
for vLLM (method "suffix") and SGLang (SUFFIX). specrun's own type: llama.cpp has none.

No model. Two stores of token sequences are matched against the end of the text:
- the request's own (ArcticInference's per-request tree): its prompt and its output so far;
- the global one (its global tree): what earlier and concurrent requests generated, shared by
  every suffix drafter of the process over the same model file and settings (a server's slots
  and requests, chat's turns), the last --spec-suffix-max-cached-requests of them (the least
  recently grown one leaves first), loaded from and saved to --spec-suffix-cache FILE.
Deterministic (Draft.probs is None); the best single path is drafted (no tree verify).

A store is not a tree here but the same counts read another way: its sequences lie in one int32
buffer, each after a -1, with the ascending positions of every token id (postings). The node of a
text P in ArcticInference's depth-bounded suffix tree counts P's occurrences; here those are the
positions where P ends, found by filtering the last token's postings one token further back per
step (numpy). Appending a token is one postings append, so a store costs 8 bytes a token.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import zipfile
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.output import writing

from ..params import SpecParams, SuffixParams
from ..types import Draft, DraftOptions, TargetPass
from .base import TargetView

log = logging.getLogger(__name__)

FORMAT = "specrun-suffix-cache"
VERSION = 1
# tokenized with the model when a cache file is written and read: a cache made with another
# tokenizer would draft nonsense, so it is refused
FINGERPRINT_TEXT = "The quick brown fox: {\"id\": 42, \"ok\": true}\n\tdef f(x):\n    return x * 2  # ok\u00e9"
_SEP = -1          # before every sequence, in free space and over evicted ones
_MIN_CAP = 64      # a sequence's first room in the buffer (tokens)
_DEFAULTS = SuffixParams()


@dataclass(frozen=True, slots=True)
class Candidate:
    """A store's best draft: tokens int32 [k], score = the sum of their estimated probabilities,
    match = the length of the matched text it continues (0: no draft)."""

    tokens: np.ndarray
    score: float = 0.0
    match: int = 0


_NONE = Candidate(np.zeros(0, dtype=np.int32))


class _Seq:
    __slots__ = ("start", "n", "cap")

    def __init__(self, start: int, n: int, cap: int) -> None:
        self.start, self.n, self.cap = start, n, cap


class TokenStore:
    """Token sequences in one buffer, and where every token id occurs.

    buf: int32 [size]; position 0 and every position outside a sequence hold -1, and each sequence
    has at least one -1 before and after it, so no match crosses from one sequence into another and
    a sequence's last token has nothing after it. A sequence grows in place while it has room, and
    moves to the end (its room doubled) when another one lies after it. Postings keep positions
    that went stale (a moved or removed sequence's): readers check buf at them, and the store
    is laid out again once the stale ones outnumber the live tokens.

    Not thread-safe: GlobalStore holds a lock around it.
    """

    def __init__(self) -> None:
        self.buf = np.full(1024, _SEP, dtype=np.int32)
        self.end = 1                              # positions in use: [0, end); buf[end:] is free
        self.seqs: OrderedDict[int, _Seq] = OrderedDict()   # id -> region, least recently grown first
        self._post: dict[int, array] = {}         # token id -> ascending positions (some stale)
        self._next_id = 0
        self.n_live = 0                           # tokens in sequences
        self.n_stale = 0                          # postings entries that no longer hold their token

    # -- writing -------------------------------------------------------------------------------
    def new(self) -> int:
        """A new, empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self.seqs[sid] = _Seq(self.end + 1, 0, 0)   # after the -1 that ends the last one
        return sid

    def extend(self, sid: int, tokens: np.ndarray) -> None:
        """Append tokens (int32 [k], each >= 0) to sequence sid."""
        k = int(tokens.shape[0])
        if k == 0:
            return
        s = self.seqs[sid]
        self.seqs.move_to_end(sid)
        if s.n + k > s.cap:
            if s.start + s.cap + 1 >= self.end:        # the last one: grow in place
                s.cap = max(2 * (s.n + k), _MIN_CAP)
                self._reserve(s.start + s.cap + 1)
                self.end = s.start + s.cap + 1
            else:                                       # move it to the end, with room
                old = self.buf[s.start:s.start + s.n].copy()
                self.buf[s.start:s.start + s.n] = _SEP
                self.n_stale += s.n
                cap = max(2 * (s.n + k), _MIN_CAP)
                start = self.end + 1
                self._reserve(start + cap + 1)
                self.end = start + cap + 1
                s.start, s.cap = start, cap
                self.buf[start:start + s.n] = old
                self._index(start, old)
        pos = s.start + s.n
        self.buf[pos:pos + k] = tokens
        self._index(pos, tokens)
        s.n += k
        self.n_live += k
        self._maybe_compact()

    def truncate(self, sid: int, n: int) -> None:
        """Keep the first n tokens of sequence sid."""
        s = self.seqs[sid]
        if n >= s.n:
            return
        for p in range(s.start + s.n - 1, s.start + n - 1, -1):
            post = self._post.get(int(self.buf[p]))
            if post and post[-1] == p:
                post.pop()
            else:
                self.n_stale += 1
        self.buf[s.start + n:s.start + s.n] = _SEP
        self.n_live -= s.n - n
        s.n = n

    def remove(self, sid: int) -> None:
        """Forget sequence sid (its postings go stale)."""
        s = self.seqs.pop(sid)
        self.buf[s.start:s.start + s.n] = _SEP
        self.n_live -= s.n
        self.n_stale += s.n
        self._maybe_compact()

    def tokens(self, sid: int) -> np.ndarray:
        """Sequence sid's tokens: int32 [n], a view valid until the next change."""
        s = self.seqs[sid]
        return self.buf[s.start:s.start + s.n]

    def _reserve(self, size: int) -> None:
        if size + 1 > self.buf.shape[0]:
            buf = np.full(max(2 * self.buf.shape[0], size + 1), _SEP, dtype=np.int32)
            buf[:self.end] = self.buf[:self.end]
            self.buf = buf

    def _index(self, pos: int, tokens: np.ndarray) -> None:
        post = self._post
        for i, t in enumerate(tokens.tolist(), pos):
            a = post.get(t)
            if a is None:
                post[t] = a = array("i")
            a.append(i)

    def _maybe_compact(self) -> None:
        if self.n_stale > max(self.n_live, 1 << 16):
            self.compact()

    def compact(self) -> None:
        """Lay the sequences out again back to back (least recently grown first), no room to spare,
        and rebuild the postings without stale positions."""
        total = sum(s.n + 1 for s in self.seqs.values()) + 2
        buf = np.full(max(total + 1, 1024), _SEP, dtype=np.int32)
        pos = 1
        for s in self.seqs.values():
            buf[pos + 1:pos + 1 + s.n] = self.buf[s.start:s.start + s.n]
            s.start, s.cap = pos + 1, s.n
            pos += s.n + 1
        self.buf, self.end = buf, pos + 1
        where = np.flatnonzero(buf[:self.end] >= 0)                   # [n_live]
        toks = buf[where]
        order = np.argsort(toks, kind="stable")
        toks, where = toks[order], where[order].astype(np.int32)
        cuts = np.flatnonzero(np.diff(toks)) + 1
        self._post = {}
        for t, chunk in zip(toks[np.r_[0, cuts]].tolist() if toks.size else [],
                            np.split(where, cuts), strict=True):
            a = array("i")
            a.frombytes(chunk.tobytes())
            self._post[t] = a
        self.n_stale = 0

    # -- reading -------------------------------------------------------------------------------
    def ends(self, token: int) -> np.ndarray:
        """Every position that holds token: int64 [n], ascending."""
        a = self._post.get(token)
        if a is None:
            return np.zeros(0, dtype=np.int64)
        pos = np.frombuffer(a, dtype=np.int32).astype(np.int64)   # a copy: `a` may grow again
        return pos[self.buf[pos] == token]

    def speculate(self, pattern: np.ndarray, n_max: int, p: SuffixParams, floor: float = 0.0) -> Candidate:
        """The best path after the longest suffixes of pattern (int32 [m0], m0 <= max_depth) whose
        score is above floor (Suffix's class docstring has the rule); _NONE when there is none."""
        buf = self.buf
        m0 = int(pattern.shape[0])
        chain = [self.ends(int(pattern[-1]))]                  # chain[m - 1]: where pattern[-m:] ends
        while chain[-1].size and len(chain) < m0:
            m = len(chain) + 1
            e = chain[-1]
            if e.size == 1 and buf[e[0] + 1] < 0:               # only the text's own end: nothing follows
                break
            chain.append(e[buf[e - (m - 1)] == pattern[-m]])
        if not chain[-1].size:
            chain.pop()
        caps = [(min(n_max, int(m * p.max_spec_factor + 1e-6), p.max_depth - m), m) for m in range(1, len(chain) + 1)]
        best, best_m = _NONE, 0
        best_score = floor
        for cap, m in sorted(caps, reverse=True):              # the longest possible drafts first, to prune
            if cap <= 0 or cap < best_score or (cap == best_score and (best_m == 0 or m < best_m)):
                continue
            tokens, score = self._path(chain[m - 1], cap, p.min_token_prob, best_score)
            if score > best_score or (score == best_score and best_m and m > best_m):
                best, best_m, best_score = Candidate(tokens, score, m), m, score
        return best

    def _path(self, ends: np.ndarray, cap: int, min_prob: float, beat: float = 0.0) -> tuple[np.ndarray, float]:
        """Up to cap tokens after the occurrences ending at `ends` (int64 [n], n >= 1): each the
        most frequent next token (ties: the latest occurrence's), while the running probability
        stays >= min_prob. Returns (tokens int32 [k], the sum of their probabilities). Stops early,
        with what it has, once even cap tokens at the running probability cannot reach `beat`."""
        buf = self.buf
        out: list[int] = []
        prob, score = 1.0, 0.0
        cur = ends
        while len(out) < cap:
            if score + prob * (cap - len(out)) < beat:         # cannot win: stop here
                break
            n = cur.size
            if n == 1:                                         # one occurrence: a plain copy
                p0 = int(cur[0]) + 1
                run = buf[p0:p0 + cap - len(out)]
                stop = np.flatnonzero(run < 0)
                run = run[:stop[0]] if stop.size else run
                out.extend(run.tolist())
                score += prob * run.size
                break
            nxt = buf[cur + 1]                                 # [n]: what follows each occurrence
            live = nxt[nxt >= 0]
            if live.size == 0:
                break
            if (live == live[0]).all():                        # one continuation (a repeated text)
                c, cnt = int(live[0]), live.size
            else:
                vals, counts = np.unique(live, return_counts=True)
                top = np.flatnonzero(counts == counts.max())
                if top.size == 1:
                    c = int(vals[top[0]])
                else:                                          # the latest occurrence's token
                    last = max(int(cur[nxt == vals[i]].max()) for i in top)
                    c = int(buf[last + 1])
                cnt = int(counts[np.searchsorted(vals, c)])
            if prob * cnt / n < min_prob:
                break
            prob = prob * cnt / n
            out.append(c)
            score += prob
            cur = cur[nxt == c] + 1
        return np.asarray(out, dtype=np.int32), score


def fingerprint(model) -> np.ndarray:
    """int32 [k]: how the model tokenizes FINGERPRINT_TEXT (a cache file's tokenizer check)."""
    return np.asarray(model.tokenize(FINGERPRINT_TEXT, add_special=False), dtype=np.int32)


class GlobalStore:
    """The global tree: the outputs of a process's requests over one model file, shared by every
    suffix drafter made with the same settings (shared_store), thread-safe. At most max_requests
    sequences; the least recently grown one is evicted to make room for a new one."""

    def __init__(self, max_requests: int, n_vocab: int, fp: np.ndarray | None = None) -> None:
        self.max_requests = max_requests
        self.n_vocab = n_vocab
        self.fingerprint = fp if fp is not None else np.zeros(0, dtype=np.int32)
        self.store = TokenStore()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.store.seqs)

    def add(self, sid: int | None, tokens: np.ndarray) -> int:
        """Append a request's new output tokens (int32 [k]) to its sequence sid (None, or one evicted
        since: a new one). Returns the sequence's id."""
        with self.lock:
            st = self.store
            if sid is None or sid not in st.seqs:
                while len(st.seqs) >= self.max_requests:
                    st.remove(next(iter(st.seqs)))
                sid = st.new()
            st.extend(sid, tokens)
            return sid

    def speculate(self, pattern: np.ndarray, n_max: int, p: SuffixParams, floor: float) -> Candidate:
        with self.lock:
            return self.store.speculate(pattern, n_max, p, floor)

    def sequences(self) -> list[np.ndarray]:
        """Every sequence's tokens (copies), least recently grown first."""
        with self.lock:
            return [self.store.tokens(sid).copy() for sid in self.store.seqs]

    # -- the file ------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the sequences to path (a .npz: format, version, n_vocab, the tokenizer's
        fingerprint, lengths int64 [n], tokens int32 [sum]) through a temporary file."""
        seqs = self.sequences()
        lengths = np.asarray([s.shape[0] for s in seqs], dtype=np.int64)
        tokens = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int32)
        with writing(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, format=np.asarray(FORMAT), version=np.asarray(VERSION), n_vocab=np.asarray(self.n_vocab),
                     fingerprint=self.fingerprint, lengths=lengths, tokens=tokens)

    def load(self, path: str | os.PathLike) -> None:
        """Add the sequences of a file save() wrote (the last max_requests of them). SpecrunError
        (one line, with the fix) for a file that is not one, or was made with another tokenizer."""
        lengths, tokens = read_cache(path, self.n_vocab, self.fingerprint)
        seqs = np.split(tokens, np.cumsum(lengths)[:-1]) if lengths.size else []
        for s in seqs[max(0, len(seqs) - self.max_requests):]:
            if s.size:
                self.add(None, s)


def _bad(path, why: str) -> SpecrunError:
    return SpecrunError(f"{path}: not a specrun suffix cache ({why}); delete it, or give --spec-suffix-cache "
                        "another file")


def read_cache(path: str | os.PathLike, n_vocab: int | None = None,
               fp: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A cache file's (lengths int64 [n], tokens int32 [sum]), checked: its format, and (when
    given) the model's vocabulary size and tokenizer fingerprint. SpecrunError for a bad file."""
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = {"format", "version", "n_vocab", "fingerprint", "lengths", "tokens"} - set(z.files)
            if missing:
                raise _bad(path, f"no {', '.join(sorted(missing))}")
            if str(z["format"]) != FORMAT:
                raise _bad(path, f"its format is {str(z['format'])!r}")
            if int(z["version"]) != VERSION:
                raise _bad(path, f"version {int(z['version'])}, this specrun reads {VERSION}")
            lengths, tokens = z["lengths"].astype(np.int64), z["tokens"]
            made_vocab, made_fp = int(z["n_vocab"]), z["fingerprint"]
    except SpecrunError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, TypeError, AttributeError) as e:
        raise _bad(path, str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if tokens.dtype != np.int32 or tokens.ndim != 1 or lengths.ndim != 1 or (lengths < 0).any() \
            or int(lengths.sum()) != tokens.shape[0]:
        raise _bad(path, "its lengths and tokens do not agree")
    if tokens.size and (int(tokens.min()) < 0 or (n_vocab is not None and int(tokens.max()) >= n_vocab)):
        raise _bad(path, "a token id outside the vocabulary")
    if n_vocab is not None and (made_vocab != n_vocab or (fp is not None and not np.array_equal(made_fp, fp))):
        why = (f"n_vocab {made_vocab}, this model's {n_vocab}" if made_vocab != n_vocab
               else "it tokenizes a test text differently")
        raise SpecrunError(f"{path}: this suffix cache was made with another tokenizer ({why}); give "
                           "--spec-suffix-cache another file for this model")
    return lengths, tokens


# -- the process's global stores -----------------------------------------------------------------
_STORES: dict[tuple, GlobalStore] = {}
_STORES_LOCK = threading.Lock()
_SAVED: dict[str, GlobalStore] = {}     # cache file -> its store, saved at exit


def shared_store(target: TargetView | None, p: SuffixParams) -> GlobalStore | None:
    """The global store of a model and settings (None: max_cached_requests 0, or no model): made once
    per process, its file (p.cache_file) loaded then and saved at exit."""
    if p.max_cached_requests == 0 or target is None:
        return None
    model = target.model
    cache = os.path.realpath(p.cache_file) if p.cache_file else None
    key = (os.path.realpath(model.path), p.max_cached_requests, cache)
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is not None:
            return store
        if cache is not None and cache in _SAVED:
            raise SpecrunError(f"--spec-suffix-cache {p.cache_file}: already the cache of another model or "
                               "setting in this process; give each its own file")
        store = GlobalStore(p.max_cached_requests, model.n_vocab, fingerprint(model) if cache else None)
        if cache is not None:
            if Path(cache).exists():
                store.load(cache)
                log.info("suffix cache %s: %d requests loaded", p.cache_file, len(store))
            _SAVED[cache] = store
        _STORES[key] = store
        return store


@atexit.register
def save_all() -> None:
    """Write every global store that has a file (at exit; a failure is logged, not raised)."""
    with _STORES_LOCK:
        saved = list(_SAVED.items())
    for path, store in saved:
        try:
            store.save(path)
            log.info("suffix cache %s: %d requests saved", path, len(store))
        except (SpecrunError, OSError) as e:
            log.warning("suffix cache %s not saved: %s", path, e)


@contextmanager
def private_stores() -> Iterator[None]:
    """Forget the process's global stores on entry and exit (tests, one measurement each); files
    are not read again or written for them."""
    with _STORES_LOCK:
        _STORES.clear()
        _SAVED.clear()
    try:
        yield
    finally:
        with _STORES_LOCK:
            _STORES.clear()
            _SAVED.clear()


class Suffix:
    """Suffix decoding's draft (ArcticInference's SuffixTree.speculate on a path, no tree); ctx =
    prompt + output, ending with id_last; D = max_depth, f = max_spec_factor, p_min = min_token_prob.

    1. pattern = the last min(D, len(ctx)) tokens of ctx.
    2. For each match length m whose text P = pattern[-m:] occurs in a store: count(P) = its
       occurrences there (the text's own latest one included: nothing follows it yet). The path
       from P takes, token by token, the c that most often follows (ties: the one after the latest
       occurrence), its probability prob *= count(P + c) / count(P), P = P + c, and stops before
       a token with prob < p_min, when nothing follows, or after min(n_max, floor(m * f), D - m)
       tokens (the tree's depth bounds a match and its draft together). Its score = the sum of
       its tokens' probabilities.
    3. The draft is the path with the highest score over every m in the request's own store, then
       in the global one, which must score higher still (ties: the longer match, the own store).

    Example, D = 8, f = 1, p_min = 0.1, own store = ctx = [a, b, c, d, x, a, b, c, e, y, a, b, c]:
    [a, b, c] occurs 3 times (twice followed: by d, by e; the third is ctx's end). m = 3: count 3,
    d and e tie at 1 and e follows the latest, so prob 1/3 for e, then y (1/3, a copy of the
    one occurrence's next tokens), cut at min(n_max, 3, 5) = 3 tokens: [e, y, a], score 1. m = 2
    ([b, c]) and m = 1 ([c]) give the same tokens cut at 2 and 1 (scores 2/3 and 1/3); [y, a, b, c]
    (m = 4) and longer occur only at ctx's end, where nothing follows. Draft: [e, y, a].

    begin() starts a request: its own store follows the new prompt (kept where the prompt extends
    the last text: chat's turns), and its output goes to a new sequence of the global store,
    token by token as propose() sees it.
    """

    spec_type: ClassVar[str] = "suffix"
    needs_hidden: ClassVar[bool] = False

    def __init__(self, params: SuffixParams = _DEFAULTS, store: GlobalStore | None = None) -> None:
        if params.max_depth < 2 or params.max_spec_factor <= 0 or not 0 <= params.min_token_prob <= 1 \
                or params.max_cached_requests < 0:
            raise ValueError(f"suffix needs max_depth >= 2, max_spec_factor > 0, 0 <= min_token_prob <= 1 and "
                             f"max_cached_requests >= 0 (got {params})")
        self.params = params
        self.store = store
        self._own = TokenStore()
        self._text = self._own.new()       # the request's text in its own store
        self._n_prompt = 0
        self._seq: int | None = None       # the request's output in the global store
        self._n_added = 0                  # output tokens given to it
        self.last_source = ""              # "own" | "global" | "": where the last draft came from

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> Suffix:
        """A drafter with spec's settings and the process's global store for its model (what
        drafters.make_drafter calls)."""
        return cls(spec.suffix, shared_store(target, spec.suffix))

    def begin(self, prompt: np.ndarray, n_keep: int = 0, opts: DraftOptions | None = None) -> int:
        """A new request (see the class docstring). No model state: any KV reuse suits it."""
        prompt = np.asarray(prompt, dtype=np.int32)
        self._sync(prompt)
        self._n_prompt = prompt.shape[0]
        self._seq, self._n_added = None, 0
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        """ctx: int32 [L] = prompt + output so far, ending with id_last. Returns 0..n_max tokens."""
        ctx = np.asarray(ctx, dtype=np.int32)
        self._sync(ctx)
        if self.store is not None:
            out = ctx[self._n_prompt:]
            if out.shape[0] < self._n_added:               # not this request's text: a new sequence
                self._seq, self._n_added = None, 0
            if out.shape[0] > self._n_added:
                self._seq = self.store.add(self._seq, out[self._n_added:])
                self._n_added = out.shape[0]
        self.last_source = ""
        if n_max <= 0 or ctx.shape[0] == 0:
            return Draft.empty()
        p = self.params
        pattern = ctx[-p.max_depth:]
        best = self._own.speculate(pattern, n_max, p)
        self.last_source = "own" if best.match else ""
        if self.store is not None:
            other = self.store.speculate(pattern, n_max, p, best.score)
            if other.match:
                best, self.last_source = other, "global"
        return Draft(best.tokens, None, self.last_source) if best.match else Draft.empty()

    def accept(self, tp: TargetPass) -> None:
        """Nothing to roll back: the text arrives with the next propose()."""

    def close(self) -> None:
        """No native resources; the global store outlives the drafter."""

    def _sync(self, ctx: np.ndarray) -> None:
        """The own store's text := ctx (kept up to the common prefix, the rest appended)."""
        seen = self._own.tokens(self._text)
        n = seen.shape[0]
        if ctx.shape[0] >= n and np.array_equal(ctx[:n], seen):
            keep = n
        else:
            diff = np.flatnonzero(ctx[:min(n, ctx.shape[0])] != seen[:min(n, ctx.shape[0])])
            keep = int(diff[0]) if diff.size else min(n, ctx.shape[0])
            self._own.truncate(self._text, keep)
        if ctx.shape[0] > keep:
            self._own.extend(self._text, ctx[keep:])
