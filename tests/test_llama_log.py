"""What kernels/llama.py reads from llama.cpp's log, where llama.cpp's API does not return it: the
tensor types, buffer sizes and KV cache rotation of one model load or context creation, kept per call and
per thread (a _Heard block), never from another call's lines. The lines are llama.cpp's own formats
(llama-model.cpp, llama-kv-cache.cpp, llama-model-loader.cpp)."""

from __future__ import annotations

import threading

import pytest

from specrun.kernels import llama as ll

ERROR, INFO = 4, 2


def say(*lines: bytes, level: int = INFO) -> None:
    for line in lines:
        ll._log_callback(level, line, None)


def test_a_model_load_counts_tensor_types_and_weight_buffers():
    with ll._Heard() as heard:
        say(b"llama_model_loader: - kv  40:                          general.file_type u32              = 15\n",
            b"llama_model_loader: - type  f32:  109 tensors\n",
            b"llama_model_loader: - type q4_K:   27 tensors\n",
            b"llama_model_loader: - type q6_K:    9 tensors\n",
            b"load_tensors:   CPU_Mapped model buffer size =   96.00 MiB\n",
            b"load_tensors:   CPU_REPACK model buffer size =   10.50 MiB\n",
            b"load_tensors:   CPU_REPACK model buffer size =    2.25 MiB\n",
            b"llama_context:        CPU compute buffer size =    9.00 MiB\n")
    assert list(heard.tensor_types().items()) == [("F32", 109), ("Q4_K", 27), ("Q6_K", 9)]
    assert heard.weight_buffers_mib() == {"CPU_Mapped": 96.0, "CPU_REPACK": 12.75}
    assert heard.kv_buffers_mib() == 0.0 and heard.kv_rot() == (0, 0)


@pytest.mark.parametrize(("lines", "mib", "rot"), [
    # an iSWA model (Gemma 3): two caches, quantized K rotated in blocks of its head size
    ([b"llama_kv_cache:        CPU KV buffer size =    18.00 MiB\n",
      b"llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 256\n",
      b"llama_kv_cache: attn_rot_v = 0, n_embd_head_k_all = 256\n",
      b"llama_kv_cache:        CPU KV buffer size =     4.50 MiB\n",
      b"llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 256\n",
      b"llama_kv_cache: attn_rot_v = 0, n_embd_head_k_all = 256\n"], 22.5, (256, 0)),
    # K in blocks of the largest power of two >= 64 that divides the head size; V in blocks of 64
    ([b"llama_kv_cache: attn_rot_k = 1, n_embd_head_k_all = 192\n",
      b"llama_kv_cache: attn_rot_v = 1, n_embd_head_k_all = 192\n"], 0.0, (64, 64)),
    # an F16 cache, and layers of several head sizes: not rotated
    ([b"llama_kv_cache:        CPU KV buffer size =    12.00 MiB\n",
      b"llama_kv_cache: attn_rot_k = 0, n_embd_head_k_all = -1\n",
      b"llama_kv_cache: attn_rot_v = 0, n_embd_head_k_all = -1\n"], 12.0, (0, 0)),
])
def test_a_context_reads_its_kv_cache(lines, mib, rot):
    with ll._Heard() as heard:
        say(*lines)
    assert (heard.kv_buffers_mib(), heard.kv_rot()) == (mib, rot)


def test_the_reason_is_the_load_error_else_the_latest_error_line():
    with ll._Heard() as heard:
        say(b"llama_model_load: error loading model: tensor 'x' data is not within the file bounds\n",
            b"llama_model_load_from_file_impl: failed to load model\n", level=ERROR)
        say(b"llama_kv_cache:        CPU KV buffer size =     1.00 MiB\n")   # not an error line
    assert heard.reason() == "; llama.cpp says: tensor 'x' data is not within the file bounds"
    with ll._Heard() as heard:
        say(*(f"line {i}\n".encode() for i in range(10)), level=ERROR)
    assert heard.errors == [f"line {i}" for i in range(2, 10)] and heard.reason() == "; llama.cpp says: line 9"
    with ll._Heard() as heard:
        pass
    assert heard.reason() == ""


def test_a_call_hears_only_its_own_lines():
    """Lines outside the block, inside a nested block or on another thread belong to no call or to
    that call: each load's numbers are its own."""
    say(b"llama_kv_cache:        CPU KV buffer size =     1.00 MiB\n")
    say(b"before\n", level=ERROR)
    with ll._Heard() as outer:
        say(b"llama_kv_cache:        CPU KV buffer size =     2.00 MiB\n")
        with ll._Heard() as inner:
            say(b"llama_kv_cache:        CPU KV buffer size =     4.00 MiB\n")
            say(b"inner\n", level=ERROR)
        other = threading.Thread(target=say, args=(b"llama_kv_cache:        CPU KV buffer size =     8.00 MiB\n",))
        other.start()
        other.join()
        say(b"outer\n", level=ERROR)
    say(b"llama_kv_cache:        CPU KV buffer size =    16.00 MiB\n")
    assert (outer.kv_buffers_mib(), outer.errors) == (2.0, ["outer"])
    assert (inner.kv_buffers_mib(), inner.errors) == (4.0, ["inner"])
