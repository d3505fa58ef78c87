"""Examples of qsgd_jax in training programs."""
