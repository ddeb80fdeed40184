"""`specrun export --to vllm|sglang|llama-server` (issue 16, item 5): the exact command printed for
every spec type on every engine, the Hugging Face repository read from the GGUF's metadata, the
notes for the rows mapped to the engine's nearest drafter, and bad input as one line, exit 1.
Runs on tiny synthetic GGUFs (no model is loaded: export reads metadata only)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import rewrite_gguf

from specrun.cli.main import cli
from specrun.gguf_spec.extract import extract_mtp, extract_trunk
from specrun.gguf_spec.source import hf_source
from specrun.gguf_spec.testmodel import write_test_model
from specrun.gguf_spec.testmodel_eagle3 import write_eagle3_pair

SOURCE_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def fill(text: str, f: dict[str, str]) -> str:
    """{G}, {ET}... -> the fixture's paths (str.format would trip on the JSON's braces)."""
    for k, v in f.items():
        text = text.replace("{" + k + "}", v)
    return text


def invoke(*args: str):
    return CliRunner().invoke(cli, ["export", *args], catch_exceptions=False)


def with_metadata(src: Path, dst: Path, extra: dict[str, str]) -> Path:
    """A copy of the GGUF src with string keys added (as convert_hf_to_gguf.py writes general.source.*)."""
    return rewrite_gguf(src, dst, strings=extra)


@pytest.fixture(scope="module")
def f(tmp_path_factory) -> dict[str, str]:
    """The tiny qwen35 with MTP heads (G), its trunk and heads apart, an EAGLE-3 pair, and copies that
    name their Hugging Face repositories."""
    d = tmp_path_factory.mktemp("export")
    full = write_test_model(d / "full.gguf")
    extract_trunk(full, d / "trunk.gguf")
    extract_mtp(full, d / "heads.gguf")
    target, draft = write_eagle3_pair(d / "e-target.gguf", d / "e-draft.gguf")
    hf = with_metadata(full, d / "hf.gguf", {"general.source.repo_url": f"https://huggingface.co/{SOURCE_REPO}",
                                             "general.url": "https://huggingface.co/someone/SmolLM2-GGUF"})
    hfd = with_metadata(draft, d / "hf-draft.gguf", {"general.source.url": "https://huggingface.co/org/eagle3-draft"})
    (d / "lookup.bin").write_bytes(b"")
    return {"G": str(full), "T": str(d / "trunk.gguf"), "H": str(d / "heads.gguf"),
            "ET": str(target), "ED": str(draft), "HF": str(hf), "HFD": str(hfd), "LC": str(d / "lookup.bin")}


# ---- every spec type x every engine: the exact command -------------------------------------------

VLLM = "vllm serve {G} --tokenizer '<HF-REPO>' --host 127.0.0.1 --port 8080 --served-model-name full --max-model-len 4096"
VLLM_E = VLLM.replace("{G}", "{ET}").replace("name full", "name e-target")
SGL = ("python -m sglang.launch_server --model-path {G} --tokenizer-path '<HF-REPO>' --host 127.0.0.1 --port 8080 "
       "--served-model-name full --context-length 4096")
SGL_E = SGL.replace("{G}", "{ET}").replace("name full", "name e-target")
LS = "llama-server -m {G} --host 127.0.0.1 --port 8080 -c 4096 --alias full"
LS_E = "llama-server -m {ET} -md {ED} --host 127.0.0.1 --port 8080 -c 4096 --alias e-target"
NG = "--speculative-algorithm NGRAM --speculative-num-draft-tokens {k} --speculative-ngram-min-match-window-size {lo} " \
     "--speculative-ngram-max-match-window-size {n} --speculative-ngram-max-bfs-breadth 1"


def vcfg(**c) -> str:
    return "--speculative-config " + shlex.quote(json.dumps(c))


CASES = [  # (args, engine, the command printed)
    (["--spec-type", "none"], "vllm", VLLM),
    (["--spec-type", "none"], "sglang", SGL),
    (["--spec-type", "none"], "llama-server", LS),
    (["-md", "{G}", "--spec-type", "draft", "--spec-draft-n-max", "5"], "vllm",
     VLLM + " " + vcfg(method="draft_model", model="<DRAFT-HF-REPO>", num_speculative_tokens=5)),
    (["-md", "{G}", "--spec-type", "draft-simple", "--spec-draft-n-max", "5"], "sglang",
     SGL + " --speculative-algorithm STANDALONE --speculative-draft-model-path '<DRAFT-HF-REPO>' "
           "--speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6"),
    (["-md", "{G}", "--spec-type", "draft", "--spec-draft-n-max", "5", "--spec-draft-n-min", "2"], "llama-server",
     "llama-server -m {G} -md {G} --host 127.0.0.1 --port 8080 -c 4096 --alias full --spec-type draft-simple "
     "--spec-draft-n-max 5 --spec-draft-n-min 2"),
    (["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"], "vllm",
     VLLM + " " + vcfg(method="mtp", num_speculative_tokens=2)),
    (["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"], "sglang",
     SGL + " --speculative-algorithm NEXTN --speculative-num-steps 2 --speculative-eagle-topk 1 "
           "--speculative-num-draft-tokens 3"),
    (["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"], "llama-server",
     LS + " --spec-type draft-mtp --spec-draft-n-max 2"),
    (["-m", "{ET}", "-md", "{ED}", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4"], "vllm",
     VLLM_E + " " + vcfg(method="eagle3", model="<DRAFT-HF-REPO>", num_speculative_tokens=4)),
    (["-m", "{ET}", "-md", "{ED}", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4"], "sglang",
     SGL_E + " --speculative-algorithm EAGLE3 --speculative-draft-model-path '<DRAFT-HF-REPO>' "
             "--speculative-num-steps 4 --speculative-eagle-topk 1 --speculative-num-draft-tokens 5"),
    (["-m", "{ET}", "-md", "{ED}", "--spec-type", "draft-eagle3", "--spec-draft-n-max", "4"], "llama-server",
     LS_E + " --spec-type draft-eagle3 --spec-draft-n-max 4"),
    (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"], "vllm",
     VLLM + " " + vcfg(method="ngram", num_speculative_tokens=16, prompt_lookup_max=3, prompt_lookup_min=3)),
    (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"], "sglang",
     SGL + " " + NG.format(k=17, lo=3, n=3)),
    (["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16"],
     "llama-server", LS + " --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16"),
    (["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "8"], "vllm",
     VLLM + " " + vcfg(method="ngram", num_speculative_tokens=48, prompt_lookup_max=8, prompt_lookup_min=8)),
    (["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "8"], "sglang", SGL + " " + NG.format(k=49, lo=8, n=8)),
    (["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "8"], "llama-server",
     LS + " --spec-type ngram-map-k --spec-ngram-map-k-size-n 8 --spec-ngram-map-k-size-m 48"),
    (["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-m", "8", "--spec-ngram-map-k4v-min-hits", "2"],
     "vllm", VLLM + " " + vcfg(method="ngram", num_speculative_tokens=8, prompt_lookup_max=12, prompt_lookup_min=12)),
    (["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-m", "8", "--spec-ngram-map-k4v-min-hits", "2"],
     "sglang", SGL + " " + NG.format(k=9, lo=12, n=12)),
    (["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-m", "8", "--spec-ngram-map-k4v-min-hits", "2"],
     "llama-server", LS + " --spec-type ngram-map-k4v --spec-ngram-map-k4v-size-n 12 --spec-ngram-map-k4v-size-m 8 "
                          "--spec-ngram-map-k4v-min-hits 2"),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16", "--spec-ngram-mod-n-max", "32"], "vllm",
     VLLM + " " + vcfg(method="ngram", num_speculative_tokens=32, prompt_lookup_max=16, prompt_lookup_min=16)),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16", "--spec-ngram-mod-n-max", "32"], "sglang",
     SGL + " " + NG.format(k=33, lo=16, n=16)),
    (["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "16", "--spec-ngram-mod-n-max", "32"], "llama-server",
     LS + " --spec-type ngram-mod --spec-ngram-mod-n-match 16 --spec-ngram-mod-n-min 48 --spec-ngram-mod-n-max 32"),
    (["--spec-type", "ngram-cache", "--spec-draft-n-max", "6"], "sglang",
     SGL + " " + NG.format(k=7, lo=1, n=4) + " --speculative-ngram-match-type PROB"),
    (["--spec-type", "ngram-cache", "-lcs", "{LC}"], "llama-server", LS + " --spec-type ngram-cache -lcs {LC}"),
]


@pytest.mark.parametrize("args, engine, expected", CASES, ids=[f"{c[0][c[0].index('--spec-type') + 1]}-{c[1]}"
                                                                for c in CASES])
def test_the_exact_command_for_each_spec_type_and_engine(f, args, engine, expected):
    args = [fill(a, f) for a in args]
    r = invoke("--to", engine, *(["-m", f["G"]] if "-m" not in args else []), *args)
    assert r.exit_code == 0, r.output
    assert r.stdout == fill(expected, f) + "\n"
    assert "Traceback" not in r.output


# ---- what the notes say: the placeholders, the nearest rows, the flags not carried ----------------

def notes(r) -> list[str]:
    return r.stderr.splitlines()


def test_a_gguf_without_a_hugging_face_repository_says_what_to_fill_in(f):
    r = invoke("--to", "vllm", "-m", f["G"], "--spec-type", "none")
    assert notes(r) == ["full.gguf names no Hugging Face repository (general.source.repo_url, general.source.url), "
                        "so vLLM gets the GGUF itself: replace <HF-REPO> with the repository it was converted from; it "
                        "says general.name 'specrun synthetic qwen35 + MTP' (vLLM documents GGUF support as experimental and wants the original tokenizer)"]


def test_the_hugging_face_repository_comes_from_the_conversion_source_not_the_gguf_repo(f):
    assert hf_source(f["HF"]) == (SOURCE_REPO, "general.source.repo_url")
    assert hf_source(f["HFD"]) == ("org/eagle3-draft", "general.source.url")
    assert hf_source(f["G"]) == (None, None)
    r = invoke("--to", "sglang", "-m", f["HF"], "--spec-type", "draft-mtp", "-a", "smol", "--port", "9000", "-c", "0")
    assert r.exit_code == 0, r.output
    assert r.stdout == (f"python -m sglang.launch_server --model-path {SOURCE_REPO} --host 127.0.0.1 --port 9000 "
                        "--served-model-name smol --speculative-algorithm NEXTN --speculative-num-steps 3 "
                        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4\n")
    assert notes(r) == [f"SGLang loads {SOURCE_REPO} (the GGUF's general.source.repo_url), the weights hf.gguf was "
                        "converted from, not the GGUF itself: its quantization differs, so texts can differ from "
                        "specrun's"]


def test_a_gguf_repository_is_not_taken_for_the_original(f, tmp_path):
    gguf_repo = {"general.url": "https://huggingface.co/someone/SmolLM2-135M-GGUF"}
    assert hf_source(with_metadata(Path(f["G"]), tmp_path / "a.gguf", gguf_repo)) == (None, None)
    own = {**gguf_repo, "general.repo_url": "https://huggingface.co/org/model/tree/main"}
    assert hf_source(with_metadata(Path(f["G"]), tmp_path / "b.gguf", own)) == ("org/model", "general.repo_url")


def test_an_eagle3_draft_that_names_its_repository_is_loaded_from_it(f):
    r = invoke("--to", "vllm", "-m", f["ET"], "-md", f["HFD"], "--spec-type", "draft-eagle3")
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith(" " + vcfg(method="eagle3", model="org/eagle3-draft", num_speculative_tokens=3) + "\n")
    assert "-md hf-draft.gguf: vLLM loads the draft org/eagle3-draft (its general.source.url)" in notes(r)


@pytest.mark.parametrize("engine, nearest", [("vllm", "vLLM's ngram"), ("sglang", "SGLang's NGRAM")])
@pytest.mark.parametrize("spec_type, lost", [
    ("ngram-map-k", "a hash map of earlier keys"),
    ("ngram-map-k4v", "up to 4 continuations counted per key"),
    ("ngram-mod", "one pool of hashed n-grams shared by every request, no draft shorter than n-min 48"),
])
def test_the_nearest_rows_say_what_is_not_carried_over(f, engine, nearest, spec_type, lost):
    r = invoke("--to", engine, "-m", f["G"], "--spec-type", spec_type)
    assert r.exit_code == 0, r.output
    [line] = [ln for ln in notes(r) if ln.startswith(f"--spec-type {spec_type} has no equivalent; nearest: {nearest}")]
    assert f"not carried over: {lost}" in line


def test_mtp_heads_given_with_md_are_inferred_and_left_to_the_checkpoint_on_vllm(f):
    r = invoke("--to", "vllm", "-m", f["T"], "-md", f["H"], "--spec-draft-n-max", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout.endswith(" " + vcfg(method="mtp", num_speculative_tokens=1) + "\n")
    assert notes(r)[0] == "spec type: draft-mtp, inferred from -md heads.gguf (MTP heads); --spec-type chooses another"
    assert ("-md heads.gguf: not exported; vLLM reads the MTP heads from the model's own checkpoint (the one the "
            "heads were extracted from)") in notes(r)
    r = invoke("--to", "llama-server", "-m", f["T"], "-md", f["H"])
    assert r.stdout == (f"llama-server -m {f['T']} -md {f['H']} --host 127.0.0.1 --port 8080 -c 4096 --alias trunk "
                        "--spec-type draft-mtp --spec-draft-n-max 3\n")


def test_llama_cpp_flags_pass_to_llama_server_and_are_named_for_the_others(f):
    args = ["-m", f["G"], "--spec-type", "ngram-simple", "-ngl", "99", "-fa", "on", "-ctk", "q8_0", "--no-mmap",
            "-t", "4", "--spec-draft-adaptive"]
    r = invoke("--to", "llama-server", *args)
    assert r.stdout == (f"llama-server -m {f['G']} --host 127.0.0.1 --port 8080 -c 4096 -t 4 --alias full -ngl 99 "
                        "-fa on -ctk q8_0 -lm none --spec-type ngram-simple --spec-ngram-simple-size-n 12 "
                        "--spec-ngram-simple-size-m 48\n")
    assert notes(r) == ["--spec-draft-adaptive: not exported; llama-server drafts up to the n-max / size-m given",
                        "exact mode: not exported; llama-server has none (its verify batches may differ from one-token "
                        "decoding); GGML_CPU_TILED_MM=0 in its environment and -nr -ctk q8_0 give it exact mode's "
                        "kernels and KV types (--no-exact: this line goes)"]
    assert notes(invoke("--to", "llama-server", *args, "--no-exact"))[-1].startswith("--spec-draft-adaptive")
    # a cache exact mode did not apply goes to llama-server as given, and the line says so
    assert notes(invoke("--to", "llama-server", "-m", f["G"], "-ctk", "q4_0", "-fa", "on"))[-1].endswith(
        "kernels and KV types; the -ctk q4_0 above goes to llama-server as given, where exact mode did not apply it "
        "(--no-exact: this line goes)")
    r = invoke("--to", "llama-server", "-m", f["G"], "--spec-type", "ngram-mod", "--spec-draft-n-min", "30",
               "--no-exact")
    assert notes(r) == ["--spec-draft-n-min 30: not exported; llama-server applies it to draft-model, EAGLE-3 and "
                        "MTP drafts only, not to n-gram ones"]
    r = invoke("--to", "vllm", *args)
    assert notes(r)[1:] == ["--spec-draft-adaptive: not exported; vLLM's draft length is the fixed one above",
                            "-t 4: not exported; vLLM runs the model on the GPU",
                            "-ngl, -fa, -ctk, -lm: not exported; llama.cpp's own settings (vLLM chooses its own)"]


# ---- bad input: one line on stderr, exit 1, no traceback -----------------------------------------

@pytest.mark.parametrize("args, line", [
    (["--to", "tgi", "--spec-type", "none"],
     "Error: --to tgi: unknown engine; use one of vllm, sglang, llama-server"),
    (["--spec-type", "none"], "Error: --to is required: one of vllm, sglang, llama-server"),
    (["--to", "vllm", "--spec-type", "ngram-cache"],
     "Error: vLLM has no n-gram cache (llama.cpp's lookup statistics, -lcs/-lcd files); its drafters without a model "
     "are ngram (export --spec-type ngram-simple) and suffix; or export --to llama-server"),
    (["--to", "sglang", "--spec-type", "ngram-cache", "-lcs", "{LC}"],
     "Error: SGLang cannot read llama.cpp's n-gram cache files (-lcs/-lcd); its NGRAM drafter builds its own cache "
     "from the text: leave -lcs/-lcd out, or export --to llama-server"),
    (["--to", "vllm", "--spec-type", "draft"],
     "Error: --spec-type draft needs -md/--model-draft DRAFT.gguf (the draft model to export)"),
    (["--to", "sglang", "--spec-type", "ngram-simple,draft-mtp"],
     "Error: SGLang runs one speculative algorithm per server, not 2 (ngram-simple,draft-mtp); export one "
     "--spec-type, or --to llama-server, which combines them"),
    (["--to", "llama-server", "--spec-type", "auto"],
     "Error: --spec-type auto is chosen by measuring this model on this machine once it is loaded, and export loads "
     "nothing; run `specrun run --spec-type auto ...`, then export the type it names on stderr (`spec auto: ...`)"),
    (["--to", "vllm", "-m", "{T}", "--spec-type", "draft-mtp"],
     "Error: {T}: the model has no MTP heads, so --spec-type draft-mtp is not available; run `specrun inspect {T}` "
     "to see what it holds, or pass MTP heads with -md HEADS.gguf"),     # the line run and serve give
    (["--to", "llama-server", "-m", "{T}", "-md", "smollm2-135m-instruct", "--spec-type", "draft-mtp"],
     "Error: -md smollm2-135m-instruct cannot be the MTP heads of trunk.gguf: no MTP heads in "
     "SmolLM2-135M-Instruct.Q4_1.gguf; "),
    (["--to", "llama-server", "-m", "{G}", "-md", "{H}", "--spec-type", "draft"],     # llama.cpp: SIGSEGV
     "Error: -md heads.gguf holds only MTP heads (no trunk), not a draft model; use --spec-type draft-mtp"),
    (["--to", "llama-server", "--spec-type", "draft", "-md", "smollm2-135m-instruct"],    # as run refuses it
     "Error: draft model smollm2-135m-instruct cannot draft for full.gguf: draft vocab (49152 tokens) differs from "
     "target (512) by more than 128"),
    (["--to", "vllm", "-m", "{ET}", "-md", "{H}", "--spec-type", "draft-eagle3"],
     "Error: -md heads.gguf cannot be used with --spec-type draft-eagle3: it holds MTP heads (architecture qwen35), "
     "not an EAGLE-3 draft; "),
])
def test_bad_input_is_one_line_and_exit_1(f, args, line):
    args = [fill(a, f) for a in args]
    r = invoke(*(["-m", f["G"]] if "-m" not in args else []), *args)
    assert r.exit_code == 1, r.output
    assert r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(fill(line, f)), r.stderr
    assert "Traceback" not in r.output
