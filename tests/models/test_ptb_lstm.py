"""The PTB LSTM: shapes and names, its pipeline spec validates, and it trains end to end on synthetic PTB."""

from __future__ import annotations

import math

import numpy as np
from conftest import REPO

from models import ptb_lstm
from towerflow.data.synth import synth_ptb
from towerflow.launch import train
from towerflow.spec import load_spec


def test_build_takes_ids_and_returns_next_word_logits():
    model = ptb_lstm.build(vocab_size=60, embed=8, hidden=12, num_layers=2, seed=1)
    assert [t.name for t in model.inputs] == ["inputs"] and model.inputs[0].dtype == "int64"
    ids = np.random.default_rng(0).integers(0, 60, size=(3, 35))
    logits = model(ids)
    assert tuple(logits.shape) == (3, 35, 60)
    assert not model.compiled  # uncompiled: the platform owns loss and optimizer
    again = ptb_lstm.build(vocab_size=60, embed=8, hidden=12, num_layers=2, seed=1)
    assert np.allclose(again(ids), logits)
    weights = np.concatenate([w.ravel() for w in model.get_weights() if w.ndim == 2])
    assert np.abs(weights).max() <= 0.1  # the tutorial's uniform init_scale


def test_pipeline_spec_validates():
    spec = load_spec(REPO / "pipelines" / "ptb_sync.yaml")
    assert spec.model.ref == "models.ptb_lstm:build" and spec.data.train.label == "targets"
    assert spec.model.from_logits and spec.training.optimizer.clip_global_norm == 5.0


def test_trains_a_few_steps_end_to_end_on_synthetic_ptb(ray_cluster, tmp_path):
    manifest = synth_ptb(tmp_path, shards=2, examples=400, eval_examples=40, vocab_size=50, seed=2)
    spec = load_spec(
        REPO / "pipelines" / "ptb_sync.yaml",
        [
            f"data.train.paths={tmp_path}/train-*",
            f"data.eval.paths={tmp_path}/eval-*",
            "model.params={vocab_size: 50, embed: 16, hidden: 16, num_layers: 1, seed: 0}",
            "data.batch_size=8",
            "data.shuffle_buffer=0",
            "training.max_steps=12",
            "training.optimizer.learning_rate=1.0",
        ],
    )
    result = train(spec, track=False)
    assert result.status == "FINISHED" and result.global_step == 12
    # From about log(50) = 3.9 at the start, learning moves the loss towards the source's entropy rate.
    assert math.isfinite(result.final_loss) and result.final_loss < math.log(50)
    assert result.final_loss > manifest["entropy_rate_nats"] - 0.5
    assert 0.0 <= result.final_metrics["accuracy"] <= 1.0
