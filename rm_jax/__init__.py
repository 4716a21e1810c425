"""rm_jax: a verdict-first generative reward model (multimodal judge) for tool-calling agents."""

__version__ = "0.1.0"
