"""train stage of rm_jax."""
