"""FSDP compressed both ways: the quantized gather of parameter shards and 1-bit Adam under it."""
