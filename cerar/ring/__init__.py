"""The ring: CERAR's coded all-reduce and the exact ring, on ``torch.distributed`` (gloo and NCCL, one code path).

``transport`` posts each round's sends and receives and bounds every wait; ``rounds`` is one rank's arithmetic
per round (the spec's encode with A_j and decode with D_i); ``workspace`` the storage kept between calls;
``checks`` what every rank must agree on before a call; ``protocol`` the collectives themselves
(``all_reduce``, ``ring_all_reduce``); ``graphs`` a call replayed from a CUDA graph where its shapes repeat
(opt-in). Their numerics: ``fp32_products`` (no TF32 in a product),
``precision`` (what error a code may add on a wire dtype), ``oracle`` and ``simulate`` (all N ranks in one
process, the reference the tests hold the ring to), ``equilibrate`` (per-tensor power-of-two scales, agreed
across ranks, around the ring and the 16-bit all-reduce).
"""
