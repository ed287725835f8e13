"""An actor's TensorFlow threads: from the CPUs Ray gave it, never more than its node's cores."""

from support import printed_by_a_fresh_process

from towerflow.runtime.cluster import machine_cores


def _threads(cpus: float) -> list[str]:
    code = (
        "from towerflow.runtime.tf_setup import configure_tensorflow, TFProcessConfig\n"
        f"configure_tensorflow(TFProcessConfig(cpus={cpus}, keras=False))\n"
        "import tensorflow as tf\n"
        "print(tf.config.threading.get_intra_op_parallelism_threads(),"
        " tf.config.threading.get_inter_op_parallelism_threads())\n"
    )
    return printed_by_a_fresh_process(code)


def test_threads_follow_the_cpus_given_up_to_the_cores_here():
    # A node may declare more logical CPUs to Ray than it has cores (the local test clusters do), and
    # `cpus_per_worker: auto` on a cluster joined sizes workers from what Ray declares.
    cores = machine_cores()
    assert _threads(64) == [f"{cores} {min(2, cores)}"]
    assert _threads(0.5) == ["1 1"]


def test_a_process_is_set_up_once_and_asked_again_alike_gets_the_same_devices():
    """A kept actor's next run (runtime/actor_pool.py) asks again: settings alike (0.5 and 1 CPU
    are one thread) give the devices of the first set-up; others cannot be had once TensorFlow runs."""
    code = (
        "from towerflow.runtime.tf_setup import configure_tensorflow, TFProcessConfig\n"
        "print(configure_tensorflow(TFProcessConfig(cpus=1, towers=2, keras=False)))\n"
        "import tensorflow as tf\n"
        "tf.constant(1.0) + 1.0\n"
        "print(configure_tensorflow(TFProcessConfig(cpus=0.5, towers=2, keras=False)))\n"
        "try:\n"
        "    configure_tensorflow(TFProcessConfig(cpus=1, towers=1, keras=False))\n"
        "except RuntimeError as exc:\n"
        "    print('refused:', 'set up already' in str(exc))\n"
    )
    assert printed_by_a_fresh_process(code) == [
        "['/CPU:0', '/CPU:1']",
        "['/CPU:0', '/CPU:1']",
        "refused: True",
    ]
