"""Synthetic PTB: the stated entropy rate is the true model's cross-entropy, Zipfian words, sound windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from synth_support import read_split

from towerflow.data.synth import synth_ptb
from towerflow.data.synth.markov import MarkovSource
from towerflow.data.synth.ptb import EOS_ID
from towerflow.errors import SpecError


@pytest.fixture(scope="module")
def ptb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ptb")
    manifest = synth_ptb(folder, shards=3, examples=3000, eval_examples=300, seed=1)
    return folder, manifest, read_split(folder, manifest), read_split(folder, manifest, "eval")


def _dense(source: MarkovSource) -> np.ndarray:
    """The transition matrix written out in full, summing repeated words of a row."""
    vocab = source.vocab_size
    matrix = np.zeros((vocab, vocab))
    rows = np.repeat(np.arange(vocab), source.successors.shape[1])
    np.add.at(matrix, (rows, source.successors.ravel()), np.tile(source.slot_probs, vocab))
    return matrix


def test_entropy_rate_matches_a_dense_computation():
    source = MarkovSource.build(40, seed=3)
    matrix = _dense(source)
    assert np.allclose(matrix.sum(axis=1), 1.0)
    values, vectors = np.linalg.eig(matrix.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    pi /= pi.sum()
    assert np.allclose(source.stationary, pi, atol=1e-10)
    with np.errstate(divide="ignore", invalid="ignore"):
        rows = -np.nansum(np.where(matrix > 0, matrix * np.log(matrix), 0.0), axis=1)
    assert source.entropy_rate() == pytest.approx(float(pi @ rows), rel=1e-9)
    picks = np.random.default_rng(0).integers(0, 40, size=(2, 500))
    assert np.allclose(np.exp(source.log_prob(picks[0], picks[1])), matrix[picks[0], picks[1]])


def test_stated_entropy_rate_is_the_true_models_cross_entropy_on_the_text(ptb):
    _, manifest, train, evals = ptb
    source = MarkovSource.build(manifest["vocab_size"], seed=manifest["source"]["seed"])
    assert manifest["entropy_rate_nats"] == pytest.approx(source.entropy_rate())
    assert manifest["best_perplexity"] == pytest.approx(math.exp(manifest["entropy_rate_nats"]))
    for split in (train, evals):
        nll = -source.log_prob(split["inputs"], split["targets"])
        assert np.isfinite(nll).all()  # every transition in the text is one the source can make
        # Train has 105k tokens with a per-token NLL spread of ~1.5 nats: a standard error of ~0.005.
        stderr = nll.std() / math.sqrt(nll.size)
        assert abs(nll.mean() - manifest["entropy_rate_nats"]) < 5 * stderr, (nll.mean(), stderr)
    # Context pays: the best unigram model is far worse than the chain.
    assert manifest["unigram_perplexity"] > 4 * manifest["best_perplexity"]


def test_word_frequencies_are_zipf_like(ptb):
    _, manifest, train, _ = ptb
    counts = np.sort(np.bincount(train["inputs"].ravel(), minlength=manifest["vocab_size"]))[::-1]
    ranks = np.arange(1, counts.size + 1)
    keep = (ranks >= 5) & (ranks <= 1000)
    slope = np.polyfit(np.log(ranks[keep]), np.log(counts[keep]), 1)[0]
    assert -1.5 < slope < -0.8, slope
    eos_rank = int(np.flatnonzero(np.argsort(-np.bincount(train["inputs"].ravel())) == EOS_ID)[0])
    assert eos_rank < 5


def test_windows_are_consistent_and_the_manifest_matches(ptb):
    folder, manifest, train, evals = ptb
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert manifest["label"] == "targets" and manifest["vocab_size"] == 10_000
    assert manifest["features"]["inputs"] == {"dtype": "int64", "shape": [35]}
    inputs, targets = train["inputs"], train["targets"]
    assert inputs.shape == targets.shape == (3000, 35) and inputs.dtype == np.int64
    assert np.array_equal(inputs[:, 1:], targets[:, :-1])
    assert inputs.min() >= 0 and max(inputs.max(), targets.max()) < 10_000
    # Within a chain (16 windows), a window continues where the previous one ended.
    within = np.arange(len(inputs) - 1) % 16 != 15
    assert np.array_equal(inputs[1:, 0][within], targets[:-1, -1][within])
    assert np.array_equal(train["example_id"], np.arange(3000))
    assert np.array_equal(evals["example_id"], np.arange(3000, 3300))
    vocab = (folder / "vocab.txt").read_text().splitlines()
    assert len(vocab) == 10_000 and vocab[EOS_ID] == "<eos>" and len(set(vocab)) == 10_000
    assert not np.array_equal(evals["inputs"][:100], inputs[:100])


def test_csv_form_and_shard_count_give_the_same_windows(tmp_path, ptb):
    _, _, train, _ = ptb
    manifest = synth_ptb(tmp_path, shards=2, examples=3000, eval_examples=0, seed=1, fmt="csv")
    assert list(manifest["features"])[:3] == ["example_id", "in_00", "in_01"]
    assert list(manifest["features"])[-1] == "tgt_34" and len(manifest["features"]) == 71
    data = read_split(tmp_path, manifest)
    assert np.array_equal(np.stack([data[f"in_{i:02d}"] for i in range(35)], axis=1), train["inputs"])
    assert np.array_equal(np.stack([data[f"tgt_{i:02d}"] for i in range(35)], axis=1), train["targets"])


def test_a_small_vocabulary_for_tests_and_a_too_small_one_refused(tmp_path):
    manifest = synth_ptb(tmp_path, shards=1, examples=20, eval_examples=0, vocab_size=50)
    assert manifest["vocab_size"] == 50 and manifest["best_perplexity"] < 50
    assert read_split(tmp_path, manifest)["targets"].max() < 50
    with pytest.raises(SpecError, match="vocab_size"):
        synth_ptb(tmp_path, shards=1, examples=20, vocab_size=2)
