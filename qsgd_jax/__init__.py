"""qsgd_jax: quantized gradient communication for JAX.

Compressors (:class:`QSGD`, :class:`MinMax`, :class:`NearestZeroAlignedMinMax`,
:class:`NearestAbsMax`, :class:`OneBit`, :class:`Cast`, :class:`Identity`, the sparse
:class:`TopK`), the
Elias omega codec (:mod:`qsgd_jax.elias`), quantized collectives
(:func:`quantized_psum`, :func:`quantized_pmean`, :func:`quantized_psum_scatter`,
:func:`quantized_all_gather`, :func:`wire_bytes`), FSDP compressed both ways
(:func:`fsdp_gather`, :func:`fsdp_shard`, :func:`fsdp_remat_policy`; 1-bit Adam under it,
:func:`fsdp_onebit_gather` and :func:`fsdp_onebit_adam`) and optax transformations
(:func:`qsgd`, :func:`onebit_sgd`, :func:`compressed_allreduce`, :func:`powersgd`,
:func:`low_precision_decentralized`, :func:`accumulate_gradients`),
local-update training with a compressed outer exchange (:func:`diloco`: DiLoCo
and Streaming DiLoCo, SparseLoCo's outer average :func:`sparseloco_average`), optimizers
that communicate for themselves (:func:`onebit_adam`, :func:`zero_one_adam`, :func:`demo`,
:func:`dgc`),
and a ``jax.jit`` training step over a mesh that uses them
(:func:`data_parallel`).
For long multi-process runs: :func:`initialize_distributed`, which ends every
process soon after one is lost, and :func:`resize_state` (:mod:`qsgd_jax.resize`),
which resumes per-device state on another number of devices.
"""

from qsgd_jax import elias, resize
from qsgd_jax._src.accumulation import AccumulationState, accumulate_gradients
from qsgd_jax._src.adam.alias import onebit_adam
from qsgd_jax._src.adam.onebit_adam import ScaleByOneBitAdamState, scale_by_onebit_adam
from qsgd_jax._src.adam.zero_one_adam import ZeroOneAdamState, zero_one_adam
from qsgd_jax._src.averaging.alias import onebit_sgd, qsgd
from qsgd_jax._src.averaging.allreduce import CompressedAllReduceState, compressed_allreduce
from qsgd_jax._src.averaging.decentralized import (
    LowPrecisionDecentralizedState,
    averaged_params,
    consensus_distance,
    low_precision_decentralized,
)
from qsgd_jax._src.axes import as_varying
from qsgd_jax._src.base import Compressor, Payload, SharedScaleCompressor
from qsgd_jax._src.collectives.gather import quantized_all_gather
from qsgd_jax._src.collectives.psum import quantized_pmean, quantized_psum, quantized_psum_scatter
from qsgd_jax._src.compressors.baselines import Cast, Identity
from qsgd_jax._src.compressors.minmax import MinMax
from qsgd_jax._src.compressors.nearest_abs_max import NearestAbsMax
from qsgd_jax._src.compressors.onebit import OneBit
from qsgd_jax._src.compressors.qsgd import QSGD, EliasSize
from qsgd_jax._src.compressors.zero_aligned_minmax import NearestZeroAlignedMinMax
from qsgd_jax._src.diloco.exchange import SplitAverageState
from qsgd_jax._src.diloco.fragment import DelayedFragmentState, FragmentState
from qsgd_jax._src.diloco.schedule import DiLoCoEvents, diloco_events
from qsgd_jax._src.diloco.transform import DiLoCoState, diloco
from qsgd_jax._src.distributed import LOST_PROCESS_EXIT_CODE, ProcessWatch, initialize_distributed
from qsgd_jax._src.fsdp.gather import fsdp_gather, fsdp_remat_policy
from qsgd_jax._src.fsdp.onebit import (
    FSDPOneBitAdamState,
    fsdp_onebit_adam,
    fsdp_onebit_error,
    fsdp_onebit_gather,
    scale_by_fsdp_onebit_adam,
)
from qsgd_jax._src.fsdp.onebit_state import (
    FSDPOneBitErrorState,
    fsdp_onebit_step_inputs,
    keep_fsdp_onebit_error,
)
from qsgd_jax._src.fsdp.shards import FlatShard, fsdp_shard
from qsgd_jax._src.participation import AverageOverParticipants
from qsgd_jax._src.powersgd.low_rank import attention_matrix_view
from qsgd_jax._src.powersgd.transform import PowerSGDState, powersgd
from qsgd_jax._src.sparse.demo import ScaleByDemoState, demo, scale_by_demo
from qsgd_jax._src.sparse.dgc import ScaleByDGCState, dgc, scale_by_dgc
from qsgd_jax._src.sparse.sparseloco import SparseLoCoState, sparseloco_average
from qsgd_jax._src.sparse.topk import TopK
from qsgd_jax._src.stats import (
    CompressionStats,
    RunStats,
    accumulate_stats,
    compression_stats,
)
from qsgd_jax._src.training.data_parallel import DataParallel, data_parallel
from qsgd_jax._src.training.partition_specs import state_partition_specs
from qsgd_jax._src.training.resize import resize_state
from qsgd_jax._src.wire import (
    BranchWireBytes,
    Collective,
    collectives_in_hlo,
    wire_bytes,
    wire_bytes_by_branch,
)

__version__ = "0.1.0"

__all__ = (
    "LOST_PROCESS_EXIT_CODE",
    "AccumulationState",
    "AverageOverParticipants",
    "BranchWireBytes",
    "Cast",
    "Collective",
    "CompressedAllReduceState",
    "CompressionStats",
    "Compressor",
    "DataParallel",
    "DelayedFragmentState",
    "DiLoCoEvents",
    "DiLoCoState",
    "EliasSize",
    "FSDPOneBitAdamState",
    "FSDPOneBitErrorState",
    "FlatShard",
    "FragmentState",
    "Identity",
    "LowPrecisionDecentralizedState",
    "MinMax",
    "NearestAbsMax",
    "NearestZeroAlignedMinMax",
    "OneBit",
    "Payload",
    "PowerSGDState",
    "ProcessWatch",
    "QSGD",
    "RunStats",
    "ScaleByDGCState",
    "ScaleByDemoState",
    "ScaleByOneBitAdamState",
    "SharedScaleCompressor",
    "SparseLoCoState",
    "SplitAverageState",
    "TopK",
    "ZeroOneAdamState",
    "accumulate_gradients",
    "accumulate_stats",
    "as_varying",
    "attention_matrix_view",
    "averaged_params",
    "collectives_in_hlo",
    "compressed_allreduce",
    "compression_stats",
    "consensus_distance",
    "data_parallel",
    "demo",
    "dgc",
    "diloco",
    "diloco_events",
    "elias",
    "fsdp_gather",
    "fsdp_onebit_adam",
    "fsdp_onebit_error",
    "fsdp_onebit_gather",
    "fsdp_onebit_step_inputs",
    "fsdp_remat_policy",
    "fsdp_shard",
    "initialize_distributed",
    "keep_fsdp_onebit_error",
    "low_precision_decentralized",
    "onebit_adam",
    "onebit_sgd",
    "powersgd",
    "qsgd",
    "quantized_all_gather",
    "quantized_pmean",
    "quantized_psum",
    "quantized_psum_scatter",
    "resize",
    "resize_state",
    "scale_by_demo",
    "scale_by_dgc",
    "scale_by_fsdp_onebit_adam",
    "scale_by_onebit_adam",
    "sparseloco_average",
    "state_partition_specs",
    "wire_bytes",
    "wire_bytes_by_branch",
    "zero_one_adam",
)
