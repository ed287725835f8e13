import pytest

from towerflow.runtime.sharding import GreedyBytes, RoundRobin, VariableInfo, make_sharding, shard_variables


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
