"""The `kvgate` command: the one dispatch table from subcommand to the package that implements it (kvgate.cli)."""
