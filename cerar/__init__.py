"""CERAR: ring-based coded approximate all-reduce for data-parallel training.

Public API:
    make_code(N, c, construction, eps, kappa_max) -> Code     the code (``cerar.coding.codes``)
    simulate(G, code)                                          all N workers in one process
    all_reduce(tensor, code, group, op, timeout) -> stats      CERAR between processes
    ring_all_reduce(tensor, group, op, timeout) -> stats       the exact ring baseline
      (both, the hierarchical calls and the DDP hooks take transport="float32" | "float16" |
      "bfloat16": the dtype on the wire, ``cerar.formats.wire``; default_kappa_max(transport) the code budget)
    cerar.ddp.CerarHookState, cerar.ddp.cerar_hook             the DDP communication hook
    cerar.ddp.transport_group, cerar.ddp.default_bucket_cap_mb CERAR's own process group, its DDP bucket size
    cerar.hierarchical                                         nodes of several ranks: exact inside a node, CERAR
                                                               between nodes (hierarchical_all_reduce, its exact
                                                               baseline, NodeLayout, the DDP hook)
    quantized_all_reduce(tensor, group, op, timeout, block)    the 8-bit all-reduce (cerar.int8.all_reduce; two tiers:
                                                               cerar.int8.two_tier; DDP hooks:
                                                               cerar.int8.hook), docs/int8.md
    int4_all_reduce(tensor, group, op, timeout, block)         the 4-bit all-reduce, blocks rotated
                                                               (cerar.int4.all_reduce; two tiers, 8/4 bits:
                                                               cerar.int4.two_tier), docs/int4.md
    cerar.ring.equilibrate                                          per-tensor power-of-two scales, agreed across ranks:
                                                               equilibrated(tensor, sizes, run) around CERAR (each
                                                               tensor's error relative to its own size), and
                                                               cast_all_reduce(tensor, dtype, sizes), the 16-bit
                                                               all-reduce with a scale per tensor
    full_fp32_products(device)                                 the TF32 guard every CERAR product runs under
    release_workspaces()                                       free the CPU working storage kept between calls
"""

from cerar.coding.codes import CONSTRUCTIONS, DEFAULT_KAPPA_MAX, Code, make_code
from cerar.formats.wire import TRANSPORTS, default_kappa_max
from cerar.int4.all_reduce import int4_all_reduce
from cerar.int8.all_reduce import quantized_all_reduce
from cerar.ring.equilibrate import agreed_scales, apply_scales, cast_all_reduce, equilibrated
from cerar.ring.fp32_products import PrecisionError, full_fp32_products
from cerar.ring.protocol import PROTOCOL_VERSION, AllReduceStats, all_reduce, ring_all_reduce
from cerar.ring.simulate import simulate
from cerar.ring.transport import DEFAULT_TIMEOUT, CollectiveError
from cerar.ring.workspace import release_workspaces

__all__ = [
    "CONSTRUCTIONS",
    "DEFAULT_KAPPA_MAX",
    "DEFAULT_TIMEOUT",
    "TRANSPORTS",
    "default_kappa_max",
    "PROTOCOL_VERSION",
    "AllReduceStats",
    "Code",
    "CollectiveError",
    "PrecisionError",
    "agreed_scales",
    "all_reduce",
    "apply_scales",
    "cast_all_reduce",
    "equilibrated",
    "full_fp32_products",
    "int4_all_reduce",
    "make_code",
    "quantized_all_reduce",
    "release_workspaces",
    "ring_all_reduce",
    "simulate",
]
