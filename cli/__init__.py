"""The `specrun` command line: a click group mirroring llama-server/llama-cli flags."""
