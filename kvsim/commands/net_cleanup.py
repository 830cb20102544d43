"""Remove network namespaces that a killed emulation run left behind.

`shaped_link` (kvsim/transport/netns.py) always removes its two namespaces, but a run
killed with SIGKILL cannot. This finds namespaces named <prefix><6 hex><role letter>,
kills what still runs inside them and deletes them (their veth pair and qdiscs go with
them). Namespaces whose owning process is still alive are a link in use: kept unless
force=true. dry_run=true only lists."""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.core.errors import UsageError
from kvsim.core.report import format_table
from kvsim.transport.netns import DEFAULT_PREFIX, NetnsError, cleanup, leftovers

COMMAND = ("net", "cleanup")
HELP = "remove network namespaces and veths left by killed link-emulation runs"
CONFIG_NAME = "net_cleanup"


@dataclass
class Config:
    prefix: str = DEFAULT_PREFIX
    dry_run: bool = False
    force: bool = False


def _status(owner_alive: bool, removed: bool, cfg: Config) -> str:
    if removed:
        return "removed"
    if owner_alive and not cfg.force:
        return "kept (owner alive)"
    return "would remove" if cfg.dry_run else "gone before removal"


def run(cfg: Config) -> list[dict]:
    try:
        found = leftovers(cfg.prefix)
        removed = set() if cfg.dry_run else set(cleanup(cfg.prefix, force=cfg.force))
    except NetnsError as exc:
        raise UsageError(f"{exc} (network namespaces need root)") from exc
    rows = [{"netns": item.netns, "owner_pid": item.owner_pid,
             "status": _status(item.owner_alive, item.netns in removed, cfg)}
            for item in found]
    if not rows:
        print(f"nothing to remove (no network namespace named {cfg.prefix}<6 hex><s|r|p>)")
        return rows
    print(format_table(rows, [("netns", "netns", ""), ("owner_pid", "owner_pid", "d"),
                              ("status", "status", "")]))
    return rows
