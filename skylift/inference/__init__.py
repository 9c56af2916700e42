"""Inference engines: vLLM in-process or behind our HTTP server, one interface for both."""
