"""Buying answers: the LiteLLM call and its retries, the USD budget, the local server."""
