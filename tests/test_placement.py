"""The placement vocabulary (``heterog.placement``): its text form round-trips and the conversion table, once,
enumerated over every pair of placement classes."""
from __future__ import annotations

import pytest

from heterog.errors import HeterogError
from heterog.placement import (
    Conversion,
    P,
    Partial,
    R,
    Replicate,
    Shard,
    as_placement,
    conversion,
    is_shard,
    parse,
    same_units,
    text,
)

C = Conversion


@pytest.mark.parametrize("form, placement", [("R", Replicate()), ("P", Partial()), ("S1", Shard(1)),
                                             ("S0:4", Shard(0, 4)), ("-", None)])
def test_text_form_round_trips(form, placement):
    assert parse(form) == placement and text(placement) == form and as_placement(form) == placement


@pytest.mark.parametrize("bad", ["", "X", "S", "Sx", "S1:", "S1:y", "r"])
def test_bad_text_is_a_named_error(bad):
    with pytest.raises(HeterogError, match="not a placement"):
        parse(bad)


def test_helpers():
    assert is_shard(Shard(2)) and not is_shard(R) and not is_shard(None)
    assert R == Replicate() and P == Partial() and R != P and Shard(0) < Shard(1) < Shard(1, 2)
    assert same_units(4, 4) and not same_units(4, 8) and not same_units(4, 4, (2, 2), (3, 1))


# have -> need -> (conversion with the same units, with other units)
TABLE = {
    R: {R: (C.LOCAL, C.LOCAL), Shard(1): (C.SLICE, C.SLICE), P: (C.SLICE, C.SLICE)},
    Shard(1): {R: (C.ALL_GATHER, C.ALL_GATHER), Shard(1): (C.LOCAL, C.ALL_TO_ALL), Shard(0): (C.ALL_TO_ALL,) * 2,
               Shard(1, 4): (C.ALL_TO_ALL,) * 2, P: (C.PAD, C.PAD)},
    P: {R: (C.ALL_REDUCE, C.ALL_REDUCE), Shard(0): (C.REDUCE_SCATTER,) * 2, P: (C.LOCAL, C.LOCAL)},
}


def test_conversion_table_enumerated():
    for have, row in TABLE.items():
        for need, (same, other) in row.items():
            assert conversion(have, need, True) == same, (have, need)
            assert conversion(have, need, False) == other, (have, need)
    for p in (R, P, Shard(0), None):            # no tensor on either side: nothing to convert
        assert conversion(p, None, True) == C.LOCAL and conversion(None, p, False) == C.LOCAL


def test_collectives_move_bytes_and_the_rest_do_not():
    assert {c for c in C if c.collective} == {C.ALL_GATHER, C.REDUCE_SCATTER, C.ALL_REDUCE, C.ALL_TO_ALL}
    assert C.ALL_GATHER.label == "all-gather" and C.LOCAL == 0
