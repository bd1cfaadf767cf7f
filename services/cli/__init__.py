"""The `headrace` command line: subcommands and the flag definitions."""
