"""A byte-level transformer language model trained with AdamW and compressed gradient averaging."""
