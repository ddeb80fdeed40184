"""Statistics of a generation, named as llama.cpp names them (common/speculative.cpp)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class DrafterStats:
    """Per spec type. A *draft* is one proposal (k >= 1 tokens) sent to the target.

    n_call_draft:  times the drafter was asked for a draft
    n_gen_drafts:  drafts it produced (non-empty)     n_acc_drafts: drafts with >= 1 token accepted
    n_gen_tokens:  draft tokens produced              n_acc_tokens: draft tokens accepted
    acc_per_pos[i]: how often draft position i (0-based) was accepted
    """

    spec_type: str
    n_call_draft: int = 0
    n_gen_drafts: int = 0
    n_acc_drafts: int = 0
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0
    acc_per_pos: list[int] = field(default_factory=list)
    t_draft_s: float = 0.0

    @property
    def t_per_call(self) -> float:
        """Seconds a call for a draft took, on average (0 before any)."""
        return self.t_draft_s / self.n_call_draft if self.n_call_draft else 0.0

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.n_gen_drafts += 1
        self.n_gen_tokens += n_drafted
        self.n_acc_tokens += n_accepted
        self.n_acc_drafts += n_accepted > 0
        if len(self.acc_per_pos) < n_drafted:
            self.acc_per_pos.extend([0] * (n_drafted - len(self.acc_per_pos)))
        for i in range(n_accepted):
            self.acc_per_pos[i] += 1

    @property
    def mean_acc_len(self) -> float:
        """1 + accepted tokens per verified draft (llama.cpp's `#mean acc len`)."""
        return 1.0 + self.n_acc_tokens / self.n_gen_drafts if self.n_gen_drafts else 0.0

    @property
    def acc_rate_per_pos(self) -> list[float]:
        return [n / self.n_gen_drafts for n in self.acc_per_pos] if self.n_gen_drafts else []


@dataclass(slots=True)
class GenStats:
    n_prompt: int = 0            # prompt tokens evaluated by the target (not reused from the KV cache)
    n_prompt_total: int = 0      # prompt tokens, reused or not
    n_prompt_fast: int = 0       # of n_prompt, those the fast prompt context evaluated (kernels/prefill.py)
    fast_kv_mib: float = 0.0     # the fast prompt context's KV cache, when it was used
    fast_weights_mib: float = 0.0  # ...and its repacked copy of the weights (0: it runs the exact ones)
    fast_process_mib: float = 0.0  # ...and the private memory of the child process it runs in (0: this one)
    n_gen: int = 0               # tokens emitted
    n_target_passes: int = 0     # target decodes during generation (one per verify)
    n_restores: int = 0          # hybrid models: partial accepts past the snapshots, undone by a
                                 # checkpoint restore and replayed in front of the next pass
    t_prompt_s: float = 0.0
    t_gen_s: float = 0.0
    stop: str = ""               # "eog" | "n_predict" | "ctx" | "interrupted" | "stop"
    exact: bool | None = None    # exact mode (verify logits bit-identical to one-token decoding)
    exact_caveat: str | None = None   # why exact mode may not be bit-exact for this model
    verify: str = "match"
    seed: int = 0                # the seed actually used (a random one when none was given)
    drafters: list[DrafterStats] = field(default_factory=list)

    @property
    def n_drafted(self) -> int:
        return sum(d.n_gen_tokens for d in self.drafters)

    @property
    def n_accepted(self) -> int:
        return sum(d.n_acc_tokens for d in self.drafters)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.t_prompt_s if self.t_prompt_s > 0 else 0.0

    @property
    def n_gen_steps(self) -> int:
        """Tokens the generation's passes made: n_gen less the first, which comes from the prompt's
        logits (llama-server's n_gen_steps(): its predicted_per_second counts these, over the time
        from the first token to the last)."""
        return max(self.n_gen - 1, 0)

    @property
    def gen_tps(self) -> float:
        """Generation tokens/s as llama-server's predicted_per_second: n_gen_steps / t_gen_s
        (t_gen_s runs from the first token, sampled from the prompt's logits, to the last)."""
        return self.n_gen_steps / self.t_gen_s if self.t_gen_s > 0 else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per target pass during generation (the first token comes from the
        prompt pass, so it is not counted)."""
        return self.n_gen_steps / self.n_target_passes if self.n_target_passes else 0.0

    def lines(self) -> list[str]:
        """The statistics in llama.cpp's own words."""
        out = [f"prompt eval: {self.n_prompt} tokens in {self.t_prompt_s * 1e3:.1f} ms "
               f"({self.prompt_tps:.2f} tokens/s)"
               + (f", {self.n_prompt_fast} through the fast prompt context ("
                  + (f"a child process of {self.fast_process_mib:.0f} MiB private memory, with "
                     if self.fast_process_mib else "")
                  + (f"repacked weights {self.fast_weights_mib:.0f} MiB, " if self.fast_weights_mib else "")
                  + f"F16 KV cache {self.fast_kv_mib:.0f} MiB; --no-fast-prefill saves "
                  + ("them)" if self.fast_weights_mib else "it)") if self.n_prompt_fast else ""),
               f"generation: {self.n_gen} tokens in {self.t_gen_s * 1e3:.1f} ms "
               f"({self.gen_tps:.2f} tokens/s), {self.n_target_passes} target passes "
               f"({self.tokens_per_pass:.2f} tokens/pass)"
               + (f", {self.n_restores} checkpoint restores" if self.n_restores else "")]
        if self.drafters:
            out.append(f"draft acceptance rate = {self.acceptance_rate:.5f} "
                       f"({self.n_accepted} accepted / {self.n_drafted} generated)")
            for d in self.drafters:
                pos = ", ".join(f"{r:.3f}" for r in d.acc_rate_per_pos)
                out.append(f"statistics {d.spec_type:>12}: #gen drafts = {d.n_gen_drafts}, "
                           f"#acc drafts = {d.n_acc_drafts}, #gen tokens = {d.n_gen_tokens}, "
                           f"#acc tokens = {d.n_acc_tokens}, #mean acc len = {d.mean_acc_len:.2f}, "
                           f"#acc rate/pos = ({pos})")
        if self.exact is not None:
            mode = "off" if not self.exact else (f"on, but {self.exact_caveat}" if self.exact_caveat
                                                 else "on (verify logits bit-identical to one-token decoding)")
            out.append(f"exact mode: {mode}; verify: {self.verify}")
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, n_drafted=self.n_drafted, n_accepted=self.n_accepted,
                 prompt_tps=self.prompt_tps, gen_tps=self.gen_tps, tokens_per_pass=self.tokens_per_pass,
                 n_gen_steps=self.n_gen_steps)
        for dd, ds in zip(d["drafters"], self.drafters, strict=True):
            dd.update(mean_acc_len=ds.mean_acc_len, acc_rate_per_pos=ds.acc_rate_per_pos)
        return d
