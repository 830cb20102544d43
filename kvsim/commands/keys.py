"""Make CURVE keys for the transport (`kvsim serve` / `send` / `emulate`): a directory with
the decode host's pair (server.key, server.key_secret), a prefill host's pair
(<client>.key, <client>.key_secret) and allowed/ holding the public keys `kvsim serve`
admits. An existing server pair is kept (several clients share it); an existing client pair
is replaced only with force=true. Copy server.key_secret + allowed/ to the decode host and
<client>.key_secret + server.key to the prefill host (kvsim.transport.auth)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsim.transport.auth import ALLOWED_DIR, CLIENT, write_keys

COMMAND = ("keys",)
HELP = "make CURVE keys that authenticate and encrypt kvsim serve / send (transport.keys)"
CONFIG_NAME = "keys"


@dataclass
class Config:
    dir: str = ""  # the keys directory to write (made with mode 0700)
    client: str = CLIENT  # the client pair's name: <client>.key, <client>.key_secret
    force: bool = False  # replace an existing <client> pair

    def validate(self) -> None:
        if not self.dir:
            raise ValueError("kvsim keys needs dir=DIR (the keys directory to write)")


def run(cfg: Config) -> list[dict]:
    cfg.validate()
    directory = Path(cfg.dir).expanduser().absolute()
    written = write_keys(directory, cfg.client, cfg.force)
    rows = [{"file": name, "path": str(path)} for name, path in written.items()]
    print(f"wrote in {directory}:")
    for name in written:
        print(f"  {name}")
    print(f"decode host: copy server.key_secret and {ALLOWED_DIR}/ to its DIR, then")
    print("  kvsim serve transport.keys=DIR transport.bind=tcp://0.0.0.0:5557")
    print(f"prefill host: copy {cfg.client}.key_secret and server.key to its DIR, then")
    print("  kvsim send transport.keys=DIR transport.connect=tcp://DECODE_HOST:5557")
    print(f"(one machine, kvsim emulate: transport.keys={directory})")
    return rows
