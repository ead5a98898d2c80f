"""The audit on the real default model: with no defence, or a secret permutation, states and KV caches at layers 1 and
15 give back every token, the KV cache the same tokens as the states, and nothing wrong is claimed."""

from __future__ import annotations

from lminvert.audit import audit


def test_states_and_kv_leak_every_token_without_a_defence_and_under_a_permutation(smollm2, tmp_path):
    doc = audit(
        tmp_path, model="smollm2-135m", load=lambda name: smollm2, prompts=1, length=8, layers=[1, "middle"],
        leaks=["states", "kv"], defences=["none", "permute"], progress=False,
    )  # fmt: skip
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2 and all(r["exact"] for r in rows)
    assert all(r["wrong_claimed"] == 0 for r in rows)
    by = {(r["leak"], r["layer"], r["defence"], r["prompt"]): r["recovered"] for r in rows}
    for (leak, layer, defence, prompt), ids in by.items():
        if leak == "kv":
            assert ids == by[("states", layer, defence, prompt)]
    none = [r for r in rows if r["defence"] == "none"]
    assert all(r["top1"] == 1.0 and r["dloss"] == 0.0 for r in none)
    states = [r for r in none if r["leak"] == "states"]
    assert all(r["verdicts"]["certified"] == r["length"] for r in states)  # lminvert's own states: every token proved
