"""Synthetic data sets, generated locally: nothing is downloaded."""

from towerflow.data.synth.mnist import synth_mnist

__all__ = ["synth_mnist"]
