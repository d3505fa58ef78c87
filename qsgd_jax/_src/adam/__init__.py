"""Compressed Adam: DeepSpeed's 1-bit Adam and 0/1 Adam, and the 1-bit exchange they share."""
