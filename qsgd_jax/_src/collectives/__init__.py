"""Quantized collectives: the reduction plan and the sums, gathers and exchanges it runs."""
