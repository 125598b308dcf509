"""planning/signatures.py: size classes, signatures, similarity and fuzzy tensor keys (pure functions)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_swap.planning.signatures import (EventVocab, KeyIndex, Similarity, TensorKey, shape_matches,
                                     signature, similarity, size_class)


def test_size_class_groups_near_sizes_and_separates_far_ones():
    assert size_class(0) == 0
    assert size_class(12) == 12                       # tiny sizes are their own class
    assert size_class(1_000_000) == size_class(1_010_000)    # 1% apart: same class
    assert size_class(1_000_000) != size_class(1_200_000)    # 20% apart: different
    assert size_class(12 * 4096) != size_class(20 * 4096)    # seq 12 vs 20


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 2**40), st.integers(1, 2**40))
def test_size_class_is_monotonic(a, b):
    if a <= b:
        assert size_class(a) <= size_class(b)
    else:
        assert size_class(a) >= size_class(b)


@settings(max_examples=100, deadline=None)
@given(st.integers(64, 2**40))
def test_size_class_resolution_is_about_six_percent(n):
    # Sizes more than 1/8 apart never share a class (16 classes per power of two).
    assert size_class(n) != size_class(n + n // 8 + 1)


def test_vocab_interns_stably():
    v = EventVocab()
    a = v.id(("s", 1, 0))
    b = v.id(("m", 2, 0))
    assert a != b and v.id(("s", 1, 0)) == a and len(v) == 2


def test_signature_is_exact_and_deterministic():
    assert signature([1, 2, 3]) == signature([1, 2, 3])
    assert signature([1, 2, 3]) != signature([1, 3, 2])
    assert signature([1, 2, 3]) != signature([1, 2, 3, 3])
    assert signature([]) == signature([])
    assert len(signature([5])) == 24                  # 12 bytes, hex


def test_similarity_identical_and_disjoint():
    s = similarity([1, 2, 3, 2], [1, 2, 3, 2])
    assert s.length_change == 0 and s.cosine == pytest.approx(1.0)
    assert not s.changed()
    d = similarity([1, 2, 3], [4, 5, 6])
    assert d.cosine == 0 and d.changed()
    assert not similarity([], []).changed()


def test_similarity_thresholds_are_the_papers_and_configurable():
    base = list(range(40)) * 2                         # 80 events
    longer = base + [0, 1, 2, 3, 4]                    # 6.25% longer
    s = similarity(base, longer)
    assert s.length_change == pytest.approx(5 / 85)
    assert s.changed()                                 # > 5%
    assert not s.changed(length_tolerance=0.07, min_similarity=0.9)
    slightly = base + [0, 1]                           # 2.4% longer, same events
    assert not similarity(base, slightly).changed()


def test_similarity_cosine_counts_events():
    s = similarity([1, 1, 2], [1, 2, 2])
    assert s.cosine == pytest.approx(4 / 5)
    assert isinstance(s, Similarity)


def test_shape_matching_tolerates_varying_dims():
    assert shape_matches((2, 16, 64), (2, 24, 64))
    assert shape_matches((2, 4, 16, 16), (2, 4, 24, 24))      # two dims vary
    assert not shape_matches((2, 4, 16, 16), (3, 4, 24, 24))  # three dims vary
    assert not shape_matches((2, 16), (2, 16, 1))             # rank differs


def test_key_index_matches_by_features_never_address():
    keys = [TensorKey(0, 0, 0, "torch.float32", (2, 16, 64)),
            TensorKey(0, 0, 1, "torch.float32", (2, 16, 64)),
            TensorKey(1, 0, 0, "torch.bfloat16", (32, 64)),
            TensorKey(0, 1, 0, "torch.float32", (2, 16, 64))]
    idx = KeyIndex(keys)
    assert idx.find(TensorKey(0, 0, 1, "torch.float32", (2, 20, 64))) == 1
    assert idx.find(TensorKey(0, 1, 0, "torch.float32", (2, 20, 64))) == 3   # second call
    assert idx.find(TensorKey(1, 0, 0, "torch.float32", (32, 64))) is None    # dtype differs
    assert idx.find(TensorKey(2, 0, 0, "torch.float32", (2, 16, 64))) is None  # other module
