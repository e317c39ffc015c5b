"""The OpenAI-compatible HTTP server (`minerva serve`); its load client is `minerva.bench.serve`."""
