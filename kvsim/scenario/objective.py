"""The time a ranking or a figure is about, named as a row metric: `ttft_s`,
`ttft_committed_s`, `ttkt_s.K`, `ttkt_committed_s.K` (seconds from request arrival; committed:
a drafted token counts once verified). kvsim advise ranks by one; its figures label it."""

from __future__ import annotations

# what an objective may name: a row metric, and for the TTKT ones `.k` (a TTKT point)
OBJECTIVES = ("ttft_s", "ttft_committed_s", "ttkt_s", "ttkt_committed_s")


def objective_key(objective: str) -> tuple[str, int | None]:
    """'ttkt_committed_s.32' -> ('ttkt_committed_s', 32); 'ttft_s' -> ('ttft_s', None)."""
    name, _, k = str(objective).partition(".")
    if name not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: choose one of ttft_s, ttft_committed_s, "
                         "ttkt_s.K, ttkt_committed_s.K")
    if name.startswith("ttkt"):
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"objective {objective!r}: {name} needs a token index, e.g. "
                             f"{name}.32")
        return name, int(k)
    if k:
        raise ValueError(f"objective {objective!r}: {name} takes no .K")
    return name, None


def objective_words(objective: str) -> str:
    """'ttkt_committed_s.32' -> 'committed TT32T'; 'ttft_s' -> 'drafted TTFT'."""
    name, k = objective_key(objective)
    return ("committed " if "committed" in name else "drafted ") + (f"TT{k}T" if k else "TTFT")
