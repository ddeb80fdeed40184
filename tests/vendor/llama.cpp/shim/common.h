// Shim for llama.cpp's common/common.h (and the ggml macros it brings): only what common/ngram-*.{h,cpp} use.
#pragma once
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
typedef std::vector<llama_token> llama_tokens;
#define GGML_ABORT(...) do { fprintf(stderr, __VA_ARGS__); abort(); } while (0)
#define GGML_ASSERT(x) do { if (!(x)) abort(); } while (0)
static inline int64_t ggml_time_ms() { return 0; }
