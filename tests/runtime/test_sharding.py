import pytest

from towerflow.runtime.sharding import (
    GreedyBytes,
    RoundRobin,
    cut_variables,
    gradient_buckets,
    make_sharding,
    shard_variables,
)
from towerflow.shared_types import VariableInfo


def _vars(*sizes):
    return [VariableInfo(i, f"v{i}", (s,), "float32", s * 4) for i, s in enumerate(sizes)]


def test_round_robin_places_variable_i_on_shard_i_mod_s():
    assert RoundRobin().assign(_vars(1, 1, 1, 1, 1), 2) == [[0, 2, 4], [1, 3]]


def test_greedy_bytes_balances_by_size():
    # LeNet-like: one huge dense kernel, a few small ones.
    variables = _vars(800, 32, 51200, 64, 3211264, 1024, 10240, 10)
    shards = GreedyBytes().assign(variables, 2)
    loads = [sum(variables[i].nbytes for i in s) for s in shards]
    assert 4 in shards[0]  # the largest variable alone on its shard
    assert shards[0] == [4]
    assert loads[1] == sum(v.nbytes for v in variables) - variables[4].nbytes


def test_greedy_bytes_beats_round_robin_on_balance():
    variables = _vars(100, 100, 10, 10, 10, 10)
    greedy = [sum(variables[i].nbytes for i in s) for s in GreedyBytes().assign(variables, 2)]
    robin = [sum(variables[i].nbytes for i in s) for s in RoundRobin().assign(variables, 2)]
    assert max(greedy) - min(greedy) <= max(robin) - min(robin)
    assert greedy == [120 * 4, 120 * 4]


@pytest.mark.parametrize("name", ["round_robin", "greedy_bytes"])
def test_every_variable_placed_once(name):
    variables = _vars(*range(1, 12))
    shards = shard_variables(make_sharding(name), variables, 3)
    assert sorted(i for s in shards for i in s) == list(range(11))
    assert all(shards)


def test_more_shards_than_variables_is_a_clear_error():
    with pytest.raises(ValueError, match="at most 2 parameter servers"):
        shard_variables(RoundRobin(), _vars(1, 2), 3)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="round_robin"):
        make_sharding("random")


def test_large_variables_are_cut_into_row_slices_one_per_shard():
    dense = VariableInfo(0, "dense/kernel", (3136, 1024), "float32", 3136 * 1024 * 4)
    bias = VariableInfo(1, "dense/bias", (1024,), "float32", 4096)
    pieces = cut_variables([dense, bias], num_shards=2, min_slice_bytes=262144)
    assert [(p.variable, p.start, p.stop) for p in pieces] == [(0, 0, 1568), (0, 1568, 3136), (1, 0, 1024)]
    assert pieces[0].shape == (1568, 1024) and pieces[0].nbytes == dense.nbytes // 2
    assert pieces[2].covers(bias) and not pieces[0].covers(dense)
    shards = shard_variables(GreedyBytes(), pieces, 2)
    assert {0, 1} == {
        next(i for i, s in enumerate(shards) if p in s) for p in (0, 1)
    }  # halves on both shards


def test_cutting_respects_the_minimum_slice_and_can_be_off():
    var = VariableInfo(0, "k", (100, 10), "float32", 4000)
    assert len(cut_variables([var], 4, min_slice_bytes=1500)) == 2  # 4000 // 1500
    assert len(cut_variables([var], 4, min_slice_bytes=None)) == 1
    scalar = VariableInfo(1, "s", (), "float32", 4)
    assert cut_variables([scalar], 4, min_slice_bytes=1)[0].shape == ()


def test_gradient_buckets_follow_backprop_order_and_close_at_the_size():
    variables = _vars(800, 32, 51200, 64, 3211264, 1024, 10240, 10)  # LeNet's, in model order
    # From the loss down: the logits layer and the big dense kernel fill the first bucket.
    assert gradient_buckets(variables, 1 << 20) == [[7, 6, 5, 4], [3, 2, 1, 0]]
    assert gradient_buckets(variables, 1) == [[7], [6], [5], [4], [3], [2], [1], [0]]
    assert gradient_buckets(variables, None) == [[0, 1, 2, 3, 4, 5, 6, 7]]
