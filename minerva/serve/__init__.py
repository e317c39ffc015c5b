"""The OpenAI-compatible HTTP server (`minerva serve`) and its load client (`minerva bench serve`)."""
