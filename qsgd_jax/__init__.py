"""qsgd_jax: quantized gradient communication for JAX."""

from qsgd_jax._src.base import Compressor, Payload
from qsgd_jax._src.baselines import Cast, Identity
from qsgd_jax._src.collectives import quantized_pmean, quantized_psum
from qsgd_jax._src.minmax import MinMax
from qsgd_jax._src.onebit import OneBit
from qsgd_jax._src.qsgd import QSGD
from qsgd_jax._src.transforms import (
    CompressedAllReduceState,
    CompressionStats,
    compressed_allreduce,
    compression_stats,
    onebit_sgd,
    qsgd,
    state_partition_specs,
)
from qsgd_jax._src.wire import Collective, collectives_in_hlo, wire_bytes

__version__ = "0.1.0"

__all__ = (
    "Cast",
    "Collective",
    "Compressor",
    "Identity",
    "MinMax",
    "OneBit",
    "Payload",
    "QSGD",
    "CompressedAllReduceState",
    "CompressionStats",
    "collectives_in_hlo",
    "compressed_allreduce",
    "compression_stats",
    "onebit_sgd",
    "qsgd",
    "state_partition_specs",
    "quantized_pmean",
    "quantized_psum",
    "wire_bytes",
)
