"""GET /metrics: the server's counters in Prometheus' text format (version 0.0.4).

Speculative counters follow llama.cpp's statistics (common/speculative.cpp): a *draft* is one
proposal of k >= 1 tokens sent to the target; its tokens are *draft tokens*; those the target
agreed with are *accepted*; `position` counts acceptances at draft position i (0-based), so its
sum over positions equals the accepted tokens.
"""

from __future__ import annotations

import threading
from collections import Counter

from .slots import Job, Outcome

PREFIX = "specrun_"


class Metrics:
    """Thread-safe counters; record() is called by the slot threads, render() by /metrics."""

    def __init__(self, spec_types: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self.spec_types = spec_types        # pre-declared label values, so their counters read 0
        self.requests: Counter[str] = Counter()          # by endpoint
        self.interrupted = 0
        self.n_abandoned = 0                             # left the queue before getting a slot
        self.n_preparing = 0                             # being tokenized / rendered (a gauge)
        self.errors: Counter[str] = Counter()            # by HTTP status code
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.tokens = 0
        self.gen_seconds = 0.0
        self.target_passes = 0
        self.drafts: Counter[str] = Counter(dict.fromkeys(spec_types, 0))      # by spec type
        self.draft_tokens: Counter[str] = Counter(dict.fromkeys(spec_types, 0))
        self.accepted: Counter[str] = Counter(dict.fromkeys(spec_types, 0))
        self.accepted_pos: Counter[tuple[str, int]] = Counter()

    def record(self, job: Job, outcome: Outcome) -> None:
        st = outcome.stats
        with self._lock:
            self.requests[job.endpoint] += 1
            self.interrupted += outcome.stop_type == "interrupted"
            self.prompt_tokens += st.n_prompt
            self.prompt_seconds += st.t_prompt_s
            self.tokens += st.n_gen
            self.gen_seconds += st.t_gen_s
            self.target_passes += st.n_target_passes
            for d in st.drafters:
                self.drafts[d.spec_type] += d.n_gen_drafts
                self.draft_tokens[d.spec_type] += d.n_gen_tokens
                self.accepted[d.spec_type] += d.n_acc_tokens
                for i, n in enumerate(d.acc_per_pos):
                    self.accepted_pos[d.spec_type, i] += n

    def error(self, status: int) -> None:
        with self._lock:
            self.errors[str(status)] += 1

    def abandoned(self) -> None:
        with self._lock:
            self.n_abandoned += 1

    def preparing(self, delta: int) -> None:
        with self._lock:
            self.n_preparing += delta

    @property
    def n_finished(self) -> int:
        """Generations that ran to their end (not interrupted)."""
        with self._lock:
            return sum(self.requests.values()) - self.interrupted

    def render(self, *, slots: int, busy: int, waiting: int, queue: int, batch: tuple[int, int] | None = None) -> str:
        """batch: (steps, sequences advanced summed over them) of a batched server's decode loop."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples) -> None:
            out.append(f"# HELP {PREFIX}{name} {help_}")
            out.append(f"# TYPE {PREFIX}{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels)
                out.append(f"{PREFIX}{name}{'{' + lab + '}' if lab else ''} {value}")

        with self._lock:
            family("requests_total", "counter", "Generation requests served (streamed or not, interrupted included).",
                   [((("endpoint", e),), n) for e, n in sorted(self.requests.items())])
            family("requests_interrupted_total", "counter",
                   "Generations stopped before their end: the client went away, or the server was stopping.",
                   [((), self.interrupted)])
            family("requests_abandoned_total", "counter",
                   "Requests whose client went away while they waited for a slot (they never ran).",
                   [((), self.n_abandoned)])
            family("errors_total", "counter", "Responses with an error status (4xx, 5xx), by code.",
                   [((("code", c),), n) for c, n in sorted(self.errors.items())])
            family("prompt_tokens_total", "counter", "Prompt tokens evaluated (not reused from a slot's KV cache).",
                   [((), self.prompt_tokens)])
            family("prompt_seconds_total", "counter", "Prompt evaluation time.", [((), round(self.prompt_seconds, 6))])
            family("tokens_generated_total", "counter", "Tokens generated.", [((), self.tokens)])
            family("generation_seconds_total", "counter", "Generation time.", [((), round(self.gen_seconds, 6))])
            family("target_passes_total", "counter", "Target decodes during generation (one per verify).",
                   [((), self.target_passes)])
            family("drafts_total", "counter", "Drafts (proposals of >= 1 token) verified by the target.",
                   [((("spec_type", t),), n) for t, n in sorted(self.drafts.items())])
            family("draft_tokens_total", "counter", "Draft tokens sent to the target.",
                   [((("spec_type", t),), n) for t, n in sorted(self.draft_tokens.items())])
            family("draft_tokens_accepted_total", "counter", "Draft tokens the target accepted.",
                   [((("spec_type", t),), n) for t, n in sorted(self.accepted.items())])
            family("draft_accepted_per_position_total", "counter",
                   "Accepted draft tokens at each draft position (0-based).",
                   [((("spec_type", t), ("position", i)), n) for (t, i), n in sorted(self.accepted_pos.items())])
        family("slots", "gauge", "Slots (sequences of the batched decode, or engines sharing the model).",
               [((), slots)])
        family("slots_busy", "gauge", "Slots serving a request.", [((), busy)])
        family("requests_waiting", "gauge", "Requests waiting for a slot.", [((), waiting)])
        family("requests_preparing", "gauge", "Requests whose prompt is being tokenized or rendered.",
               [((), self.n_preparing)])
        family("queue_capacity", "gauge", "Most requests that may wait (--queue).", [((), queue)])
        if batch is not None:
            family("batch_steps_total", "counter", "Steps of the batched decode (one decode of every active slot's "
                   "rows; a prompt chunk of 64+ rows has one of its own).", [((), batch[0])])
            family("batch_sequences_total", "counter", "Slots advanced by those steps, summed (divided by the steps: "
                   "the mean batch).", [((), batch[1])])
        return "\n".join(out) + "\n"
