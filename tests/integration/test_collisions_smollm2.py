"""A small real collision search on SmolLM2: the reported minimum equals a float64 brute force on its states."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lminvert.collisions import find_collisions


@pytest.fixture(scope="module")
def run(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("collisions")
    results = find_collisions(smollm2, corpus="mixed", n_prompts=200, layers=[1, 15, 30], max_tokens=12, out=out)
    return results, out


def test_minimum_equals_float64_brute_force(run):
    results, out = run
    for name in ("1", "15", "30"):
        x = np.load(out / "states" / f"layer_{int(name):03d}.npy").astype(np.float64)
        diff = x[:, None, :] - x[None, :, :]
        d = np.sqrt((diff * diff).sum(-1))
        iu = np.triu_indices(len(x), 1)
        layer = results.layers[name]
        assert layer.min_distance == pytest.approx(d[iu].min(), rel=1e-12)
        assert layer.n_below_threshold == int((d[iu] < 1e-6).sum())
        expected = np.sort(d[iu])[:10]
        np.testing.assert_allclose([p.distance for p in layer.closest_pairs], expected, rtol=1e-12)
        np.fill_diagonal(d, np.inf)
        nn = d.min(axis=1)
        assert layer.nn_quantiles["0.5"] == pytest.approx(float(np.quantile(nn, 0.5)), rel=1e-4)
    mins = [results.layers[n].min_distance for n in ("1", "15", "30")]
    assert 0 < mins[0] < mins[1] < mins[2]  # separation grows with depth, as in the paper


def test_states_are_the_prompts_last_token_states(run, smollm2):
    results, out = run
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == results.n_prompts == 200 and len({tuple(p["ids"]) for p in prompts}) == 200
    stored = np.load(out / "states" / "layer_030.npy")
    for index in (0, 77, 199):
        alone = smollm2.probe.states(torch.tensor([prompts[index]["ids"]]), 30)[30][0, -1].numpy()
        np.testing.assert_allclose(stored[index], alone, rtol=1e-4, atol=1e-3)  # batched vs alone: rounding only
    pair = results.layers["30"].closest_pairs[0]
    assert smollm2.decode(list(pair.a_ids)) == pair.a_text


def test_results_json(run):
    results, out = run
    doc = json.loads((out / "results.json").read_text())
    assert doc["model"] == "smollm2-135m" and doc["n_pairs"] == 19900
    assert doc["config"]["layers"] == ["1", "15", "30"] and doc["dtype"] == "float32"
    assert doc["layers"]["30"]["nn_spot_check"]["max_rel_error"] < 1e-4
    assert doc["matmul_fraction"] > 0 and doc["pairs_per_second"] > 0
    for name, layer in results.layers.items():
        assert doc["layers"][name]["min_distance"] == layer.min_distance
        noise = layer.details["rounding_noise"]["max"]  # another batch: rounding only, far below the minimum
        assert 0 <= noise < 1e-2 * layer.min_distance
