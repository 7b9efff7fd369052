"""Models as ordered lists of blocks: the built-in GPT, Hugging Face causal LMs, a user's factory."""

from .build import build_model

__all__ = ["build_model"]
