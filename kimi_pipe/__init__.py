"""kimi_pipe: exact, trainable token data from hosted LLM APIs."""

__version__ = "0.1.0"
