"""FeatureGroup: JSON forms (old [a, b] ranges load), feature columns, cover checks."""
import numpy as np
import pytest

from kvtc.artifacts.groups import FeatureGroup, check_cover, group_columns, groups_json, parse_groups


def test_legacy_ranges_and_new_form_round_trip():
    old = parse_groups([[0, 2], [2, 5]])
    assert old == [FeatureGroup((0, 1)), FeatureGroup((2, 3, 4))] and groups_json(old) == [[0, 2], [2, 5]]
    new = [FeatureGroup((4, 0, 2)), FeatureGroup((1, 3), (2, 4))]
    assert groups_json(new) == [{"layers": [4, 0, 2]}, {"layers": [1, 3], "heads": [2, 4]}]
    assert parse_groups(groups_json(new)) == new
    for bad in ([[2, 2]], [{"layers": []}], [{"layers": [1, 1]}], [{"layers": [0], "heads": [2, 1]}],
                [{"layers": [0], "rank": 1}], "0-3"):
        with pytest.raises(ValueError):
            parse_groups(bad)


def test_columns_follow_layer_then_head_then_dim():
    H, D = 3, 2
    assert FeatureGroup.span(1, 3).columns(H, D) == slice(6, 18)
    cols = FeatureGroup((2, 0), (1, 3)).columns(H, D)
    want = [2 * 6 + 1 * 2 + d for d in range(4)] + [0 * 6 + 1 * 2 + d for d in range(4)]
    assert list(cols) == want
    # layers without a KV cache (here 1) have no slot: coded layers 0, 2, 3 sit in slots 0, 1, 2
    groups = [FeatureGroup((0, 2)), FeatureGroup((3,))]
    assert group_columns(groups, H, D) == [slice(0, 12), slice(12, 18)]
    assert FeatureGroup((0, 2), (1, 2)).dim(H, D) == 4


def test_cover_names_the_problem():
    check_cover([FeatureGroup((0,), (0, 1)), FeatureGroup((0,), (1, 2))], [0], 2)
    with pytest.raises(ValueError, match="two groups"):
        check_cover([FeatureGroup((0, 1)), FeatureGroup((1,))], [0, 1], 1)
    with pytest.raises(ValueError, match=r"missing \[\(1, 0\)\]"):
        check_cover([FeatureGroup((0,))], [0, 1], 1)
    with pytest.raises(ValueError, match="exceed"):
        FeatureGroup((0,), (0, 3)).head_range(2)
    assert isinstance(FeatureGroup((1, 0)).columns(1, 1), np.ndarray)
