"""Averages as optax transformations: the compressed all-reduce and decentralized SGD on a ring."""
