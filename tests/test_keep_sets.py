"""Replayed keep sets: plain data drawn from the seed, with every edge, in slime's format."""

import pytest

from shardcheck.scenarios.keep import EDGES, check_keep_sets, keep_sets, to_ids_offsets

TARGETS = [5, 1, 9, 3, 12, 0, 7, 7, 2, 14, 6, 8]


def test_drawn_from_the_seed_and_the_sample_not_from_anything_else():
    a = keep_sets(1, 0, TARGETS, vocab=16)
    assert a == keep_sets(1, 0, TARGETS, vocab=16)
    assert a != keep_sets(1, 1, TARGETS, vocab=16) and a != keep_sets(2, 0, TARGETS, vocab=16)


def test_every_edge_is_there():
    sets = keep_sets(3, 0, TARGETS, vocab=16)
    target_only, whole, straddle, without, empty = sets[:len(EDGES)]
    assert target_only == (TARGETS[0],)
    assert whole == tuple(range(16))
    for tp in (2, 4, 8):  # across a shard boundary at every even tp
        assert len({v // (16 // tp) for v in straddle}) == 2, tp
    assert TARGETS[3] not in without and without
    assert empty == ()
    assert sets[-3:] == [None] * 3 and all(s is not None for s in sets[:-3])  # a trailing quarter unrecorded
    check_keep_sets(sets, len(TARGETS), 16, "sample 0")


def test_slime_format_and_its_limits():
    ids, offsets = to_ids_offsets([(1, 2), (), (0,), None, None])
    assert ids == [1, 2, 0] and offsets == [0, 2, 2, 3]
    with pytest.raises(ValueError, match="keep set 1 is not recorded but a later one is"):
        to_ids_offsets([(1,), None, (2,)])


@pytest.mark.parametrize("sets,message", [
    ([(1,), (2,)], "2 keep sets for 3 response tokens"),
    ([(1,), (16,), None], "keep set 1 names token 16, outside the vocabulary of 16"),
    ([(-1,), (), None], "keep set 0 names token -1"),
])
def test_bad_keep_sets_are_named(sets, message):
    with pytest.raises(ValueError, match=message):
        check_keep_sets(sets, 3, 16, "sample 2")
