"""The runtime every front end (run, chat's REPL, the HTTP server, bench) calls; it imports
nothing above it in cli.

    options.py   click option bundles named as llama.cpp's; options -> EngineParams / SamplingParams
    loading.py   EngineParams -> engines: model names resolved, GGUFs checked, auto expanded (once)
    auto.py      --spec-type auto: calibrate on the loaded engine, choose the setting
    prompts.py   the user's prompt (-p / -f / stdin) and the built-in measuring prompts
    text.py      tokens -> text: UTF-8 pieces, stop strings, turn stops (TextRun, Completion)
    chat.py      messages -> prompt tokens with the chat template (ChatFormat); ChatSession
    console.py   the stderr console, logging set-up, errors as one line
"""
