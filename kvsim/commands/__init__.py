"""One module per `kvsim` subcommand (discovered by kvsim.cli.main)."""
