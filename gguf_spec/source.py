"""Where a GGUF comes from, as its metadata says: the Hugging Face repository it was converted
from, and the names it carries (what `specrun export` needs to name the model to vLLM/SGLang)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGUFValueType, Keys

from .spec import BoundedReader, open_gguf, read_layout

HF = "https://huggingface.co/"


@dataclass(frozen=True, slots=True)
class Source:
    hf_repo: str | None      # "google/gemma-3-270m": the repository its metadata names; None: none found
    hf_key: str | None       # the metadata key hf_repo came from
    has_mtp: bool            # {arch}.nextn_predict_layers > 0
    known_as: str | None     # "general.organization 'HuggingFaceTB', general.name 'Smollm2 135M'": a hint
    k_head: int | None = None  # a K row's head size as llama.cpp reads it (n_embd_head_k); None: unknown


def source(path: str | os.PathLike) -> Source:
    """A GGUF's Source (metadata only; GGUFError on a bad file, as open_gguf)."""
    r = open_gguf(path)
    repo, key = _hf_source(r)
    names = [f"{k} '{v}'" for k in (Keys.General.ORGANIZATION, Keys.General.NAME) if (v := _string(r, k)) is not None]
    layout = read_layout(r)
    return Source(repo, key, layout.nextn_layers > 0, ", ".join(names) or None, _k_head(r, layout.arch))


def _k_head(r: BoundedReader, arch: str) -> int | None:
    """llama.cpp's n_embd_head_k: {arch}.attention.key_length, else n_embd / n_head (Gemma 3 270M:
    256, where 640 / 4 would say 160)."""
    def scalar(key: str) -> int | None:
        f = r.fields.get(key.format(arch=arch))
        if f is None or len(f.types) != 1 or f.types[0] == GGUFValueType.STRING:
            return None
        v = f.contents()
        return int(v) if isinstance(v, (int, float)) and v > 0 else None

    if (k := scalar(Keys.Attention.KEY_LENGTH)) is not None:
        return k
    n_embd, n_head = scalar(Keys.LLM.EMBEDDING_LENGTH), scalar(Keys.Attention.HEAD_COUNT)
    return n_embd // n_head if n_embd and n_head and n_embd % n_head == 0 else None


def hf_source(path: str | os.PathLike) -> tuple[str | None, str | None]:
    """(repository, metadata key): the Hugging Face repository this GGUF was converted from, as
    convert_hf_to_gguf.py records it (gguf-py's Keys.General: general.source.repo_url, then
    general.source.url, then general.repo_url / general.url unless they name a GGUF repository).
    general.base_model.N.* is never used: it names the model this one was fine-tuned from, other
    weights. (None, None) when the file names none. Reads metadata only."""
    return _hf_source(open_gguf(path))


def _string(r: BoundedReader, key: str) -> str | None:
    f = r.fields.get(key)
    if f is None or not f.types or f.types[0] != GGUFValueType.STRING:
        return None
    return str(f.contents()).strip()


def _hf_source(r: BoundedReader) -> tuple[str | None, str | None]:
    for key in (Keys.General.SOURCE_REPO_URL, Keys.General.SOURCE_URL, Keys.General.REPO_URL, Keys.General.URL):
        url = _string(r, key)
        repo = _hf_repo(url) if url else None
        if repo and not (key in (Keys.General.REPO_URL, Keys.General.URL) and repo.lower().endswith("gguf")):
            return repo, key
    return None, None


def _hf_repo(url: str) -> str | None:
    """'https://huggingface.co/google/gemma-3-270m' -> 'google/gemma-3-270m'; None for another site."""
    if not url.startswith(HF):
        return None
    parts = url[len(HF):].strip("/").split("/")
    return f"{parts[0]}/{parts[1]}" if len(parts) >= 2 and parts[0] and parts[1] else None
