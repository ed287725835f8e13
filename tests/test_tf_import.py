"""How towerflow's processes import TensorFlow: without Keras's optional scikit-learn and matplotlib
(importable afterwards), without TensorFlow's early C++ log lines below the level, and with GPUs
hidden where the process uses none. In fresh processes, as an actor's or the CLI's is."""

from __future__ import annotations

import subprocess
import sys

from support import printed_by_a_fresh_process

from towerflow.tf_import import UNUSED_WHILE_TENSORFLOW_LOADS, kept_early_log

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

# As TensorFlow 2.21 printed them in `make example` on this machine (no GPU, no CUDA driver).
_EARLY_STDERR = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795358626.001266   31081 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results.
I0000 00:00:1795358626.001614   31081 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1795357629.626961    6595 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions.
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
/site-packages/somewhere.py:3: UserWarning: a Python warning of the user's
E0000 00:00:1795358685.241259   31142 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
W0000 00:00:1795358685.241300   31142 gpu_device.cc:2344] Cannot dlopen some GPU libraries.
E0000 00:00:1795358685.241400   31142 some_op.cc:12] a real error
"""


def test_early_log_lines_below_the_level_are_dropped_and_the_rest_kept():
    kept = kept_early_log(_EARLY_STDERR, min_level=2, gpus=True).splitlines()
    assert kept == [
        "/site-packages/somewhere.py:3: UserWarning: a Python warning of the user's",
        _EARLY_STDERR.splitlines()[6],  # CUDA failing matters where the process wants a GPU
        "E0000 00:00:1795358685.241400   31142 some_op.cc:12] a real error",
    ]
    without_gpus = kept_early_log(_EARLY_STDERR, min_level=2, gpus=False).splitlines()
    assert without_gpus == [kept[0], kept[2]]
    assert kept_early_log(_EARLY_STDERR, min_level=0) == _EARLY_STDERR  # TF_CPP_MIN_LOG_LEVEL=0: all


def test_an_actor_loads_tensorflow_without_kerass_optional_packages_which_stay_importable():
    assert printed_by_a_fresh_process(_IMPORT_AS_AN_ACTOR) == [
        "loaded: []",
        "keras sees sklearn: False",
        "meta_path restored: True",
        "importable afterwards: BaseEstimator matplotlib.pyplot",
    ]


def test_a_process_without_gpus_imports_tensorflow_quietly_with_gpus_hidden():
    code = (
        "import sys\n"
        "from towerflow.tf_import import import_tensorflow\n"
        "tf = import_tensorflow(gpus=False)\n"
        "print('visible GPUs:', tf.config.get_visible_devices('GPU'))\n"
        "print('after the import', file=sys.stderr)\n"
        "tf.constant(1.0) + 1.0  # the context starts: no CUDA probing left to log\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "visible GPUs: []"
    assert done.stderr.strip() == "after the import", done.stderr


_IMPORT_AS_A_SHARD = """
import sys
from towerflow.runtime.tf_setup import configure_tensorflow, TFProcessConfig

configure_tensorflow(TFProcessConfig(cpus=1, keras=False))
import tensorflow as tf
print("loaded:", sorted({name.partition(".")[0] for name in sys.modules} & {"keras", "sklearn", "matplotlib"}))
print("runs:", float(tf.reduce_sum(tf.ones([3]))))
import keras  # a user's own code in the process may still use it
print("importable afterwards:", type(tf.keras.layers.Dense(2)).__name__, keras.Sequential.__name__)
"""


def test_a_process_that_builds_no_model_loads_tensorflow_without_keras_which_stays_importable():
    assert printed_by_a_fresh_process(_IMPORT_AS_A_SHARD) == [
        "loaded: []",
        "runs: 3.0",
        "importable afterwards: Dense Sequential",
    ]


_KERAS_AFTER_A_KERAS_FREE_IMPORT = """
import sys
from towerflow.tf_import import import_tensorflow

import_tensorflow(gpus=False, keras=False)  # a driver reading a checkpoint's model part
print("loaded:", sorted({name.partition(".")[0] for name in sys.modules} & {"keras", "sklearn", "matplotlib"}))
tf = import_tensorflow(gpus=False)  # then exporting the model: Keras now, lean
print("loaded:", sorted({name.partition(".")[0] for name in sys.modules} & {"keras", "sklearn", "matplotlib"}))
import keras
print("builds:", keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]).count_params())
"""


def test_keras_asked_for_after_a_keras_free_import_comes_lean():
    assert printed_by_a_fresh_process(_KERAS_AFTER_A_KERAS_FREE_IMPORT) == [
        "loaded: []",
        "loaded: ['keras']",
        "builds: 3",
    ]
