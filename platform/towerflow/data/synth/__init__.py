"""Synthetic data sets, generated locally: nothing is downloaded."""

from towerflow.data.synth.mnist import synth_mnist
from towerflow.data.synth.ptb import synth_ptb
from towerflow.data.synth.tabular import synth_tabular

GENERATORS = {"mnist": synth_mnist, "ptb": synth_ptb, "tabular": synth_tabular}

__all__ = ["GENERATORS", "synth_mnist", "synth_ptb", "synth_tabular"]
