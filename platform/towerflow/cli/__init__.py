"""Command line: towerflow train | data."""
