"""data stage of rm_jax."""
