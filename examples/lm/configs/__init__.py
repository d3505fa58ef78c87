"""Configurations of the language-model example: each file's `get_config()` returns a ConfigDict."""
