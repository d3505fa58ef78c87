"""Elias omega coding of QSGD levels: exact bit counts and a parallel codec.

The paper's variable-length code for quantized vectors (Alistarh et al. 2017,
Section 3.2), for size accounting and as a real codec; the collectives in
this library keep their fixed-width packed wire format.
"""

from qsgd_jax._src.compressors.elias import (
    capacity_words,
    decode,
    encode,
    encoded_bits,
    omega_length,
    total_bits,
)

__all__ = (
    "capacity_words",
    "decode",
    "encode",
    "encoded_bits",
    "omega_length",
    "total_bits",
)
