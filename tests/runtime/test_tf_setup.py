"""An actor's TensorFlow import: without Keras's optional scikit-learn and matplotlib, which stay
importable afterwards (in a fresh process, as an actor's is)."""

from __future__ import annotations

import subprocess
import sys

from towerflow.runtime.tf_setup import UNUSED_WHILE_TENSORFLOW_LOADS

_IMPORT_AS_AN_ACTOR = f"""
import sys
from towerflow.runtime.tf_setup import configure_tensorflow, TFProcessConfig

configure_tensorflow(TFProcessConfig(cpus=1))
import keras
from keras.src.wrappers import fixes
print("loaded:", sorted({{name.partition(".")[0] for name in sys.modules}} & set({UNUSED_WHILE_TENSORFLOW_LOADS!r})))
print("keras sees sklearn:", fixes.sklearn is not None)
print("meta_path restored:", not any(type(f).__name__ == "_Refuse" for f in sys.meta_path))
import sklearn.base, matplotlib.pyplot  # a user's own code in the actor may still use them
print("importable afterwards:", sklearn.base.BaseEstimator.__name__, matplotlib.pyplot.__name__)
"""


def test_tensorflow_loads_without_kerass_optional_packages_which_stay_importable():
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_AS_AN_ACTOR], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "loaded: []",
        "keras sees sklearn: False",
        "meta_path restored: True",
        "importable afterwards: BaseEstimator matplotlib.pyplot",
    ], done.stdout
