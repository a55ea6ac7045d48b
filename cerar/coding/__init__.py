"""The codes: which linear codes CERAR mixes the components with, and how they are built.

A code for N workers and c components is the spec's encoders A_j and decoders D_i (``codes.Code``,
``codes.make_code``). The constructions: the closed forms (``closed_forms``: exact, Vandermonde, perturbation),
the optimized search over points (``optimize``) and its shipped and cached results (``stored_codes``,
``data/optimized_codes.json``); ``matrices`` lays a code out as the tensors the ring multiplies by. Nothing here
communicates: the ring (``cerar.ring``) runs these codes, the planning tools (``cerar.planning.design``) choose
among them.
"""
