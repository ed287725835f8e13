"""`python -m towerflow ...` is the same command as `towerflow ...` (what `ray job submit` runs)."""

from towerflow.cli.main import run

if __name__ == "__main__":
    run()
