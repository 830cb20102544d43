"""Which prefill and decode instance a request goes to (`workload.routing`).

- least_loaded (the default): the instance with the fewest requests routed to it and not yet
  through it (prefill: not yet prefilled; decode: not finished), the first of equals;
- round_robin: instances in turn, whatever their load;
- kv_aware: the instance whose prefix cache holds the longest lead of the request's blocks,
  among those loaded at most `load_slack` requests above the least loaded (a bound, so that
  a popular prefix does not pile its requests on one instance); equal matches go to the
  least loaded, then the first. With no match anywhere it is least_loaded.
"""

from __future__ import annotations

ROUTINGS = ("least_loaded", "round_robin", "kv_aware")


def least_loaded(load: list[int]) -> int:
    return load.index(min(load))


def kv_aware(load: list[int], matched_blocks: list[int], load_slack: int) -> int:
    """The instance to take: load[i] requests on instance i, matched_blocks[i] of the
    request's leading blocks held there."""
    bound = min(load) + load_slack
    best = -1
    for i, (n, m) in enumerate(zip(load, matched_blocks, strict=True)):
        if n > bound:
            continue
        if best < 0 or m > matched_blocks[best] or (m == matched_blocks[best] and
                                                     n < load[best]):
            best = i
    return best
