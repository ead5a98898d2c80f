"""The blocked search against a float64 brute force: exact minimum, k closest, threshold count, NN distances."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lminvert.collisions import bounds
from lminvert.collisions.best import MAX_LISTED
from lminvert.collisions.search import (
    BlockSearch,
    block_pairs,
    merge_blocks,
    pairwise_min,
    row_blocks,
    search_block,
)
from lminvert.errors import LminvertError


def brute_force(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """All pairwise distances (upper triangle, float64, from the vectors) and the full NN vector."""
    x64 = np.asarray(x, dtype=np.float64)
    diff = x64[:, None, :] - x64[None, :, :]
    full = np.sqrt((diff * diff).sum(axis=-1))
    upper = full[np.triu_indices(len(x64), 1)]
    np.fill_diagonal(full, np.inf)
    return upper, full.min(axis=1)


def check_against_brute_force(x: np.ndarray, k: int, threshold: float, rows: int, cols: int) -> None:
    result = pairwise_min(x, k=k, threshold=threshold, tile_rows=rows, tile_cols=cols)
    upper, nn = brute_force(x)
    assert result.min_distance == pytest.approx(upper.min(), rel=1e-12, abs=1e-300)
    assert result.n_below_threshold == int(np.count_nonzero(upper < threshold))
    expected = np.sort(upper)[: min(k, len(upper))]
    got = np.array([p.distance for p in result.closest])
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-300)
    for p in result.closest:  # each reported pair really has the reported distance
        assert p.i < p.j
        assert p.distance == pytest.approx(np.linalg.norm(x[p.i].astype(np.float64) - x[p.j]), rel=1e-12, abs=1e-300)
    exact = result.nn_exact
    np.testing.assert_allclose(result.nn_distance[exact], nn[exact], rtol=1e-12, atol=1e-300)
    assert np.all(np.abs(result.nn_distance - nn) <= result.nn_error_bound)
    assert np.all(result.nn_distance >= result.min_distance * (1 - 1e-12))


@st.composite
def adversarial(draw) -> tuple[np.ndarray, int, float, int, int]:
    n = draw(st.integers(2, 90))
    d = draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([1e-4, 1.0, 1e3]))
    x = rng.standard_normal((n, d)) * scale
    kind = draw(st.sampled_from(["plain", "offset", "clusters", "near_ties", "duplicates", "lattice"]))
    if kind == "offset":  # a large common offset: naive float32 GEMM distances are meaningless
        x = x * 1e-3 + rng.standard_normal(d) * 1e5
    elif kind == "clusters":  # two far clusters with tiny spread: centring cannot shrink the norms
        x = x * 1e-4 + np.where(rng.random((n, 1)) < 0.5, 1e4, -1e4)
    elif kind == "near_ties":  # many pairs at almost the same distance
        base = rng.standard_normal(d)
        x = base + rng.standard_normal((n, d)) * 1e-6 * scale
    elif kind == "duplicates":
        picks = rng.integers(0, max(1, n // 3), size=n)
        x = x[picks] + (rng.random((n, d)) < 0.05) * 1e-7
    elif kind == "lattice":  # integer points: exact ties everywhere
        x = rng.integers(-2, 3, size=(n, d)).astype(np.float64)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    x = x.astype(dtype)
    k = draw(st.integers(1, 12))
    threshold = draw(st.sampled_from([0.0, 1e-6, 1e-3, 1.0]))
    rows = draw(st.integers(1, n + 3))
    cols = draw(st.integers(1, n + 3))
    return x, k, threshold, rows, cols


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial())
def test_blocked_search_equals_float64_brute_force(case):
    x, k, threshold, rows, cols = case
    check_against_brute_force(x, k, threshold, rows, cols)


@pytest.mark.parametrize("rows,cols", [(7, 7), (16, 40), (64, 64), (1000, 1000)])
def test_large_offset_two_clusters(rows, cols):
    # float32 GEMM values here have errors ~1e-3·|x|² >> the true distances (~1e-4): exactness comes entirely
    # from the bound and the float64 re-measurement
    rng = np.random.default_rng(1)
    x = rng.standard_normal((150, 32)) * 1e-4 + np.where(rng.random((150, 1)) < 0.5, 3e3, -3e3)
    result = pairwise_min(x.astype(np.float32), k=5, tile_rows=rows, tile_cols=cols)
    check_against_brute_force(x.astype(np.float32), 5, 1e-6, rows, cols)
    assert result.stats.n_exact > 5  # the bound forced re-measurement


def test_planted_duplicate_is_a_collision_at_distance_zero():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((300, 64)).astype(np.float32)
    x[217] = x[42]
    result = pairwise_min(x, k=3, threshold=1e-6, tile_rows=64, tile_cols=128)
    assert result.min_distance == 0.0
    assert (result.closest[0].i, result.closest[0].j) == (42, 217)
    assert result.n_below_threshold == 1
    assert result.nn_distance[42] == 0.0 and result.nn_exact[42]


def test_near_duplicate_under_threshold_is_counted():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((200, 48)) * 10
    x[150] = x[10]
    x[150, 5] += 4e-7  # 4e-7 < 1e-6: a collision
    x[151] = x[11]
    x[151, 7] += 3e-6  # above the threshold: not one
    result = pairwise_min(x, k=2, threshold=1e-6, tile_rows=32, tile_cols=64)
    assert result.n_below_threshold == 1
    assert result.closest[0].distance == pytest.approx(4e-7, rel=1e-6)
    assert result.closest[1].distance == pytest.approx(3e-6, rel=1e-6)


def test_input_types_agree():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((120, 20)).astype(np.float32)
    reference = pairwise_min(x, k=4)
    for variant in (torch.from_numpy(x), x.astype(np.float64), np.asfortranarray(x)):
        other = pairwise_min(variant, k=4, tile_rows=17, tile_cols=33)
        assert [(p.i, p.j) for p in other.closest] == [(p.i, p.j) for p in reference.closest]
        assert other.min_distance == reference.min_distance


def test_gemm_error_bound_holds():
    """The bound of :mod:`bounds` against what addmm really does, on badly conditioned inputs."""
    rng = np.random.default_rng(5)
    for d in (1, 7, 64, 576):
        a = (rng.standard_normal((256, d)) * rng.choice([1e-3, 1, 1e3], size=(256, 1))).astype(np.float32)
        a[128:] = a[:128] + (rng.standard_normal((128, d)) * 1e-3).astype(np.float32)  # close pairs: cancellation
        sq = (a.astype(np.float64) ** 2).sum(axis=1)
        P = torch.from_numpy(np.concatenate([a, sq[:, None].astype(np.float32)], axis=1))
        Q = torch.from_numpy(np.concatenate([-2 * a, np.ones((256, 1), np.float32)], axis=1))
        r = torch.addmm(torch.from_numpy(sq.astype(np.float32))[None], P, Q.T).double().numpy()
        a64 = a.astype(np.float64)
        exact = ((a64[:, None, :] - a64[None, :, :]) ** 2).sum(-1)
        norm = np.sqrt(sq)
        bound = bounds.sq_error_bound(norm[:, None], norm[None, :], d)
        assert np.all(np.abs(r - exact) <= bound)
        assert np.max(np.abs(r - exact) / bound) > 1e-4  # and it is not vacuous by orders of magnitude


def test_gamma_rejects_overlong_dot_products():
    with pytest.raises(ValueError):
        bounds.gamma(2**24)
    assert bounds.gamma(576) == pytest.approx(576 * 2**-24, rel=1e-4)
    assert math.isinf(bounds.candidate_cutoff(math.inf, 1.0, 1.0, 8))


@pytest.mark.parametrize(
    "bad,message",
    [
        (np.zeros((1, 4), np.float32), "at least 2"),
        (np.zeros((3,), np.float32), "[N, d]"),
        (np.array([[0.0, 1.0], [np.nan, 0.0]], np.float32), "NaN"),
        (np.zeros((3, 2), np.int64), "float32 or float64"),
    ],
)
def test_bad_inputs_give_one_line_errors(bad, message):
    with pytest.raises(LminvertError, match=message.replace("[", r"\[").replace("]", r"\]")):
        pairwise_min(bad)


def assert_same_result(a, b) -> None:
    """Two search results with the same minimum, pairs, counts, NN distances, exactness flags and bounds."""
    assert a.min_distance == b.min_distance
    assert a.closest == b.closest
    assert (a.n_below_threshold, a.below_threshold) == (b.n_below_threshold, b.below_threshold)
    assert a.nn_distance.tobytes() == b.nn_distance.tobytes()
    assert np.array_equal(a.nn_exact, b.nn_exact)
    assert a.nn_error_bound == b.nn_error_bound
    sa, sb = a.stats, b.stats
    assert (sa.n, sa.d, sa.n_pairs, sa.n_tiles, sa.tile_rows, sa.tile_cols) == (
        sb.n, sb.d, sb.n_pairs, sb.n_tiles, sb.tile_rows, sb.tile_cols
    )  # fmt: skip
    assert (sa.max_sq_error_bound, sa.mean_norm, sa.max_norm) == (sb.max_sq_error_bound, sb.mean_norm, sb.max_norm)


def split_search(x, k, threshold, rows, cols, pairs_per_block, tmp_path=None):
    blocks = row_blocks(len(x), rows, cols, pairs_per_block)
    parts = [search_block(x, k, threshold, rows, cols, block) for block in blocks]
    if tmp_path is not None:  # through the files a task writes
        for index, part in enumerate(parts):
            part.save(tmp_path / f"b{index}.npz")
        parts = [BlockSearch.load(tmp_path / f"b{index}.npz") for index in range(len(parts))]
    return blocks, merge_blocks(parts[::-1])  # any order


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial(), st.integers(1, 3000))
def test_row_blocks_merge_to_the_single_pass_result(case, pairs_per_block):
    x, k, threshold, rows, cols = case
    blocks, merged = split_search(x, k, threshold, rows, cols, pairs_per_block)
    assert_same_result(merged, pairwise_min(x, k=k, threshold=threshold, tile_rows=rows, tile_cols=cols))
    assert merged.stats.n_blocks == len(blocks)
    assert sum(block_pairs(len(x), b) for b in blocks) == len(x) * (len(x) - 1) // 2


@pytest.mark.parametrize(
    "n,rows,pairs_per_block,expected_blocks",
    [
        (1000, 64, 60_000, 7),  # tile rows of 64: 1 to 3 of them per block as rows get shorter, the last one short
        (1000, 64, 1, 16),  # one tile row per block (999 rows: 15 full tile rows and a short one)
        (1000, 64, 10**9, 1),  # N smaller than a block
        (200, 1024, 100, 1),  # fewer rows than one tile row
    ],
)
def test_split_search_with_planted_collisions(tmp_path, n, rows, pairs_per_block, expected_blocks):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((n, 24)).astype(np.float32)
    for a, b in ((3, n - 1), (n // 2, n // 2 + 1), (7, 2 * n // 3), (8, 9)):
        x[b] = x[a]
    x[n - 2] = x[1] + np.float32(1e-3)
    blocks, merged = split_search(x, 5, 1e-6, rows, 256, pairs_per_block, tmp_path)
    assert len(blocks) == expected_blocks
    single = pairwise_min(x, k=5, threshold=1e-6, tile_rows=rows, tile_cols=256)
    assert_same_result(merged, single)
    assert merged.min_distance == 0.0 and merged.n_below_threshold == 4


def test_more_collisions_than_are_listed_keep_the_first_found(monkeypatch):
    """Over MAX_LISTED pairs under the threshold: the blocks list the same first ones a single pass finds."""
    import lminvert.collisions.best as best

    monkeypatch.setattr(best, "MAX_LISTED", 30)
    x = np.random.default_rng(7).integers(-2, 3, size=(400, 2)).astype(np.float32)  # 25 points: distances 0, 1, √2
    single = pairwise_min(x, k=3, threshold=1.5, tile_rows=32, tile_cols=64)
    _, merged = split_search(x, 3, 1.5, 32, 64, 2000)
    assert single.n_below_threshold > 30 and len(single.below_threshold) == 30 < MAX_LISTED
    assert_same_result(merged, single)


def test_bad_blocks_give_one_line_errors():
    x = np.random.default_rng(8).standard_normal((300, 4)).astype(np.float32)
    with pytest.raises(LminvertError, match="does not start and end on a tile row"):
        search_block(x, rows=(10, 100), tile_rows=64)
    parts = [search_block(x, tile_rows=64, rows=b) for b in row_blocks(300, 64, 64, 5000)]
    with pytest.raises(LminvertError, match="do not cover rows"):
        merge_blocks(parts[1:])
    with pytest.raises(LminvertError, match="do not cover rows"):
        merge_blocks([*parts, parts[0]])
    with pytest.raises(LminvertError, match="different searches"):
        merge_blocks([parts[0], search_block(x, k=3, tile_rows=64, rows=parts[1].rows), *parts[2:]])
    with pytest.raises(LminvertError, match="pairs per search block must be positive"):
        row_blocks(300, 64, 64, -1)
