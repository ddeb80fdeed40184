"""The one compiled part of specrun: kernels/_draftloop.c, a model drafter's greedy draft loop
(the rest of the configuration is pyproject.toml's). optional: where it cannot be built, the
drafters run the same loop in Python (kernels/llama.py Context.draft_chain)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("specrun.kernels._draftloop", ["kernels/_draftloop.c"],
                             extra_compile_args=["-O2"], optional=True)])
