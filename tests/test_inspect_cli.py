"""`specrun inspect` through click's CliRunner: tables, --json, --tensors, --draft."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrun.cli.inspect_cmd import NO_MTP
from specrun.cli.main import cli

JSON_KEYS = {"path", "architecture", "name", "size_label", "file_type", "context_length", "n_embd", "n_layer",
             "n_head", "n_head_kv", "vocab", "chat_template", "n_tensors", "n_bytes", "quant_mix", "mtp", "eagle3",
             "spec_types"}


def invoke(*args: str):
    return CliRunner().invoke(cli, ["inspect", *args], catch_exceptions=False)


def test_table_smollm_by_registry_name(smollm_path):
    r = invoke("smollm2-135m-instruct")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    out = r.stdout
    for words in ("SmolLM2-135M-Instruct.Q4_1.gguf", "architecture", "llama", "Q4_1", "576", "30",
                  "49152 tokens, gpt2 (BPE), pre smollm, bos 1, eos 2", "yes (368 chars)", "272",
                  "quantization mix", "Q8_0"):
        assert words in out, words
    assert out.rstrip().splitlines()[-1] == NO_MTP
    assert "tensors" in out and "blk.0.attn_q.weight" not in out      # no tensor list without --tensors


def test_table_tensors_lists_every_tensor(make_gguf):
    path = make_gguf()
    r = invoke(str(path), "--tensors")
    assert r.exit_code == 0, r.output
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
        assert name in r.stdout
    assert "32 x 32" in r.stdout          # attn_q shape


def test_table_mtp_heads(make_gguf):
    r = invoke(str(make_gguf(arch="qwen35", n_layer=3, nextn=1)))
    assert r.exit_code == 0, r.output
    assert "MTP heads (nextn_predict_layers = 1)" in r.stdout
    assert "blk.2.nextn.eh_proj.weight" in r.stdout and "64 x 32" in r.stdout
    assert NO_MTP not in r.stdout


def test_json_smollm(smollm_path):
    r = invoke(str(smollm_path), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d) == JSON_KEYS
    assert (d["architecture"], d["n_layer"], d["n_embd"], d["file_type"], d["chat_template"]) == \
        ("llama", 30, 576, "Q4_1", True)
    assert d["vocab"] == {"model": "gpt2", "type": "BPE", "pre": "smollm", "size": 49152, "bos_id": 1,
                          "eos_id": 2, "eot_id": None, "add_bos": False, "add_eos": False}
    assert d["mtp"] == {"nextn_predict_layers": 0, "available": False, "blocks": []}
    assert d["eagle3"] is None and d["spec_types"][:2] == ["none", "ngram-simple"] and "draft-mtp" not in d["spec_types"]
    assert d["quant_mix"][0] == {"type": "Q4_1", "n_tensors": 210, "n_bytes": 66355200}
    assert sum(q["n_tensors"] for q in d["quant_mix"]) == d["n_tensors"] == 272


@pytest.mark.slow
def test_json_gemma(gemma_path):
    d = json.loads(invoke("gemma-3-270m", "--json").stdout)
    assert (d["architecture"], d["n_layer"], d["n_embd"], d["file_type"], d["vocab"]["size"]) == \
        ("gemma3", 18, 640, "Q4_K_M", 262144)
    assert d["chat_template"] is False and d["mtp"]["blocks"] == []


def test_json_tensors_and_mtp_blocks(make_gguf):
    path = make_gguf(arch="qwen35", n_layer=3, nextn=1)
    r = invoke(str(path), "--json", "--tensors")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d) == JSON_KEYS | {"tensors"}
    assert d["mtp"]["nextn_predict_layers"] == 1 and d["mtp"]["available"] is True
    (block,) = d["mtp"]["blocks"]
    assert block["index"] == 2
    eh = next(t for t in block["tensors"] if t["name"] == "blk.2.nextn.eh_proj.weight")
    assert eh == {"name": "blk.2.nextn.eh_proj.weight", "type": "Q8_0", "shape": [64, 32], "n_bytes": 2176}
    assert len(d["tensors"]) == d["n_tensors"]
    size = path.stat().st_size
    assert all(t["offset"] + t["n_bytes"] <= size for t in d["tensors"])


@pytest.mark.slow
def test_draft_incompatible_exits_0_and_says_why(gemma_path, smollm_path):
    r = invoke("gemma-3-270m", "--draft", "smollm2-135m-instruct")
    assert r.exit_code == 0, r.output
    last = r.stdout.rstrip().splitlines()[-1]
    assert last.startswith("draft SmolLM2-135M-Instruct.Q4_1.gguf: INCOMPATIBLE with gemma-3-270m-q4_k_m.gguf: ")
    assert "draft vocab (49152 tokens) differs from target (262144) by more than 128" in last
    # the draft adds no type, so no "(with -md ...)" after them
    assert "\nspec types: none, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache, suffix\n" in r.stdout
    d = json.loads(invoke("gemma-3-270m", "--draft", str(smollm_path), "--json").stdout)
    assert d["draft"]["compatible"] is False and "by more than 128" in d["draft"]["reason"]
    assert "draft-simple" not in d["spec_types"]         # no spec type it cannot run


def test_draft_compatible(smollm_path):
    r = invoke("smollm2-135m-instruct", "--draft", "smollm2-135m-instruct")
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().splitlines()[-1] == \
        "draft SmolLM2-135M-Instruct.Q4_1.gguf: compatible with SmolLM2-135M-Instruct.Q4_1.gguf"
    d = json.loads(invoke("smollm2-135m-instruct", "--draft", str(smollm_path), "--json").stdout)
    assert d["draft"] == {"path": str(smollm_path), "compatible": True, "reason": None}


def test_bad_draft_is_one_line_exit_1(smollm_path, tmp_path):
    r = invoke(str(smollm_path), "--draft", str(tmp_path / "nope.gguf"))
    assert r.exit_code == 1
    assert r.stdout == ""
    assert r.stderr.splitlines() == [f"Error: {tmp_path / 'nope.gguf'}: no such file; give a path to a .gguf "
                                     "file or a registry name (`specrun --help` lists them)"]


def test_help_lists_options():
    r = CliRunner().invoke(cli, ["inspect", "--help"])
    assert r.exit_code == 0
    for opt in ("--tensors", "--json", "--draft"):
        assert opt in r.stdout
