"""Compressors: a float vector to a bit-packed payload and back; the Elias omega codec."""
