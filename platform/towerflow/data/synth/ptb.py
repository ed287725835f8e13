"""A PTB-shaped language-modelling data set drawn from a known Markov source.

Examples are windows of `steps` (35) consecutive word ids: ``inputs`` and ``targets`` (the same
text shifted by one word), as in TensorFlow's PTB tutorial. Windows come from blocks of
independent chains; within a chain, window k+1 continues where window k stopped. The source
(vocabulary, transition rows) depends only on `vocab_size` and `source_seed`, so every `--seed`
draws a different text from the same language, and the manifest states that language's entropy
rate and hence the best perplexity any model can reach: exp(entropy rate).

CSV form: columns ``example_id, in_00..in_34, tgt_00..tgt_34``. ``vocab.txt`` beside the shards
lists the words, one per line, line i = id i; ``<eos>`` is id 1 (the second most frequent word).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from towerflow.data.synth.build import synthesize
from towerflow.data.synth.markov import MarkovSource
from towerflow.data.synth.shards import Progress

STEPS = 35
VOCAB_SIZE = 10_000
EOS_ID = 1
VOCAB_FILE = "vocab.txt"
_CHAINS = 256  # chains sampled side by side
_WINDOWS_PER_CHAIN = 16  # so one block is 4,096 windows, whatever the shard count


def vocabulary(vocab_size: int) -> list[str]:
    """Word strings by id: `<eos>` at EOS_ID, `w00000`-style names elsewhere."""
    return ["<eos>" if i == EOS_ID else f"w{i:05d}" for i in range(vocab_size)]


class PtbDefinition:
    name = "ptb"
    label = "targets"

    def __init__(self, vocab_size: int = VOCAB_SIZE, source_seed: int = 0, steps: int = STEPS):
        self.source = MarkovSource.build(vocab_size, seed=source_seed)
        self.source_seed = source_seed
        self.steps = steps
        self._inputs = [f"in_{i:02d}" for i in range(steps)]
        self._targets = [f"tgt_{i:02d}" for i in range(steps)]

    def features(self, fmt: str) -> dict[str, dict[str, Any]]:
        if fmt == "csv":
            return {name: {"dtype": "int64", "shape": []} for name in self._inputs + self._targets}
        window = {"dtype": "int64", "shape": [self.steps]}
        return {"inputs": dict(window), "targets": dict(window)}

    def chunks(self, examples: int, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
        block = _CHAINS * _WINDOWS_PER_CHAIN
        for start in range(0, examples, block):
            text = self.source.sample(_CHAINS, _WINDOWS_PER_CHAIN * self.steps + 1, rng)
            inputs = text[:, :-1].reshape(block, self.steps)  # chain-major: a chain's windows are adjacent
            targets = text[:, 1:].reshape(block, self.steps)
            take = min(block, examples - start)
            yield {"inputs": inputs[:take], "targets": targets[:take]}

    def to_csv(self, chunk: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        columns = {name: chunk["inputs"][:, i] for i, name in enumerate(self._inputs)}
        columns.update({name: chunk["targets"][:, i] for i, name in enumerate(self._targets)})
        return columns

    def manifest_keys(self) -> dict[str, Any]:
        rate = self.source.entropy_rate()
        return {
            "vocab_size": self.source.vocab_size,
            "eos_id": EOS_ID,
            "vocab_file": VOCAB_FILE,
            "steps": self.steps,
            "entropy_rate_nats": rate,
            "best_perplexity": math.exp(rate),
            "unigram_perplexity": math.exp(self.source.unigram_entropy()),
            "source": {
                "kind": "first-order Markov chain, Zipf rows over frequency-biased reorderings",
                "seed": self.source_seed,
                **self.source.params,
            },
            "windows": (
                f"inputs = ids t..t+{self.steps - 1}, targets = ids t+1..t+{self.steps}; consecutive windows "
                f"of a chain are adjacent in example_id order ({_WINDOWS_PER_CHAIN} per chain)"
            ),
            "csv_columns": f"in_00..in_{self.steps - 1:02d} (inputs), tgt_00..tgt_{self.steps - 1:02d} (targets)",
        }


def synth_ptb(
    out_dir: str | os.PathLike[str],
    *,
    shards: int = 8,
    examples: int = 26_000,
    eval_examples: int = 2_000,
    eval_shards: int | None = None,
    seed: int = 0,
    fmt: str = "tfrecord",
    vocab_size: int = VOCAB_SIZE,
    source_seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Generate PTB-like windows (default about PTB's 930k training words); return the manifest."""
    manifest = synthesize(
        PtbDefinition(vocab_size, source_seed),
        out_dir,
        shards=shards,
        examples=examples,
        eval_examples=eval_examples,
        eval_shards=eval_shards,
        fmt=fmt,
        seed=seed,
        progress=progress,
    )
    (Path(out_dir) / VOCAB_FILE).write_text("\n".join(vocabulary(vocab_size)) + "\n")
    return manifest
