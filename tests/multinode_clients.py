"""Client scripts the multi-node tests run on the cluster (`python -c SCRIPT [args]` with the
cluster's environment); each prints a JSON report on its last line."""

# Client-script lines, after `node` (a node id) is set: an actor holds all the node's CPUs but half of
# one, as a worker beside a read task's share does; `here` pins a task to the node.
HOLD_ALL_BUT_HALF_A_CPU = """
here = NodeAffinitySchedulingStrategy(node, soft=False)
cpus = next(n["Resources"]["CPU"] for n in ray.nodes() if n["NodeID"] == node)


@ray.remote
class Holder:
    def pid(self):
        return os.getpid()


holder = Holder.options(num_cpus=cpus - 0.5, scheduling_strategy=here).remote()
ray.get(holder.pid.remote())
"""

# Does a node keep an idle task worker while actors hold its CPUs? Ray kills idle workers after 1 s
# while a node has more of them than whole free CPUs; towerflow's nodes keep them (RAY_NODE_ENV). An
# actor holds all the node's CPUs but half of one, a task runs on that half, its process idles
# `IDLE_S` and is then looked for. Run as
# `python -c IDLE_WORKER_CLIENT <node id>` with RAY_ADDRESS, or `... embedded` for towerflow's
# embedded Ray. Prints {"first": pid, "kept": the pid still lives, "second": the next task's pid}.
IDLE_WORKER_CLIENT = """
import json
import os
import sys
import time

import psutil

from towerflow.runtime.cluster import ResourceBudget, ensure_ray, keep_embedded_ray_local

IDLE_S = 4.0
if sys.argv[1] == "embedded":
    keep_embedded_ray_local()  # before Ray's import, as the towerflow command does
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if sys.argv[1] == "embedded":
    ensure_ray(ResourceBudget(0, 0, 0, 0))
    node = ray.get_runtime_context().get_node_id()
else:
    ray.init(logging_level="ERROR", log_to_driver=False)
    node = sys.argv[1]
"""
IDLE_WORKER_CLIENT += HOLD_ALL_BUT_HALF_A_CPU
IDLE_WORKER_CLIENT += """

@ray.remote(num_cpus=0.5)
def pid():
    return os.getpid()


first = ray.get(pid.options(scheduling_strategy=here).remote())
time.sleep(IDLE_S)
kept = psutil.pid_exists(first) and psutil.Process(first).status() != psutil.STATUS_ZOMBIE
second = ray.get(pid.options(scheduling_strategy=here).remote())
print(json.dumps({"first": first, "kept": kept, "second": second}))
"""

# Three actors spread over the nodes; one puts a 1 MB array into its node's object store, an actor on
# another node reads it (a transfer between object stores), and Ray then knows both copies.
SPREAD_CLIENT = """
import json
import time

import numpy as np
import ray

ray.init(logging_level="ERROR", log_to_driver=False)


@ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
class Probe:
    def node(self):
        return ray.get_runtime_context().get_node_id()

    def put(self):
        return [ray.put(np.arange(250_000, dtype=np.int32))]  # in a list: the caller gets the ref

    def total(self, refs):
        return int(ray.get(refs[0]).sum())


probes = [Probe.remote() for _ in range(3)]
nodes = ray.get([p.node.remote() for p in probes])
(ref,) = ray.get(probes[0].put.remote())
total = ray.get(probes[1].total.remote([ref]))
for _ in range(50):  # the reader's node tells the owner of its copy asynchronously
    locations = ray.experimental.get_object_locations([ref])[ref]["node_ids"]
    if nodes[1] in locations:
        break
    time.sleep(0.1)
print(json.dumps({"nodes": nodes, "total": total, "locations": locations}))
"""


# The data pipelines' claims on the cluster's cores on record (data/claims.py): coordinator -> requester.
CLAIMS_CLIENT = """
import json

import ray

ray.init(logging_level="ERROR", log_to_driver=False)
from towerflow.data import claims

print(json.dumps(claims.recorded()))
"""


# A spare fills a node that has just joined but for a read task's share; the node readies a process
# for reading (data/reader_warmup.py), then a Ray Data map task runs there. Prints the readied
# process's pid and the map task's: its pid, and whether TensorFlow was imported before it began.
WARM_READER_CLIENT = """
import json
import os
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from towerflow.data.features import ColumnPlan
from towerflow.data.ingest import ShardReader
from towerflow.data.reader_warmup import warm_reader_process

ray.init(logging_level="ERROR", log_to_driver=False)
node = sys.argv[1]
"""
WARM_READER_CLIENT += HOLD_ALL_BUT_HALF_A_CPU  # the spare
WARM_READER_CLIENT += """
warmed = ray.get(warm_reader_process(ShardReader("tfrecord", {}, ColumnPlan({})), node))


def where(batch):
    return {"pid": [os.getpid()], "tensorflow": ["tensorflow" in sys.modules]}


read = ray.data.from_items([{"x": 0}]).map_batches(
    where, batch_size=1, num_cpus=0.5, scheduling_strategy=here
).take_all()[0]
print(json.dumps({"warmed": warmed, "read_pid": int(read["pid"]), "tensorflow": bool(read["tensorflow"])}))
"""


# A run's placement groups under spread and each strict strategy (runtime/placement.py), reserved
# and released: the node of each bundle (shards first). 2 shards and 2 workers of small reservations
# fit on one 2-CPU node.
PLACEMENT_CLIENT = """
import json

import ray

from towerflow.runtime.placement import ActorPlacement
from towerflow.spec.schema import ClusterSpec

ray.init(logging_level="ERROR", log_to_driver=False)
nodes = {}
for strategy, workers in (("spread", 2), ("strict_pack", 2), ("strict_spread", 1)):
    cluster = ClusterSpec(workers=workers, ps=2, cpus_per_worker=0.5, cpus_per_ps=0.25, placement=strategy)
    placement = ActorPlacement(cluster, f"probe-{strategy}")
    placement.reserve()
    nodes[strategy] = [node for _, node in sorted(placement.node_of().items())]
    placement.release()
print(json.dumps(nodes))
"""

# Holds every CPU of node argv[1] until this client is killed (its actor goes with it): keeps a
# run's actors off that node. Prints {"held": cpus} once the actor holds them.
HOLD_NODE_CLIENT = """
import json
import os
import sys
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(logging_level="ERROR", log_to_driver=False)
node = sys.argv[1]
cpus = next(n["Resources"]["CPU"] for n in ray.nodes() if n["NodeID"] == node)


@ray.remote
class Holder:
    def pid(self):
        return os.getpid()


holder = Holder.options(num_cpus=cpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
ray.get(holder.pid.remote())
print(json.dumps({"held": cpus}), flush=True)
time.sleep(3600)
"""


# A shard stand-in on the node with the "drains" resource, in a placement group's bundle: prints its
# node, then watches (as the driver does, runtime/draining.py) until that node drains, prints what
# the watch told, and stays until killed.
DRAIN_WATCH_CLIENT = """
import json
import time

import ray

from towerflow.runtime.draining import DrainWatch

ray.init(logging_level="ERROR", log_to_driver=False)


@ray.remote(num_cpus=0, resources={"drains": 1})
class Shard:
    def node(self):
        return ray.get_runtime_context().get_node_id()


# In a placement group's bundle, as a run's shards are (a bundle keeps a draining node until its deadline).
group = ray.util.placement_group([{"drains": 1}])
ray.get(group.ready())
in_bundle = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(group, 0)
shard = Shard.options(scheduling_strategy=in_bundle).remote()
print(json.dumps({"placed": ray.get(shard.node.remote())}), flush=True)
watch, deadline, notices = DrainWatch(), time.monotonic() + 60, []
while not notices and time.monotonic() < deadline:
    time.sleep(0.2)
    notices = watch.look([shard])
told = [{"node": n.node_id, "shards": n.shards, "in_s": n.deadline_in_s, "says": n.describe()} for n in notices]
print(json.dumps({"told": told, "draining": watch.shards_draining}), flush=True)
time.sleep(120)  # the shard stays until the test is done (a job's end would free the node at once)
"""


# Ends what runs a failed test left on its module's cluster: every run's control point (towerflow's
# namespace) and every placement group still held (its kept shards and workers end with it).
# Prints what it ended.
END_RUNS_CLIENT = """
import json

import ray
from ray.util import placement_group_table, remove_placement_group
from ray.util.placement_group import PlacementGroup

from towerflow.runtime.run_control import NAMESPACE

ray.init(logging_level="ERROR", log_to_driver=False)
ended = []
for actor in ray.util.list_named_actors(all_namespaces=True):
    if actor["namespace"] == NAMESPACE:
        ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))
        ended.append(actor["name"])
for group_id, group in placement_group_table().items():
    if group["state"] != "REMOVED":
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(group_id)))
        ended.append(group["name"] or group_id)
print(json.dumps(ended))
"""


# A kept run's control point on the node argv[1] (a soft affinity, as a driver's own). Prints where
# it was placed; once told on stdin that the node is lost, asks it as its driver does at every
# `confirm` (as one whose lease has lapsed) until it has not answered and answered again (Ray
# started it again elsewhere), 90 s at most, and meanwhile as a resume does (`_first_answer`).
# Prints what they heard: whether `confirm` stopped the driver, and why; the resume's answer.
CONTROL_POINT_CLIENT = """
import json
import sys
import threading
import time
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from towerflow.errors import RunTakenOver
from towerflow.runtime import run_control, run_keeper
from towerflow.runtime.run_control import NAMESPACE, ControlPoint, RunControl, control_name

ray.init(logging_level="ERROR", log_to_driver=False)
run_control.ASK_AFTER_S = 0.0  # ask at every confirm, not only after 5 s without a renewal
there = NodeAffinitySchedulingStrategy(sys.argv[1], soft=True)
for _ in range(30):  # a soft affinity to a node that has just joined may be passed over
    run_id = uuid.uuid4().hex
    actor = RunControl.options(
        name=control_name(run_id), namespace=NAMESPACE, lifetime="detached", scheduling_strategy=there
    ).remote(run_id, 60.0, (), uuid.uuid4().hex)
    placed = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
    if placed == sys.argv[1]:
        break
    ray.kill(actor)
    time.sleep(1)
control = ControlPoint(run_id, actor=actor)
control.keep()
print(json.dumps({"placed": placed}), flush=True)
sys.stdin.readline()  # the node is lost
resumed = {}


def resume():
    try:
        resumed["driver_job"] = run_keeper._first_answer(run_id, actor)
    except Exception as exc:
        resumed["error"] = f"{type(exc).__name__}: {exc}"


asking = threading.Thread(target=resume)
asking.start()
unanswered, stopped, deadline = 0, None, time.monotonic() + 90
while time.monotonic() < deadline:
    try:
        control.confirm()
    except RunTakenOver as exc:
        stopped = str(exc)
        break
    try:
        ray.get(actor.driver_job.remote(), timeout=1)
        if unanswered:
            break
    except ray.exceptions.RayError:
        unanswered += 1
    time.sleep(0.2)
answered_again = time.monotonic() < deadline
asking.join()
job = ray.get_runtime_context().get_job_id()
print(json.dumps({"stopped": stopped, "unanswered": unanswered, "answered_again": answered_again,
                  "resume_heard": resumed, "job": job}))
control.end_the_run()
"""
