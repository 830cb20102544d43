"""Which of the emulator's instances a request goes to (`workload.routing`), by the rule the
simulator applies at arrival (kvsim.sim.run): least_loaded, the first of the instances with
the fewest requests counted there; round_robin, by the order requests are routed. kv_aware
reads the simulator's per-instance prefix caches, which the transport does not keep: the
transport's config allows it with one instance only (kvsim.transport.config), where every
rule picks that one."""

from __future__ import annotations

ROUTINGS = ("least_loaded", "round_robin")


def instance_routing(routing: str) -> str:
    """workload.routing as the transport's instances apply it (kv_aware: one instance)."""
    return "least_loaded" if routing == "kv_aware" else routing


def check_routing(routing: str, what: str) -> str:
    """`routing` if the transport routes `what` (prefills, decodes) by it; else ValueError."""
    if routing not in ROUTINGS:
        raise ValueError(f"the transport routes {what} {' or '.join(ROUTINGS)}, "
                         f"got {routing!r}")
    return routing


def route_index(loads: list[int], routing: str, routed: int) -> int:
    """The instance for the next request: loads[i], the requests counted on instance i;
    routed, how many requests were routed before this one."""
    if routing == "round_robin":
        return routed % len(loads)
    return loads.index(min(loads))


__all__ = ["ROUTINGS", "check_routing", "instance_routing", "route_index"]
