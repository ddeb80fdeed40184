"""`specrun check-exact`: measure whether verify batches are bit-identical to plain decoding."""

from __future__ import annotations

import json
import sys

import click
import numpy as np
from rich.console import Console
from rich.table import Table

from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.loading import main_model
from .runtime.options import MAX_THREADS, kv_options, kv_params

_TEXT = ("Speculative decoding drafts several tokens cheaply and verifies them with the main model in "
         "one batched pass. The accepted text must be exactly what the model alone would write, so the "
         "logits of a position must not depend on how many rows share its batch. ")


MAX_CHECK_N_MAX = 255


def context_prompt(model, n_tokens: int) -> np.ndarray:
    """A prompt of exactly n_tokens tokens (a fixed text repeated)."""
    ids = model.tokenize(_TEXT * (n_tokens // 20 + 2))
    return ids[:n_tokens]


@click.command("check-exact")
@click.option("-m", "--model", "model", default="gemma-3-270m", show_default=True)
@click.option("--n-max", "n_max", default="1,3,8,15", show_default=True,
              help="draft lengths to check (verify batches of n-max + 1 rows), comma-separated")
@click.option("--context", "contexts", default="100,600", show_default=True,
              help="tokens already in the KV cache before the checked rows, comma-separated")
@click.option("-t", "--threads", type=click.IntRange(0, MAX_THREADS), default=0)
@click.option("--no-exact", is_flag=True, help="check llama.cpp's default (fastest) kernels instead")
@kv_options
@click.option("--json", "as_json", is_flag=True)
@click.option("-v", "--verbose", is_flag=True)
@handle_errors
def check_exact(model, n_max, contexts, threads, no_exact, as_json, verbose, **kw):
    """Is a position's logits row identical alone and inside a verify batch? (exit 1 if not)"""
    from specrun.kernels.exactness import check_exact as run_check
    from specrun.kernels.llama import Model

    setup_logging(verbose)
    given = [f"{flag} {kw[k]}" for k, flag in (("cache_type_k", "-ctk"), ("cache_type_v", "-ctv"),
                                               ("flash_attn", "-fa")) if kw[k] is not None]
    if given and not no_exact:
        raise click.UsageError(f"{' '.join(given)}: exact mode checks its own KV cache (q8_0 K, or bf16 where "
                               "q8_0's blocks do not divide the head size; f16 V; flash attention on); add "
                               "--no-exact to check this one")
    kv = kv_params(kw)
    kv.check()
    try:
        n_maxes = [int(x) for x in n_max.split(",")]
        ctxs = [int(x) for x in contexts.split(",")]
    except ValueError:
        raise click.BadParameter("give integers separated by commas, e.g. 1,3,8", param_hint="--n-max/--context") \
            from None
    if not all(1 <= k <= MAX_CHECK_N_MAX for k in n_maxes):
        raise click.BadParameter(f"{n_max}: each n-max must be 1..{MAX_CHECK_N_MAX} (a verify batch of n-max + 1 "
                                 f"rows, decoded one by one too)", param_hint="--n-max")
    if not all(c >= 1 for c in ctxs):
        raise click.BadParameter(f"{contexts}: each context must be at least 1 token", param_hint="--context")
    path, _ = main_model(model)     # the checks run and serve make, before llama.cpp sees the file
    with err_console.status(f"loading {path.name}"):
        m = Model(str(path), exact=not no_exact)
    rows = []
    with m:
        room = m.n_ctx_train - max(n_maxes) - 9       # the check's context holds the prompt, the rows and 8 more
        if max(ctxs) > room:
            raise click.BadParameter(f"{max(ctxs)} tokens do not fit {path.name}'s context of {m.n_ctx_train} with "
                                     f"n-max {max(n_maxes)}: use at most {room}", param_hint="--context")
        for c in ctxs:
            prompt = context_prompt(m, c)
            for k in n_maxes:
                with err_console.status(f"context {c}, n-max {k}"):
                    r = run_check(m, prompt, k + 1, n_threads=threads, kv=kv)
                rows.append({"context": r.n_context, "n_max": k, "rows": r.n_rows, "identical": r.n_identical,
                             "max_abs_diff": r.max_abs_diff, "argmax_flips": r.n_argmax_flips, "exact": r.exact})
    ok = all(r["exact"] for r in rows)
    if as_json:
        json.dump({"model": str(path), "exact_mode": not no_exact, "bit_identical": ok, "checks": rows,
                   **({} if not no_exact else {"kv": {"type_k": kv.type_k, "type_v": kv.type_v,
                                                      "flash_attn": kv.flash_attn}})}, sys.stdout)
        sys.stdout.write("\n")
    else:
        kernels = "exact" if not no_exact else f"default kernels, KV {kv.type_k}/{kv.type_v}, -fa {kv.flash_attn}"
        t = Table(title=f"{path.name}: verify rows vs one-token decoding ({kernels})")
        for col in ("context", "n-max", "rows identical", "max |Δlogit|", "argmax flips"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["context"]), str(r["n_max"]), f"{r['identical']}/{r['rows']}",
                      f"{r['max_abs_diff']:.3g}", str(r["argmax_flips"]))
        Console().print(t)
        Console().print("bit-identical: yes" if ok else "bit-identical: NO (speculative output may differ from plain)")
    sys.exit(0 if ok else 1)
