"""What a model's reply holds besides its text, read out of it: tool calls (`tools`: the
request's tools rendered for the chat template and, with `tool_choice`, constrained through
the engine's structured output; `tool_calls`: each model family's call syntax, whole and
streamed) and reasoning (`reasoning`: thoughts apart from the answer).

Above the engine (it uses `minerva.engine.structured`) and below the server and `LLM`, so
`minerva.formats` (files, tokenizers, chat templates) imports nothing above it.
"""
