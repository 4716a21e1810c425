"""eval stage of rm_jax."""
