import pytest
import yaml
from conftest import REPO

from towerflow.errors import SpecError
from towerflow.spec import apply_override, flatten_spec, load_spec, validate_spec

ISSUE_EXAMPLE = """
name: mnist-sync
model: {ref: models.lenet:build, params: {num_classes: 10}, loss: sparse_categorical_crossentropy, from_logits: true, metrics: [accuracy]}
data:
  train: {paths: "data/mnist/train-*", format: tfrecord, label: label}
  eval:  {paths: "data/mnist/eval-*", format: tfrecord, label: label}
  batch_size: 128
  epochs: 2
cluster: {workers: 2, ps: 2, gpus_per_worker: 0, towers: 1}
training:
  mode: sync
  max_steps: 1000
  replicas_to_aggregate: 2
  total_num_replicas: 2
  max_staleness: null
  optimizer: {name: adam, learning_rate: 0.001}
tracking: {experiment: mnist}
export: {saved_model: true, register_as: mnist-lenet}
"""


def _raw():
    return yaml.safe_load(ISSUE_EXAMPLE)


def _error(raw) -> str:
    with pytest.raises(SpecError) as info:
        validate_spec(raw, source="job.yaml")
    return str(info.value)


def test_issue_example_is_valid():
    spec = validate_spec(_raw())
    assert spec.training.mode == "sync" and spec.replicas_to_aggregate == 2
    assert spec.export.register_as == "mnist-lenet"


@pytest.mark.parametrize("path", ["pipelines/mnist_sync.yaml", "pipelines/mnist_async.yaml"])
def test_shipped_pipelines_are_valid(path):
    assert load_spec(path).model.ref == "models.lenet:build"


def test_unknown_key_is_named():
    raw = _raw()
    raw["cluster"]["wrokers"] = 3
    message = _error(raw)
    assert "job.yaml" in message and "cluster.wrokers" in message and "unknown key" in message


def test_bad_choice_lists_allowed_values():
    raw = _raw()
    raw["training"]["mode"] = "semi"
    message = _error(raw)
    assert "training.mode" in message and "'sync'" in message and "'async'" in message


def test_optimizer_option_must_fit_the_optimizer():
    raw = _raw()
    raw["training"]["optimizer"] = {"name": "adam", "momentum": 0.9}
    assert "momentum does not apply to adam" in _error(raw)


def test_unknown_optimizer_lists_choices():
    raw = _raw()
    raw["training"]["optimizer"]["name"] = "lamb"
    message = _error(raw)
    assert "training.optimizer.name" in message and "rmsprop" in message


def test_learning_rate_schedule():
    raw = _raw()
    raw["training"]["optimizer"]["learning_rate"] = {
        "schedule": "exponential_decay",
        "initial_learning_rate": 0.1,
        "decay_steps": 100,
        "decay_rate": 0.5,
        "staircase": True,
    }
    assert validate_spec(raw).training.optimizer.learning_rate.staircase is True
    del raw["training"]["optimizer"]["learning_rate"]["decay_rate"]
    assert "- training.optimizer.learning_rate: exponential_decay needs decay_steps and decay_rate" in _error(
        raw
    )


def test_a_learning_rate_must_be_positive_and_only_its_own_branch_complains():
    raw = _raw()
    raw["training"]["optimizer"]["learning_rate"] = -0.1
    error = _error(raw)
    assert "- training.optimizer.learning_rate: Input should be greater than 0 (got -0.1)" in error
    assert "dictionary" not in error and "tag:" not in error  # the schedule branch stays silent


def test_replicas_cannot_exceed_workers_in_sync():
    raw = _raw()
    raw["training"]["replicas_to_aggregate"] = 3
    raw["training"]["total_num_replicas"] = None
    assert "wait forever" in _error(raw)


def test_total_num_replicas_must_match_workers():
    raw = _raw()
    raw["training"]["total_num_replicas"] = 4
    assert "cluster.workers" in _error(raw)


def test_max_staleness_is_for_async_only():
    raw = _raw()
    raw["training"]["max_staleness"] = 2
    assert "mode: async" in _error(raw)
    raw["training"]["mode"] = "async"
    assert validate_spec(raw).training.max_staleness == 2


def test_fetch_every_is_for_async_only():
    raw = _raw()
    raw["training"]["fetch_every"] = 2
    assert "training.fetch_every: 2 applies to mode: async only" in _error(raw)
    raw["training"]["mode"] = "async"
    assert validate_spec(raw).training.fetch_every == 2


def test_overlap_push_is_for_async_only():
    raw = _raw()
    raw["training"]["overlap_push"] = True
    assert "training.overlap_push applies to mode: async only" in _error(raw)
    raw["training"]["mode"] = "async"
    assert validate_spec(raw).training.overlap_push is True


def test_never_ending_job_is_refused():
    raw = _raw()
    raw["training"]["max_steps"] = None
    raw["data"]["epochs"] = None
    assert "never end" in _error(raw)


def test_towers_must_match_gpus():
    raw = _raw()
    raw["cluster"].update(gpus_per_worker=2, towers=3)
    assert "cluster.towers" in _error(raw) or "towers: 3" in _error(raw)


def test_overrides_parse_yaml_values(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(ISSUE_EXAMPLE)
    spec = load_spec(
        path, ["training.max_steps=50", "training.mode=async", "cluster.towers=2", "model.params.dropout=0.5"]
    )
    assert spec.training.max_steps == 50 and spec.training.mode == "async"
    assert spec.cluster.towers == 2 and spec.model.params["dropout"] == 0.5


def test_an_error_under_a_key_the_user_named_names_that_key():
    """Pydantic puts union member names ("LearningRateSchedule", "float") into its locations; a
    key of the user's own with a capital letter (a feature group `Wide`) is no such name."""
    with pytest.raises(SpecError, match=r"- data\.train\.groups\.Wide: Input should be a valid list"):
        load_spec(REPO / "pipelines" / "tabular_csv.yaml", ["data.train.groups.Wide=5"])
    with pytest.raises(
        SpecError, match=r"- training\.optimizer\.learning_rate: Input should be greater than 0"
    ):
        load_spec(REPO / "pipelines" / "tabular_csv.yaml", ["training.optimizer.learning_rate=-1"])


def test_override_errors():
    raw = _raw()
    with pytest.raises(SpecError, match="KEY=VALUE"):
        apply_override(raw, "training.max_steps")
    with pytest.raises(SpecError, match="name is a value"):
        apply_override(raw, "name.first=1")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="a folder, not a spec file"):
        load_spec(tmp_path)
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(SpecError, match=r"latin1\.yaml: cannot read the spec file"):
        load_spec(tmp_path / "latin1.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- a list")
    with pytest.raises(SpecError, match="YAML mapping"):
        load_spec(bad)


def test_flatten_spec_for_tracking():
    flat = flatten_spec(validate_spec(_raw()))
    assert flat["training.optimizer.name"] == "adam"
    assert flat["cluster.workers"] == "2"
    assert flat["model.params.num_classes"] == "10"


def test_a_batch_smaller_than_the_towers_is_named():
    raw = _raw()
    raw["data"]["batch_size"], raw["cluster"]["towers"] = 1, 2
    assert "data.batch_size: 1 examples per worker cannot feed its 2 towers" in _error(raw)


def test_workers_take_an_elastic_range_which_is_checked():
    raw = _raw()
    raw["cluster"]["workers"] = {"min": 1, "max": 4}
    del raw["training"]["total_num_replicas"]
    cluster = validate_spec(raw).cluster
    assert (cluster.fewest_workers, cluster.workers, cluster.elastic) == (1, 4, True)
    raw["cluster"]["workers"] = {"min": 5, "max": 4}
    assert "min 5 exceeds max 4" in _error(raw)
    raw["cluster"]["workers"] = {"min": 1}
    assert "max is missing" in _error(raw)
    raw["cluster"]["workers"], raw["cluster"]["spare_workers"] = {"min": 1, "max": 4}, 1
    assert "spare_workers: 1 is for a fixed worker count" in _error(raw)
