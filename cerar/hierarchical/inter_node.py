"""Tier 2, between nodes: each local rank's shard reduced over its rail, the ring of the n ranks
with that local rank (rail rank i = node i).

CERAR runs there with a code for n workers, not for N = n G: per node, the rails together send
L m G ~ (1 + (n-2)/c) d values (the shard is d/G long and each of the G rails carries one), where
the exact ring on the rails sends 2 (n-1)/n d. So the coded step saves bytes only for c > n and
n > 2: with two nodes both send d. Which method a call runs (``rail_method``):

- ``"cerar"``: the code's rounds (``cerar.all_reduce``); node n - 1 decodes exactly under the
  closed-form constructions, so every rank of the last node holds the exact result;
- ``"exact ring"``: ``cerar.ring_all_reduce`` on the rail: the hierarchical baseline; also what
  ``hierarchical_all_reduce`` runs on two nodes unless told otherwise (CERAR's error for no bytes);
- ``"none"``: one node, nothing to do between nodes: the call is exact.
"""

from __future__ import annotations

import warnings

import torch

from cerar.coding.codes import Code
from cerar.ring.protocol import AllReduceStats, all_reduce, ring_all_reduce
from cerar.ring.transport import CollectiveError

RAIL_METHODS = ("cerar", "exact ring", "none")


class HierarchicalWarning(UserWarning):
    """A hierarchical call does something other than what its name suggests (exact on one node, the
    exact rail on two): said once per process and message."""


_said: set[str] = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        warnings.warn(message, HierarchicalWarning, stacklevel=4)


def method_between_nodes(nodes: int, coded: bool, coded_on_two_nodes: bool = False) -> str:
    """What runs between ``nodes`` nodes when a call asks for CERAR (``coded``) or for the exact ring:
    "none" on one node, the exact ring on two unless ``coded_on_two_nodes`` (both send d per node),
    else what was asked."""
    if nodes == 1:
        return "none"
    if not coded or (nodes == 2 and not coded_on_two_nodes):
        return "exact ring"
    return "cerar"


def rail_method(nodes: int, coded: bool, coded_on_two_nodes: bool, operation: str) -> str:
    """``method_between_nodes``, with a one-time warning where that is not what was asked."""
    method = method_between_nodes(nodes, coded, coded_on_two_nodes)
    if coded and method == "none":
        say_once(f"{operation}: the layout has one node: the call is exact (inside the node only), nothing is coded")
    elif coded and method == "exact ring":
        say_once(
            f"{operation}: on 2 nodes the coded rail sends as many bytes as the exact ring (d per node either way), "
            "so the exact ring runs between the nodes instead of paying CERAR's error for nothing "
            "(coded_on_two_nodes=True runs the code anyway)"
        )
    return method


def reduce_on_rail(
    shard: torch.Tensor,
    method: str,
    code: Code | None,
    rail,
    op: str,
    timeout,
    storage: str,
    timed: bool,
    operation: str,
    local_rank: int,
    transport=None,
) -> AllReduceStats:
    """``shard`` reduced in place over the rail by ``method``; a failure is re-raised naming the rail."""
    try:
        if method == "cerar":
            return all_reduce(
                shard, code, rail, op=op, timeout=timeout, storage=storage, timed=timed, transport=transport
            )
        if method == "exact ring":
            return ring_all_reduce(shard, rail, op=op, timeout=timeout, timed=timed, transport=transport)
    except CollectiveError as error:
        raise CollectiveError(f"{operation}: between the nodes, on rail {local_rank}: {error}") from error
    return AllReduceStats()
