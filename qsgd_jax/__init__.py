"""qsgd_jax: quantized gradient communication for JAX.

Compressors (:class:`QSGD`, :class:`MinMax`, :class:`NearestZeroAlignedMinMax`,
:class:`OneBit`, :class:`Cast`, :class:`Identity`), the Elias omega codec
(:mod:`qsgd_jax.elias`), quantized collectives (:func:`quantized_psum`,
:func:`quantized_pmean`, :func:`wire_bytes`) and optax transformations
(:func:`qsgd`, :func:`onebit_sgd`, :func:`compressed_allreduce`,
:func:`low_precision_decentralized`, :func:`accumulate_gradients`), and a
``jax.jit`` training step over a mesh that uses them (:func:`data_parallel`).
For long multi-process runs: :func:`initialize_distributed`, which ends every
process soon after one is lost, and :func:`resize_state` (:mod:`qsgd_jax.resize`),
which resumes per-device state on another number of devices.
"""

from qsgd_jax import elias, resize
from qsgd_jax._src.accumulation import AccumulationState, accumulate_gradients
from qsgd_jax._src.axes import as_varying
from qsgd_jax._src.base import Compressor, Payload, SharedScaleCompressor
from qsgd_jax._src.baselines import Cast, Identity
from qsgd_jax._src.collectives import quantized_pmean, quantized_psum, quantized_psum_scatter
from qsgd_jax._src.data_parallel import DataParallel, data_parallel
from qsgd_jax._src.decentralized import (
    LowPrecisionDecentralizedState,
    averaged_params,
    consensus_distance,
    low_precision_decentralized,
)
from qsgd_jax._src.distributed import LOST_PROCESS_EXIT_CODE, ProcessWatch, initialize_distributed
from qsgd_jax._src.minmax import MinMax
from qsgd_jax._src.onebit import OneBit
from qsgd_jax._src.qsgd import QSGD, EliasSize
from qsgd_jax._src.resize import resize_state
from qsgd_jax._src.sharding import state_partition_specs
from qsgd_jax._src.stats import CompressionStats, compression_stats
from qsgd_jax._src.transforms import (
    CompressedAllReduceState,
    compressed_allreduce,
    onebit_sgd,
    qsgd,
)
from qsgd_jax._src.wire import Collective, collectives_in_hlo, wire_bytes
from qsgd_jax._src.zero_aligned_minmax import NearestZeroAlignedMinMax

__version__ = "0.1.0"

__all__ = (
    "LOST_PROCESS_EXIT_CODE",
    "AccumulationState",
    "Cast",
    "Collective",
    "CompressedAllReduceState",
    "CompressionStats",
    "Compressor",
    "DataParallel",
    "EliasSize",
    "Identity",
    "LowPrecisionDecentralizedState",
    "MinMax",
    "NearestZeroAlignedMinMax",
    "OneBit",
    "Payload",
    "ProcessWatch",
    "QSGD",
    "SharedScaleCompressor",
    "accumulate_gradients",
    "as_varying",
    "averaged_params",
    "collectives_in_hlo",
    "compressed_allreduce",
    "compression_stats",
    "consensus_distance",
    "data_parallel",
    "elias",
    "initialize_distributed",
    "low_precision_decentralized",
    "onebit_sgd",
    "qsgd",
    "quantized_pmean",
    "quantized_psum",
    "quantized_psum_scatter",
    "resize",
    "resize_state",
    "state_partition_specs",
    "wire_bytes",
)
