// Shim for llama.cpp's include/llama.h: only what common/ngram-*.{h,cpp} use.
#pragma once
#include <cstdint>
typedef int32_t llama_token;
#define LLAMA_TOKEN_NULL -1
