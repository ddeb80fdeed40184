"""The KV cache: llama-server's -ctk / -ctv / -fa with --no-exact, and exact mode's K rows where
Q8_0's 32-value blocks do not divide the head size (BF16, as bit-exact; the fast prompt context's
hand-over re-encodes its F16 K rows to BF16 then)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from conftest import rewrite_gguf

from specrun.cli.main import cli
from specrun.cli.runtime.export import head_k_type
from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.source import source
from specrun.gguf_spec.testmodel_eagle3 import TINY, write_eagle3_pair
from specrun.kernels.engine import Engine
from specrun.kernels.exactness import check_exact
from specrun.kernels.kvstate import to_bf16
from specrun.kernels.llama import Context, ContextParams, LlamaError, Model
from specrun.kernels.params import EngineParams, KVParams, SpecParams
from specrun.kernels.types import SamplingParams


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The tiny llama target (q8_0, heads of 64), and a twin with 4 heads of 80 values (phi-2's head
    size) whose attention counts: its attn_output matrices are random, not the bigram's zeros."""
    d = tmp_path_factory.mktemp("kv")
    t64, _ = write_eagle3_pair(d / "t64.gguf", d / "d64.gguf", TINY)
    cfg = replace(TINY, n_embd=320, head_dim=80)
    t80, _ = write_eagle3_pair(d / "t80-zero-attn.gguf", d / "d80.gguf", cfg)
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    attn = {f"blk.{il}.attn_output.weight":
            gguf.quants.quantize(rng.normal(0, 3 / np.sqrt(320), (320, 320)).astype(np.float32), q8)
            for il in range(cfg.n_layer)}
    return {"head64": t64, "head80": rewrite_gguf(t80, d / "t80.gguf", tensors=attn)}


def test_bf16_rows_round_as_ggml_does():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -0.0, np.inf, np.nan, 65504.0], dtype=np.float32)
    assert to_bf16(x).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x8000, 0x7F80, 0x7FC0, 0x4780]
    assert to_bf16(x.astype(np.float16)[:5]).tolist() == [0x3F80, 0x3F80, 0x3F82, 0x8000, 0x7F80]


@pytest.mark.slow
def test_exact_mode_keeps_bf16_k_rows_where_q8_0_blocks_do_not_divide_the_head(files):
    """llama.cpp refuses a Q8_0 K cache under flash attention for heads of 80 values; exact mode was
    then 'could not create a context ... try a smaller -c'. BF16 K rows beside F16 V rows are as
    bit-exact (two types: no split-KV path), before and past 256 tokens of context, while the same
    checks with llama.cpp's defaults differ (so this model's attention does count)."""
    prompt = np.random.default_rng(1).integers(0, 500, 600).astype(np.int32)
    exact = Model(str(files["head80"]), exact=True)
    with Context(exact, ContextParams(n_ctx=256)) as c, Context(Model(str(files["head64"])), ContextParams(n_ctx=256)) as c64:
        assert (c.k_type, c64.k_type) == ("bf16", "q8_0")
    for n in (100, 600):
        r = check_exact(exact, prompt[:n], 16, n_threads=2)
        assert r.exact, r
    assert not check_exact(Model(str(files["head80"]), exact=False), prompt, 16, n_threads=2).exact


@pytest.mark.slow
def test_bf16_k_rows_are_handed_over_from_the_fast_prompt_context(files, caplog):
    """A 300-token prompt goes through the fast prompt context (F16 KV), whose K rows become BF16
    for the exact context; speculative output equals plain decoding after it."""
    prompt = np.random.default_rng(2).integers(0, 500, 300).astype(np.int32)
    greedy = SamplingParams(temp=0.0)
    params = EngineParams(n_ctx=1024, n_threads=1, prefill_worker=False)
    with caplog.at_level(logging.WARNING), Engine(str(files["head80"]), params) as e:
        gen = e.generate(prompt, 48, greedy)
        plain = [t for ts in gen for t in ts]
        assert gen.stats.n_prompt_fast == 300 and e.ctx.k_type == "bf16"
        sp = SpecParams(types=("ngram-simple",), n_max=8, ngram_size_n=1, ngram_size_m=8)
        gen = e.generate(prompt, 48, greedy, spec=sp)
        assert [t for ts in gen for t in ts] == plain and gen.stats.n_drafted > 0
    assert not [r for r in caplog.records if "fast prompt evaluation is off" in r.getMessage()]


@pytest.mark.slow
def test_no_exact_applies_ctk_ctv_and_fa(files):
    m = Model(str(files["head64"]), exact=False)
    sizes = {}
    for kv in (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")):
        with Context(m, ContextParams(n_ctx=1024, type_k=kv[0], type_v=kv[1])) as c:
            sizes[kv] = c.kv_mib
            assert c.k_type == kv[0]
    assert sizes[("f16", "f16")] > sizes[("q8_0", "q8_0")] > sizes[("q4_0", "q4_0")] > 0
    with pytest.raises(LlamaError, match=r"KV cache q8_0/f16\); llama.cpp says: .*K cache type q8_0 with block "
                                         r"size 32 does not divide n_embd_head_k=80; use -ctk and -ctv f16, bf16 "
                                         r"or f32 for this model's head size"):
        Context(Model(str(files["head80"]), exact=False), ContextParams(n_ctx=256, type_k="q8_0"))


def test_a_quantized_v_cache_without_flash_attention_is_refused_before_loading():
    with pytest.raises(SpecrunError, match="-ctv q4_0 with -fa off: llama.cpp keeps a quantized V cache only under "
                                           "flash attention; drop -fa off"):
        EngineParams(exact=False, kv=KVParams(type_v="q4_0", flash_attn="off"))
    EngineParams(exact=True, kv=KVParams(type_v="q4_0", flash_attn="off"))    # exact mode keeps its own
    EngineParams(exact=False, kv=KVParams(type_k="q4_0", flash_attn="off"))   # K alone: llama.cpp's rule is V's


@pytest.mark.slow
def test_a_context_smaller_than_a_draft_caps_the_draft(files):
    """-c 16: llama.cpp caps n_batch at 16 in a context that holds 256, and a verify pass is one batch;
    an n-gram draft of up to 48 failed mid-output ('batch of 18 tokens exceeds n_batch 16')."""
    for exact in (True, False):
        with Engine(str(files["head64"]), EngineParams(n_ctx=16, n_threads=1, exact=exact)) as e:
            assert e.n_max_cap == e.ctx.n_batch - 1 == 15
            prompt = e.tokenize("ab ab ab ab ab ab")
            sp = SpecParams(types=("ngram-simple",), ngram_size_n=1, ngram_size_m=48)
            gen = e.generate(prompt, 200, SamplingParams(temp=0.0), spec=sp)
            got = [t for ts in gen for t in ts]
            plain = [t for ts in e.generate(prompt, 200, SamplingParams(temp=0.0)) for t in ts]
            assert got == plain and gen.stats.n_drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["-p", "hello", "-n", "2"], ["export", "--to", "llama-server"]])
def test_cli_refuses_a_quantized_v_cache_with_fa_off_in_one_line(files, cmd):
    args = [*cmd[:1], "-m", str(files["head64"]), *cmd[1:]] if cmd[0] == "export" else ["-m", str(files["head64"]), *cmd]
    for mode in (["--no-exact"], [] if cmd[0] == "export" else ["--no-exact"]):   # export: the flags go to llama-server
        r = CliRunner().invoke(cli, [*args, *mode, "-ctv", "q8_0", "-fa", "off", "-t", "1"])
        assert r.exit_code == 1 and "Traceback" not in r.output
        assert r.stderr.strip().splitlines()[-1] == ("Error: -ctv q8_0 with -fa off: llama.cpp keeps a quantized V "
                                                     "cache only under flash attention; drop -fa off (auto turns it "
                                                     "on) or use -ctv f16")
    r = CliRunner().invoke(cli, ["-m", str(files["head64"]), "-p", "hello", "-n", "2", "--no-exact", "-ctk", "q8_0",
                                 "-ctv", "q8_0", "-t", "1"])
    assert r.exit_code == 0 and "not applied" not in r.stderr, r.output


def test_export_names_the_k_type_exact_mode_keeps_for_the_head_size(files):
    """export's exact-mode line gives llama-server the K type exact mode keeps: -ctk q8_0 for heads
    of 64, -ctk bf16 for heads of 80 (llama-server would refuse q8_0 there)."""
    assert [head_k_type(k) for k in (None, 64, 80, 128, 256)] == ["q8_0", "q8_0", "bf16", "q8_0", "q8_0"]
    for name, k in (("head64", "q8_0"), ("head80", "bf16")):
        assert source(files[name]).k_head == int(name[4:])
        r = CliRunner().invoke(cli, ["export", "--to", "llama-server", "-m", str(files[name])])
        assert r.exit_code == 0 and f"-nr -ctk {k} give it exact mode's" in " ".join(r.stderr.split()), r.output


@pytest.mark.slow
def test_check_exact_checks_the_kv_cache_given_with_no_exact(files):
    """check-exact --no-exact takes -ctk/-ctv/-fa (it checked an f16 cache only): past 256 tokens,
    on the model whose attention counts, BF16 K rows beside F16 V rows keep flash attention off its
    split-KV path (bit-identical, as exact mode's), the default all-F16 cache does not; exact mode
    refuses them in one line."""
    def check(*args: str) -> dict:
        r = CliRunner().invoke(cli, ["check-exact", "-m", str(files["head80"]), "--n-max", "3", "--context", "300",
                                     "-t", "2", "--json", *args])
        assert r.exit_code in (0, 1) and "Traceback" not in r.output, r.output
        return json.loads(r.stdout)

    bf = check("--no-exact", "-ctk", "bf16")
    assert bf["bit_identical"] and bf["kv"] == {"type_k": "bf16", "type_v": "f16", "flash_attn": "auto"}
    assert not check("--no-exact")["bit_identical"]
    r = CliRunner().invoke(cli, ["check-exact", "-m", str(files["head80"]), "-ctk", "q4_0"])
    assert r.exit_code == 2 and "add --no-exact to check this one" in r.stderr and "Traceback" not in r.output
