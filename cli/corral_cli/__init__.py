"""The `corral` command: one entry point whose subcommands live in `cmd_*` modules."""
