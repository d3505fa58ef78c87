"""Configurations of the ImageNet example: each file's `get_config()` returns a ConfigDict."""
