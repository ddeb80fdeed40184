"""Reading GGUF files: what a model holds (ModelSpec), its embedded MTP heads, draft/target
compatibility, and the registry of models that resolve by name without a hub.

Needs only `gguf` and numpy; never imports llama_cpp, click or rich."""
