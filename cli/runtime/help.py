"""`--help` in sections, as llama.cpp's help ("----- common params -----", "----- sampling params
-----", ...): prompt and sampling first. SECTIONS says which section an option belongs to, by its
name (click's param.name; "help" for -h/--help); an option it does not list still shows, under "Other"
(tests/test_help.py fails for such an option of run, chat, serve or bench)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import click

SECTIONS: dict[str, tuple[str, ...]] = {
    "Prompt & generation": ("prompt", "file", "prompt_names", "escape", "reverse_prompt", "n_predict", "reps"),
    "Sampling": ("temp", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "repeat_last_n", "presence_penalty",
                 "frequency_penalty", "ignore_eos", "logit_bias", "grammar", "grammar_file", "json_schema",
                 "json_schema_file"),
    "Speculative decoding": ("spec_type", "model_draft", "n_max", "n_min", "p_min", "verify", "adaptive", "auto_refresh",
                             "ngram_n",
                             "ngram_m", "ngram_hits", "ngram_match", "map_k_n", "map_k_m", "map_k_hits", "map_k4v_n",
                             "map_k4v_m", "map_k4v_hits", "mod_n_match", "mod_n_min", "mod_n_max", "lookup_static",
                             "lookup_dynamic", "suffix_depth", "suffix_factor", "suffix_min_prob", "suffix_max_cached",
                             "suffix_cache"),
    "Model & context": ("model", "ctx_size", "batch_size", "threads", "no_exact", "fast_prefill", "flash_attn",
                        "cache_type_k", "cache_type_v", "rpc", "tensor_split"),
    "Conversation": ("conversation", "system_prompt", "system_prompt_file", "chat_template", "chat_template_file",
                     "single_turn"),
    "Server": ("host", "port", "parallel", "cont_batching", "max_queue", "api_key", "alias", "prefill_assistant",
               "slots_endpoint", "slots_debug", "drain_timeout", "max_body", "body_timeout"),
    "Output & logging": ("as_json", "as_csv", "plot_path", "quiet", "verbose", "help"),
    # llama.cpp's flags that specrun accepts with a note (no effect), maps (-i: -cnv) or refuses by name
    "llama.cpp compatibility": ("interactive", "ubatch_size", "threads_batch", "gpu_layers", "gpu_layers_draft",
                                "cpu_moe", "n_cpu_moe", "mlock", "mmap", "load_mode", "swa_full", "numa", "no_warmup",
                                "perf", "log_disable", "no_display_prompt", "simple_io", "color", "prompt_cache",
                                "prompt_cache_all", "prompt_cache_ro", "jinja", "keep", "override_kv",
                                "override_tensor", "samplers", "mirostat", "mirostat_lr", "mirostat_ent", "typical",
                                "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                                "dry_sequence_breaker", "xtc_probability", "xtc_threshold", "top_nsigma"),
}
OTHER = "Other"

_PLACE = {name: (i, j) for i, names in enumerate(SECTIONS.values()) for j, name in enumerate(names)}
_TITLES = (*SECTIONS, OTHER)


def option_name(ctx: click.Context, param: click.Parameter) -> str | None:
    """The name SECTIONS knows `param` by: its param.name, or "help" for the help option (click
    8.5 stores that one as _click_default_help)."""
    return "help" if param is ctx.command.get_help_option(ctx) else param.name


def section_of(name: str | None) -> str:
    """The section of the option named `name` (option_name): its SECTIONS entry, else OTHER."""
    return _TITLES[_PLACE[name][0]] if name in _PLACE else OTHER


def write_sections(formatter: click.HelpFormatter, sections: Iterable[tuple[str, Sequence[tuple[str, str]]]],
                   col_max: int = 30) -> None:
    """One formatter.section per (title, rows) that has rows, their second columns aligned as in
    one list. write_dl measures each list alone, so the first row with a help text gets its term
    padded to the widest term of all the lists (trailing spaces before the column's own)."""
    sections = [(title, list(rows)) for title, rows in sections if rows]
    width = min(max((click.formatting.term_len(t) for _, rows in sections for t, _ in rows), default=0), col_max)
    for title, rows in sections:
        i = next((k for k, (_, text) in enumerate(rows) if text), None)
        if i is not None:
            rows[i] = (rows[i][0].ljust(width), rows[i][1])
        with formatter.section(title):
            formatter.write_dl(rows, col_max=col_max)


class SectionedCommand(click.Command):
    """A click command whose --help lists its options by section (SECTIONS order, then Other),
    each section in SECTIONS' order. Parsing is click's own."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[tuple[int, int], tuple[str, str]]]] = {title: [] for title in _TITLES}
        for n, param in enumerate(self.get_params(ctx)):
            record, name = param.get_help_record(ctx), option_name(ctx, param)
            if record is not None:
                rows[section_of(name)].append((_PLACE.get(name, (len(SECTIONS), n)), record))
        write_sections(formatter, ((title, [r for _, r in sorted(found)]) for title, found in rows.items()))
