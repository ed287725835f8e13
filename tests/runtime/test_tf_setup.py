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
