"""The compute layer: the only code that calls llama.cpp (through llama-cpp-python's low-level
bindings), plus the sampling and verification math. Never imports click or rich."""
