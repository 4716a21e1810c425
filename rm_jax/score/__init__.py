"""score stage of rm_jax."""
