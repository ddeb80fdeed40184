// Shim for llama.cpp's common/log.h: logging compiled out.
#pragma once
#define LOG_DBG(...) ((void) 0)
#define LOG_INF(...) ((void) 0)
