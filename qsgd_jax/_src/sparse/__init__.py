"""Sparse compression: top-k with error feedback, DGC, DeMo and SparseLoCo."""
