"""plow: a verification-first LLM inference compiler and runtime."""

__version__ = "0.1.0"
