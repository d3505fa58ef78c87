"""PowerSGD: low-rank compression of each weight matrix's gradient, as PyTorch's hook runs it."""
