"""Command line: `towerflow` and its subcommands, one module per command group; main.py dispatches."""
