"""A training step over a mesh, the layouts of the library's states, and resizing them."""
