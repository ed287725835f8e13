"""A first-order Markov word source with Zipfian statistics and an exactly known entropy rate.

Words are ids ranked by a global Zipf law q(r) ~ 1/(r+1)^word_zipf. Every word's successor row
is a list of `support` slots: each slot holds a word drawn from q (so a row is a random,
frequency-biased reordering of the vocabulary) and slot j has weight z(j) ~ 1/(j+1)^slot_zipf,
the same for all rows. Repeated words in a row add their weights. The last slot of row i holds
a random permutation of the vocabulary, so every word can follow some word.

Since E[P(w | i)] = q(w), the stationary (unigram) distribution stays close to the Zipf law, while
each row is much more peaked: context pays, and the best possible model is the chain itself. The
entropy rate is exact: sum_i pi(i) H(row i), with pi the stationary distribution. Sampling is
vectorised over many independent chains started from pi, so every token is stationary and the
expected cross-entropy of the true model on generated text is the entropy rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from towerflow.errors import SpecError


@dataclass(frozen=True, eq=False)
class MarkovSource:
    successors: np.ndarray  # (vocab, support) int64: the word in each slot of each row
    slot_probs: np.ndarray  # (support,) float64: probability of each slot, shared by all rows
    stationary: np.ndarray  # (vocab,) float64
    params: dict  # what it was built from, for the manifest

    @property
    def vocab_size(self) -> int:
        return self.successors.shape[0]

    @classmethod
    def build(
        cls,
        vocab_size: int,
        *,
        support: int = 256,
        word_zipf: float = 1.0,
        slot_zipf: float = 0.8,
        seed: int = 0,
    ) -> MarkovSource:
        if vocab_size < 3 or support < 2:
            raise SpecError(f"ptb source: need vocab_size >= 3 and support >= 2, got {vocab_size}, {support}")
        rng = np.random.default_rng(seed)
        q = _zipf(vocab_size, word_zipf)
        successors = np.searchsorted(np.cumsum(q), rng.random((vocab_size, support)), side="right")
        successors = np.minimum(successors, vocab_size - 1)  # guard against cumsum rounding below 1
        successors[:, -1] = rng.permutation(vocab_size)
        slot_probs = _zipf(support, slot_zipf)
        params = {"support": support, "word_zipf": word_zipf, "slot_zipf": slot_zipf}
        return cls(successors, slot_probs, _stationary(successors, slot_probs), params)

    def row_entropies(self) -> np.ndarray:
        """H(next | current = i) in nats for every word i, merging repeated words in a row."""
        vocab = self.vocab_size
        order = np.argsort(self.successors, axis=1, kind="stable")
        words = np.take_along_axis(self.successors, order, axis=1)
        weights = self.slot_probs[order]
        first = np.ones(words.shape, dtype=bool)
        first[:, 1:] = words[:, 1:] != words[:, :-1]
        probs = np.add.reduceat(weights.ravel(), np.flatnonzero(first.ravel()))
        rows = np.repeat(np.arange(vocab), first.sum(axis=1))
        return np.bincount(rows, weights=-probs * np.log(probs), minlength=vocab)

    def entropy_rate(self) -> float:
        """Nats per word: the cross-entropy the true model reaches on an endless stationary text."""
        return float(self.stationary @ self.row_entropies())

    def unigram_entropy(self) -> float:
        """Nats per word of the best context-free model (the stationary distribution)."""
        p = self.stationary[self.stationary > 0]
        return float(-(p * np.log(p)).sum())

    def log_prob(self, current: np.ndarray, following: np.ndarray) -> np.ndarray:
        """log P(following | current), flattened; -inf where the source cannot make that step."""
        current, following = np.ravel(current), np.ravel(following)
        probs = (self.successors[current] == following[:, None]) @ self.slot_probs
        with np.errstate(divide="ignore"):
            return np.log(probs)

    def sample(self, chains: int, steps: int, rng: np.random.Generator) -> np.ndarray:
        """(chains, steps) ids: independent chains, each started from the stationary distribution."""
        cdf = np.cumsum(self.stationary)
        state = np.minimum(
            np.searchsorted(cdf, rng.random(chains) * cdf[-1], side="right"), self.vocab_size - 1
        )
        slot_cdf = np.cumsum(self.slot_probs)
        slots = np.searchsorted(slot_cdf, rng.random((steps - 1, chains)) * slot_cdf[-1], side="right")
        slots = np.minimum(slots, self.slot_probs.size - 1)
        out = np.empty((steps, chains), dtype=np.int64)
        out[0] = state
        for t in range(1, steps):
            state = self.successors[state, slots[t - 1]]
            out[t] = state
        return out.T


def _zipf(n: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, n + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def _stationary(successors: np.ndarray, slot_probs: np.ndarray, tol: float = 1e-13) -> np.ndarray:
    """Power iteration pi <- pi P, with P applied as a weighted bincount over the slots (no dense matrix)."""
    vocab = successors.shape[0]
    flat = successors.ravel()
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(10_000):
        new = np.bincount(flat, weights=np.outer(pi, slot_probs).ravel(), minlength=vocab)
        new /= new.sum()
        if np.abs(new - pi).sum() < tol:
            return new
        pi = new
    raise RuntimeError("the Markov source's stationary distribution did not converge")
