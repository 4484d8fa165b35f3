"""Selective disaggregation: does a request's prompt go to a prefill replica, its KV handed over to a decode
replica, or does the whole request run on a decode replica?

Handing a prompt's KV over costs a transfer and a second hop; it pays when the prompt needs much computing (a long
uncached prompt would otherwise stall the decode batch it joins) and the prefill group has room. `split(...)`
decides from two snapshots, in this order:
1. no prefill replica can take it (none ready, all at their gate): aggregated, `no-prefill-replica`;
2. the prompt's uncached part on the decode replica best placed for it (prompt tokens less the longest prefix a
   decode candidate is believed to hold) is under `min_prefill_tokens`: aggregated, `short-prompt` (computing it
   costs less than handing it over);
3. every prefill candidate would queue it for a batch slot (`policies.cache_aware.expected_waiting` > 0) while a
   decode candidate has a free slot: aggregated, `prefill-saturated`;
4. otherwise split: `split`.
Pure: tested on literal snapshots. O(replicas).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from policies.base import ReplicaState
from policies.cache_aware import expected_waiting
from policies.filters import routable


class Split(NamedTuple):
    split: bool
    reason: str  # split | no-prefill-replica | short-prompt | prefill-saturated


def split(
    prompt_tokens: int,
    block_size: int,
    prefill: Sequence[ReplicaState],
    decode: Sequence[ReplicaState],
    decode_overlap: Mapping[str, int],
    *,
    min_prefill_tokens: int,
) -> Split:
    prefill_ok = routable(prefill)
    if not prefill_ok:
        return Split(False, "no-prefill-replica")
    decode_ok = routable(decode)
    held = max((decode_overlap.get(r.id, 0) for r in decode_ok), default=0)
    if prompt_tokens - held * block_size < min_prefill_tokens:
        return Split(False, "short-prompt")
    if all(expected_waiting(r) > 0 for r in prefill_ok) and any(expected_waiting(r) <= 0 for r in decode_ok):
        return Split(False, "prefill-saturated")
    return Split(True, "split")
