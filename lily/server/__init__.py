"""OpenAI-compatible HTTP server: ``lily serve`` (see app.py for the entry points)."""
