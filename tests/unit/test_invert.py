"""Inversion on tiny random models of each architecture: exactness, agreement with brute force, noise."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lminvert
from lminvert.errors import LminvertError
from lminvert.forward import encode
from lminvert.invert import Leak, Run, Search, grouped, invert

from ..conftest import TINY

VOCAB = 49152


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    return lminvert.load_model(request.param)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), layer=st.sampled_from([1, 2, "final"]))
def test_invert_encode_roundtrip(tiny, ids, layer):
    states = encode(tiny, [ids], layer)
    (result,) = invert(tiny, states)
    assert result.token_ids == ids
    assert result.uncertain_positions == []
    assert all(d <= p.tolerance for d, p in zip(result.distances, result.positions, strict=True))


@pytest.mark.parametrize("policy", ["gradient", "random", "secant"])
def test_other_policies_exact(policy):
    model = lminvert.load_model("tiny-qwen2")
    ids = [17, 4021, 33000, 17, 5]
    (result,) = invert(model, encode(model, [ids], 2), policy=policy)
    assert result.token_ids == ids and not result.uncertain_positions


def test_agrees_with_bruteforce():
    model = lminvert.load_model("tiny-llama")
    ids = [101, 2024, 48000, 7]
    states = encode(model, [ids], 2)
    (fast,) = invert(model, states)
    (oracle,) = invert(model, states, method="bruteforce")
    assert fast.token_ids == oracle.token_ids == ids
    assert oracle.candidates_checked == [VOCAB] * len(ids)
    assert sum(fast.candidates_checked) < sum(oracle.candidates_checked) / 10
    # the oracle's margin is the true gap to the nearest other token's state
    assert all(m > 0 for m in oracle.margins)


def test_noise_below_half_gap_stays_exact():
    model = lminvert.load_model("tiny-gpt2")
    ids = [5, 900, 31000, 12, 12]
    states = encode(model, [ids], 2)
    (result,) = invert(model, states, method="bruteforce", noise=1e-4, seed=3)
    below = [p for p in result.positions if p.whole_vocabulary and p.noise_norm < p.certified_radius]
    assert len(below) == len(ids)  # sanity: this noise level is inside the certified radius everywhere
    assert result.token_ids == ids
    (fast,) = invert(model, states, noise=1e-4, seed=3)
    assert fast.token_ids == ids


def test_heavy_noise_is_flagged_not_silent():
    model = lminvert.load_model("tiny-llama")
    ids = [5, 900, 31000, 12, 77, 4]
    states = encode(model, [ids], 2)
    (result,) = invert(model, states, noise=1.0, seed=0, max_candidates=2048)
    wrong = [i for i, (a, b) in enumerate(zip(result.token_ids, ids, strict=True)) if a != b]
    assert wrong, "noise of the state's own size should not allow exact recovery"
    assert set(wrong) <= set(result.uncertain_positions)
    assert all(0 <= t < VOCAB for t in result.token_ids)


def test_budget_exhausted_keeps_best_and_flags():
    model = lminvert.load_model("tiny-llama")
    states = encode(model, [[5, 6, 7]], 1).states[0] + 0.5  # not a state any token gives
    (result,) = invert(model, states, layer=1, max_candidates=64, check=False)  # past the layer check
    assert len(result.uncertain_positions) == 3
    assert all(c <= 64 for c in result.candidates_checked)
    assert all(0 <= t < VOCAB for t in result.token_ids)


def test_bad_arguments():
    model = lminvert.load_model("tiny-llama")
    states = encode(model, [[5, 6]], 1)
    with pytest.raises(LminvertError, match="policy"):
        invert(model, states, policy="magic")
    with pytest.raises(LminvertError, match="method"):
        invert(model, states, method="magic")
    with pytest.raises(LminvertError, match="weights hash"):
        invert(lminvert.load_model("tiny-qwen2"), states)
    with pytest.raises(LminvertError, match="hidden size"):
        invert(model, torch.zeros(3, 32), layer=1)


def test_options_in_groups_or_by_name_are_the_same_call():
    """:func:`invert`'s options: a group given whole and its fields given by name make the same groups; an unknown
    option, one given both ways, a bad value in a group, and an engine option asked of a rows leak are one-line errors
    raised before any work."""
    by_name = grouped(None, None, None, max_seconds=5.0, together=2, source="float", policy="random")
    whole = grouped(Leak(source="float"), Search(max_seconds=5.0, policy="random"), Run(together=2))
    assert by_name == whole
    assert grouped("kv") == (Leak(kind="kv"), Search(), Run())
    # the kind as a string, the leak's other options by name beside it (as bench_leaks.py calls it)
    assert grouped("kv", source="float") == (Leak(kind="kv", source="float"), Search(), Run())
    assert grouped("kv", together=1)[2] == Run(together=1)  # one prompt at a time: what a rows search does
    for call, needle in [
        (lambda: grouped(max_secs=5), "no option 'max_secs'"),
        (lambda: grouped(search=Search(), max_seconds=5), "both by name and in search="),
        (lambda: grouped(Leak(kind="kv"), source="float"), "both by name and in leak="),
        (lambda: grouped("kv", kind="states"), "kind given twice"),
        (lambda: Search(max_candidates=0), "max_candidates"),
        (lambda: Run(together=0), "together"),
        (lambda: Leak(kind="logits"), "unknown leak"),
        (lambda: grouped("kv", method="bruteforce", max_candidates=4), "takes no --method, --max-candidates"),
        (lambda: grouped("last", together=8), "takes no --together"),
    ]:
        with pytest.raises(LminvertError, match=needle) as caught:
            call()
        assert "\n" not in str(caught.value)
    model = lminvert.load_model("tiny-llama")
    states = encode(model, [[5, 6, 7]], 1)
    (grouped_call,) = invert(model, states, search=Search(first_table=False), run=Run(together=1))
    (named_call,) = invert(model, states, first_table=False, together=1)
    assert grouped_call.token_ids == named_call.token_ids == [5, 6, 7]
    with pytest.raises(LminvertError, match="no option"):
        invert(model, states, maxseconds=3)


def test_states_and_options_of_the_wrong_type_are_one_line_errors_and_numpy_arrays_are_states():
    """What a Python user passes by mistake (text, None, a list of numbers; a string where a number goes; an int where
    a flag goes) is a one-line error before any work, where it was an AttributeError or TypeError from deep inside;
    a numpy array or a list of tensors is read as a tensor is, with the same answer."""
    model = lminvert.load_model("tiny-llama")
    states = encode(model, [[5, 6, 7]], 1)
    tensor = states.states[0]
    for wrong in ("the prompt", None, [[1.0, 2.0]], 3):
        with pytest.raises(LminvertError, match="invert takes hidden states") as caught:
            invert(model, wrong, 1)
        assert "\n" not in str(caught.value)
    typed = [({"max_seconds": "5"}, "max_seconds must be a number, not str '5'"),
             ({"together": "2"}, "together must be an int"), ({"seed": 1.5}, "seed must be an int"),
             ({"speculate": 1}, "speculate must be True or False"), ({"check": "no"}, "check must be"),
             ({"policy": 3}, "policy must be a string"), ({"noise": True}, "noise must be a number"),
             ({"source": 3}, "source must be a name"), ({"executor": 3}, "executor must be a name"),
             ({"leak": 3}, "leak= takes a leak's kind"), ({"run": "fast"}, r"run= takes lminvert\.Run"),
             ({"search": {"max_seconds": 3}}, r"search= takes lminvert\.Search")]  # fmt: skip
    for option, needle in typed:
        with pytest.raises(LminvertError, match=needle):
            invert(model, tensor, 1, **option)
    for same in (tensor.numpy(), [tensor]):
        (result,) = invert(model, same, 1)
        assert result.token_ids == [5, 6, 7]
    with pytest.raises(LminvertError, match="tokenize takes a text"):
        model.tokenize(3)
    with pytest.raises(LminvertError, match="decode takes token ids"):
        model.decode("abc")
    assert model.decode(torch.tensor([5, 6, 7])) == model.decode([5, 6, 7])


def test_one_text_or_one_prompts_ids_are_one_prompt_and_wrong_prompts_are_one_line_errors():
    """``encode(model, "a text", layer)`` encodes one prompt (it encoded one prompt per character), and so do one
    prompt's ids as a flat list, a tensor or a numpy array; a prompt that is neither text nor ids, ``max_tokens=0`` and
    a model name that is not a string are one-line errors."""
    model = lminvert.load_model("tiny-llama")
    text = "a short prompt"
    assert [len(s) for s in encode(model, text, 1).states] == [len(model.tokenize(text))]
    for ids in ([5, 6, 7], torch.tensor([5, 6, 7]), np.array([5, 6, 7])):
        (states,) = encode(model, ids, 1).states
        assert torch.equal(states, encode(model, [[5, 6, 7]], 1).states[0])
    for prompts, needle in [([None], "a prompt is a text or a list of token ids"), ([[1.5, 2]], "a prompt is a text"),
                            ([], "no prompts given")]:  # fmt: skip
        with pytest.raises(LminvertError, match=needle):
            encode(model, prompts, 1)
    with pytest.raises(LminvertError, match="max_tokens must be at least 1"):
        encode(model, [text], 1, max_tokens=0)
    with pytest.raises(LminvertError, match="load_model takes a model's name"):
        lminvert.load_model(None)


def test_cli_json_schema(cli, tmp):
    path = tmp / "s.safetensors"
    enc = cli(
        "encode",
        "--model",
        "tiny-gemma3",
        "--layer",
        "2",
        "--text",
        "Secret: 1234",
        "--text",
        "hi",
        "--out",
        str(path),
        "--json",
        check=True,
    )
    truth = [p["token_ids"] for p in json.loads(enc.stdout)["prompts"]]
    proc = cli("invert", str(path), "--json", "--out", str(tmp / "r.json"), check=True)
    docs = json.loads(proc.stdout)
    assert docs == json.loads((tmp / "r.json").read_text())
    assert [d["token_ids"] for d in docs] == truth
    for d in docs:
        for key in (
            "token_ids",
            "text",
            "seconds",
            "candidates_checked",
            "distances",
            "margins",
            "uncertain_positions",
        ):
            assert key in d
        n = len(d["token_ids"])
        assert len(d["candidates_checked"]) == len(d["distances"]) == len(d["margins"]) == n
        assert len(d["plain_distances"]) == n
        for t, verdict in enumerate(d["verdicts"]):  # certified: reproduced by the search's forward or the plain one
            assert verdict != "certified" or 0.0 in (d["distances"][t], d["plain_distances"][t]), (t, d)
    assert "Secret" in docs[0]["text"]


@pytest.mark.parametrize(
    ("make", "extra", "needle"),
    [
        (lambda t: (t / "x.npy").write_bytes(b"garbage"), ["--model", "tiny-llama", "--layer", "1"], "cannot read"),
        (lambda t: None, ["--model", "tiny-llama"], "not found"),
    ],
)
def test_cli_errors(cli, tmp, make, extra, needle):
    make(tmp)
    proc = cli("invert", str(tmp / "x.npy"), *extra)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--max-candidates", "0"], "--max-candidates"),
        (["--max-seconds", "0"], "--max-seconds"),
        (["--noise", "-1"], "--noise"),
        (["--tolerance-scale", "0"], "--tolerance-scale"),
        (["--source", "bogus"], "bogus"),
        (["--noise", "0.01", "--source", "float"], "not both"),
    ],
)
def test_cli_refuses_bad_options_before_loading_the_model(cli, tmp, monkeypatch, extra, needle):
    """The command's option checks are the library's (:func:`lminvert.invert.grouped`), run before any model
    is loaded: a load here would fail the test."""
    import numpy as np

    import lminvert.cli.invert as command

    np.save(tmp / "x.npy", np.ones((3, 64), np.float32))
    monkeypatch.setattr(command, "model_for_states", lambda *a: pytest.fail("the model was loaded"))
    proc = cli("invert", str(tmp / "x.npy"), "--model", "tiny-llama", "--layer", "1", *extra)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_nan_and_mismatch(cli, tmp):
    import numpy as np

    arr = np.zeros((3, 64), np.float32)
    arr[1, 1] = np.nan
    np.save(tmp / "nan.npy", arr)
    proc = cli("invert", str(tmp / "nan.npy"), "--model", "tiny-llama", "--layer", "1")
    assert proc.returncode == 2 and "NaN" in proc.stderr
    np.save(tmp / "wide.npy", np.ones((3, 96), np.float32))
    proc = cli("invert", str(tmp / "wide.npy"), "--model", "tiny-llama", "--layer", "1")
    assert proc.returncode == 2 and "hidden size" in proc.stderr
    proc = cli("invert", str(tmp / "wide.npy"))
    assert proc.returncode == 2 and "--model" in proc.stderr
    path = tmp / "s.safetensors"
    cli("encode", "--model", "tiny-llama", "--layer", "1", "--text", "abc", "--out", str(path), check=True)
    proc = cli("invert", str(path), "--model", "tiny-qwen2")
    assert proc.returncode == 2 and "weights hash" in proc.stderr


def test_tied_tokens_are_flagged():
    """Two tokens with identical embedding rows give identical states: the position must be marked uncertain."""
    model = lminvert.load_model("tiny-llama", seed=7)
    emb = model.model.get_input_embeddings().weight
    with torch.no_grad():
        emb[4242] = emb[1717]
    states = encode(model, [[5, 1717, 9]], 2)
    (result,) = invert(model, states, first_table=False)  # modified weights: keep them out of the on-disk tables
    assert result.token_ids[0] == 5 and result.token_ids[2] == 9
    assert result.token_ids[1] in (1717, 4242)
    assert 1 in result.uncertain_positions
    other = ({1717, 4242} - {result.token_ids[1]}).pop()
    assert result.positions[1].tied_with == (other,)
    assert result.to_json()["tied_alternatives"] == {1: [other]}
    assert not any(p.stopped for p in result.positions) and "stopped_positions" not in result.to_json()  # no bound


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("layer", [0, 1, 2, "final"])
def test_next_token_prior_is_the_models_own_ranking(family, layer):
    """The blocks above the observed layer, run on the observed states, give the model's own next-token order at
    every position: what a forward over the true prompt gives."""
    from lminvert.invert.proposal import NextTokenPrior

    model = lminvert.load_model(family)
    prompts = [[17, 4021, 3300, 17, 5], [9, 8]]  # two lengths: the shorter is right-padded in the batch
    states = encode(model, prompts, layer).states
    prior = NextTokenPrior(model, model.probe.layer(layer), states, depth=50)
    with torch.no_grad():
        expected = [model.model(torch.tensor([ids])).logits[0].topk(50).indices for ids in prompts]
    assert prior.orders(0) is None
    for t in range(1, len(prompts[0])):
        if t == len(prompts[1]):
            prior.select([0])  # as the engine does: the short prompt is done
        alive = [i for i, ids in enumerate(prompts) if len(ids) > t]
        orders = prior.orders(t)
        assert orders.shape == (len(alive), 1, 50)  # one source: no reading given
        for row, i in enumerate(alive):
            assert torch.equal(orders[row, 0][:10], expected[i][t - 1][:10]), (i, t)


def test_the_fused_source_ranks_by_both_sources_summed_and_changes_no_answer():
    """With a reading, the prior's third source orders the vocabulary by the next-token log-probabilities plus
    ``fused`` times the reading's (the log-softmax of its scores); ``fused=0`` leaves two sources. The policy that
    merges it in gives the same ids and verdicts as the one without it."""
    from lminvert.invert.engine import invert_prompts
    from lminvert.invert.linear import LinearPolicy
    from lminvert.invert.proposal import NextTokenPrior
    from lminvert.invert.reading import input_distances, read

    model = lminvert.load_model("tiny-llama")
    probe, layer = model.probe, model.probe.layer(1)
    prompt = [17, 4021, 3300, 17, 5, 912]
    states = encode(model, [prompt], layer).states
    d = probe.hidden_size
    reading = torch.randn(2 * d + 1, d, generator=torch.Generator().manual_seed(3))  # a linear map: any will do
    prior = NextTokenPrior(model, layer, states, depth=40, reading=reading, fused=0.5)
    with torch.no_grad():
        logits = model.model(torch.tensor([prompt])).logits[0].float()
    scores = -input_distances(model, read(reading, states[0]))
    for t in range(1, len(prompt)):
        both = logits[t - 1].log_softmax(-1) + 0.5 * scores[t].log_softmax(-1)
        orders = prior.orders(t)[0]
        assert orders.shape == (3, 40)
        assert torch.equal(orders[2][:10], both.topk(10).indices), t
        assert torch.equal(orders[1][:10], scores[t].topk(10).indices), t
        assert prior.firsts(0)[t - 1] == [int(orders[1][0]), int(orders[0][0]), int(orders[2][0])]
    assert NextTokenPrior(model, layer, states, depth=40, reading=reading).orders(1).shape == (1, 2, 40)
    assert "fused" in LinearPolicy().rankers and "fused" not in LinearPolicy(fused=0).rankers
    assert LinearPolicy(reading=False).fused == 0
    ids = [[17, 4021, 3300, 17, 5, 912, 64], [3, 2, 1, 700]]
    observed = encode(model, ids, 2).states
    got = {
        fused: invert_prompts(model, observed, 2, policies=[LinearPolicy(fused=fused) for _ in ids])
        for fused in (0.0, 0.5)
    }
    for a, b in zip(got[0.0], got[0.5], strict=True):
        assert a.token_ids == b.token_ids and a.verdicts == b.verdicts
    assert [r.token_ids for r in got[0.5]] == ids


def test_time_split_is_reported():
    model = lminvert.load_model("tiny-gpt2")
    (result,) = invert(model, encode(model, [[5, 900, 31000, 12]], 1))
    split = result.time_split
    assert set(split) == {"ranking", "verification", "extension"} and all(v >= 0 for v in split.values())
    assert split["verification"] > 0 and sum(split.values()) <= result.seconds
    assert result.to_json()["time_split"].keys() == split.keys()


def test_batch_scale_changes_speed_not_the_answer():
    """GPU-sized candidate batches (16x a CPU's, the CUDA default) give the same ids and flags, in fewer rounds."""
    model = lminvert.load_model("tiny-llama")
    ids = [[17, 4021, 3300, 17, 5, 912, 64], [3, 2, 1]]
    states = encode(model, ids, -1)
    small = invert(model, states, batch_scale=1)
    large = invert(model, states, batch_scale=16)
    assert [r.token_ids for r in small] == [r.token_ids for r in large] == ids
    assert [r.uncertain_positions for r in large] == [[], []]
    with pytest.raises(lminvert.LminvertError, match="batch_scale"):
        invert(model, states, batch_scale=0)


def test_tied_groups_are_exactly_equal_rows():
    """Tied groups from the bucketed hash equal those of sorting whole rows: rows that agree on every hashed entry but
    differ elsewhere are not tied, -0.0 and 0.0 are the same input, a group of three is one group. They are kept in
    the model's memo until the vocabulary matrix is edited in place."""
    from types import SimpleNamespace

    from lminvert.models import ties

    gen = torch.Generator().manual_seed(0)
    matrix = torch.randn(300, 200, generator=gen)
    matrix[7] = matrix[3]
    matrix[250] = matrix[3]
    matrix[11] = matrix[5]
    matrix[11, 1] = matrix[5, 1] + 1.0  # column 1 is not hashed (64 of 200): same bucket, different rows
    matrix[20] = 0.0
    matrix[21] = 0.0
    matrix[21, 0] = -0.0
    model = SimpleNamespace(probe=SimpleNamespace(vocab_matrix=lambda: matrix), memo={})
    _, inverse, counts = torch.unique(matrix + 0.0, dim=0, return_inverse=True, return_counts=True)
    expected = sorted(sorted((inverse == g).nonzero().flatten().tolist()) for g in (counts > 1).nonzero().flatten())
    assert ties.tied_token_groups(model) == expected == [[3, 7, 250], [20, 21]]
    assert ties.tied_token_groups(model) == expected and len(model.memo) == 1  # kept
    matrix[8] = matrix[3]  # edited in place: computed again
    assert ties.tied_token_groups(model) == [[3, 7, 8, 250], [20, 21]]


def test_merged_orders_keep_each_token_once_at_its_first_place_and_follow_the_weights():
    from lminvert.invert.proposal import merge

    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([2, 9, 1, 10])
    assert merge(torch.stack([a, b])).tolist() == [1, 2, 9, 3]  # equal weights: alternately, the first source first
    assert merge(torch.stack([torch.tensor([5, 6, 7, 8]), torch.tensor([8, 7, 6, 5])])).tolist() == [5, 8, 6, 7]
    assert merge(torch.stack([a, b]), [1, 0.5]).tolist() == [1, 2, 3, 9]  # two of a's for one of b's
    assert merge(torch.stack([a, b]), [1 / 16, 1]).tolist() == [2, 9, 1, 10]
    assert merge(a[None]).tolist() == a.tolist()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), count=st.integers(2, 4), k=st.integers(1, 300), vocab=st.integers(1, 400))
def test_merged_orders_alternate_alike_with_and_without_the_sort(seed, count, k, vocab):
    """proposal.merge's equal-weight path (no sort) gives the weighted path's order with every weight 1, for orders
    with repeats and ids missing."""
    from lminvert.invert.proposal import merge

    gen = torch.Generator().manual_seed(seed)
    sources = torch.randint(0, vocab, (count, k), generator=gen)
    assert torch.equal(merge(sources), merge(sources, [1.0] * count))


def test_a_source_that_keeps_missing_stops_diluting_the_others_ranks():
    """Random token ids: the next-token prior misses at every position while the reading hits; the reading's 21st
    guess then comes at about place 21 of the merged order instead of 41 (alternately)."""
    from types import SimpleNamespace

    from lminvert.invert.policies import LinearPolicy

    policy = LinearPolicy()
    policy.begin_prompt(torch.zeros(5, 4))
    lm, read = torch.arange(1000, 3048), torch.arange(2048)
    ctx = SimpleNamespace(next_tokens=torch.stack([lm, read]))

    def place(token: int) -> int:
        return int((policy._lm_order == token).nonzero()[0, 0])

    policy._take_order(ctx)
    assert place(20) == 41  # no record yet: alternately
    for t in range(1, 5):  # the reading's first guess right, the prior's top 64 wrong
        policy._take_order(ctx)
        policy.accepted(t, 0)
    policy._take_order(ctx)
    assert place(20) <= 22
    assert policy._lm_order[:64].tolist().count(1000) == 1  # the missing source keeps a place (it may recover)


def test_the_reading_map_reads_tokens_from_their_own_states():
    """The reading map (fitted offline on sampled text and random ids, cached per layer) ranks held-out prompts'
    tokens near the top from their observed states alone, far better than chance (1 in 49,152 for the first)."""
    from lminvert.invert.reading import reading_map, reading_orders

    model = lminvert.load_model("tiny-llama")
    layer = model.probe.layer(2)
    weights = reading_map(model, layer)
    assert weights.shape == (2 * model.probe.hidden_size + 1, model.probe.hidden_size)
    assert reading_map(model, layer) is weights  # cached on the loaded model
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, model.probe.vocab_size, (3, 12), generator=gen).tolist()
    states = encode(model, ids, layer).states
    hits = sum(
        int(token in reading_orders(model, weights, state, 16)[t].tolist())
        for prompt, state in zip(ids, states, strict=True)
        for t, token in enumerate(prompt)
    )
    assert hits >= len(ids) * 12 // 2


@pytest.mark.parametrize(
    "settings",
    [
        {"norm_rank": 1},
        {"norm_rank": 1000},
        {"explore_max": 4096},
        {"trusted": 1},
        {"reread": False},
        {"local_from": 0, "carried": 0},
        {"reading": False},
    ],
    ids=[
        "norms-rank-one",
        "norms-exact",
        "random-samples-after-a-miss",
        "trusted-one",
        "no-recentred-reading",
        "no-local-no-carried",
        "no-reading-source",
    ],
)
def test_ranking_settings_change_speed_never_the_answer(settings, monkeypatch):
    """Row norms of the secant ranking from one eigenpair or exact, random samples after a miss, a one-candidate first
    batch: the order of verification changes, the recovered ids and flags do not (every candidate is verified)."""
    import importlib

    policies = importlib.import_module("lminvert.invert.policies")

    class Variant(policies.LinearPolicy):
        def __init__(self, **kw):
            super().__init__(**{**settings, **kw})

    model = lminvert.load_model("tiny-llama")
    ids = [[17, 4021, 3300, 17, 5, 912, 64, 64, 7, 30000], [3, 2, 1, 48000]]
    states = encode(model, ids, 2)
    default = invert(model, states)
    monkeypatch.setitem(policies.POLICIES, "linear", Variant)
    varied = invert(model, states)
    assert [r.token_ids for r in default] == [r.token_ids for r in varied] == ids
    assert [r.uncertain_positions for r in varied] == [[], []]


def test_projected_norms_of_the_secant_ranking():
    """The ranking's ``||x_v J||^2`` from the top eigenpairs of ``J J^T`` and the others' mean: exact for a small
    input dimension, exact when the other eigenvalues are equal, and close to the exact norms of a fitted-like ``J``
    (the order the ranking needs)."""
    from lminvert.invert.secant import projected_norms

    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(500, 32, generator=gen)
    row_norms = rows.square().sum(1)

    def exact(jac):
        return (rows @ jac).square().sum(1)

    jac = torch.randn(32, 32, generator=gen)
    torch.testing.assert_close(projected_norms(rows, row_norms, jac, 16), exact(jac))  # d <= 2 rank: exact
    basis, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    spectrum = torch.cat([torch.tensor([9.0, 7.0, 5.0, 4.0]), torch.full((28,), 0.5)])
    jac = basis * spectrum  # J J^T = basis diag(spectrum^2) basis^T: four large eigenvalues, the rest equal
    torch.testing.assert_close(projected_norms(rows, row_norms, jac, 4), exact(jac), rtol=1e-4, atol=1e-4)
    jac = basis * torch.linspace(3.0, 0.1, 32)  # a smooth spectrum: approximate, in the same order
    approx, ref = projected_norms(rows, row_norms, jac, 8), exact(jac)
    assert float((approx - ref).abs().max() / ref.max()) < 0.3
    assert torch.corrcoef(torch.stack([approx, ref]))[0, 1] > 0.9
    low = projected_norms(rows, row_norms, jac, 8, rows.bfloat16())  # the product on a bfloat16 copy: nearly the same
    assert low.dtype == torch.float32 and float((low - approx).abs().max() / approx.max()) < 0.02


@pytest.mark.parametrize("width", [32, 20])
def test_the_randomised_eigenpairs_are_the_full_decompositions(width, monkeypatch):
    """secant.top_pairs: the largest eigenpairs of ``J J^T`` as ``eigh`` gives them, up to their signs, for a square and
    a wide-to-narrow ``J`` (a KV view's rows), the same from one call to the next; projected_norms alike both ways."""
    from lminvert.invert import secant

    gen = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    jac = (basis * torch.logspace(1, -2, 32))[:, :width] @ torch.linalg.qr(torch.randn(width, width, generator=gen)).Q
    vectors, values = secant.top_pairs(jac, 6)
    full_vectors, full_values = secant._eigen_pairs(jac, 6)
    torch.testing.assert_close(values.flip(0), full_values, rtol=1e-4, atol=1e-6)
    assert torch.allclose((vectors.flip(1) * full_vectors).sum(0).abs(), torch.ones(6), atol=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(secant.top_pairs(jac, 6), (vectors, values), strict=True))
    rows = torch.randn(300, 32, generator=gen)
    fast = secant.projected_norms(rows, rows.square().sum(1), jac, 6)
    monkeypatch.setattr(secant, "RANDOMISED", False)
    torch.testing.assert_close(fast, secant.projected_norms(rows, rows.square().sum(1), jac, 6), rtol=1e-3, atol=1e-3)


def _reading_context(vocab: torch.Tensor, ids: list[int], target: int, position: int = 1):
    """A position whose candidates ``ids`` were verified, on a model whose state is its input vector itself."""
    from types import SimpleNamespace

    probe = SimpleNamespace(vocab_matrix=lambda dtype: vocab, vocab_dots=lambda x: vocab @ x)
    chosen = torch.tensor(ids)
    return SimpleNamespace(
        probe=probe,
        position=position,
        target=vocab[target],
        all_ids=lambda: chosen,
        all_states=lambda: vocab[chosen],
    )


def test_the_reading_recentred_on_the_verified_candidates_cancels_its_error():
    """A reading off by a constant vector at this position: its own ranking puts the token far down, the same reading
    less its mean error on the verified candidates puts it first; each candidate's state is read once."""
    from lminvert.invert.rankers import RereadRanker

    gen = torch.Generator().manual_seed(4)
    vocab = torch.nn.functional.normalize(torch.randn(500, 8, generator=gen), dim=1)
    bias = 2.0 * torch.nn.functional.normalize(torch.randn(8, generator=gen), dim=0)
    reads = []

    def reading(inputs: torch.Tensor) -> torch.Tensor:  # features: [unit state, unit previous, 1]
        reads.append(len(inputs))
        return inputs[:, :8] + bias

    true = 123
    ranker = RereadRanker()
    ranker.begin_prompt(vocab[[7, true]], None)
    ranker.reading, ranker.vocab_sq = reading, vocab.square().sum(1)
    raw = ranker.vocab_sq - 2 * vocab @ (vocab[true] + bias)
    assert int((raw < raw[true]).sum()) > 10  # the reading alone misses
    scores = ranker.scores(_reading_context(vocab, [3, 40, 41, 300], true))
    assert int(scores.argmin()) == true
    ranker.scores(_reading_context(vocab, [3, 40, 41, 300, 9, 10], true))
    assert reads == [2, 4, 2]  # the prompt's own states once, then only the new candidates
    ranker.begin_position(_reading_context(vocab, [5], true))  # a new position: its own error
    assert ranker.scores(_reading_context(vocab, [5], true)) is not None and reads == [2, 4, 2, 1]


def test_a_ranking_that_keeps_missing_gets_a_smaller_part_of_later_batches():
    """Each ranking's part of a position's later batches follows how high its first ranking put the recovered tokens
    earlier in the prompt: all of a batch for the best, a floor for one that keeps missing; all of it before any
    record."""
    from lminvert.invert.linear import STREAM_FLOOR, STREAMS, LinearPolicy

    policy = LinearPolicy()
    policy.begin_prompt(torch.zeros(5, 4))
    assert policy._stream_shares() == dict.fromkeys(STREAMS, 1.0)
    near = torch.arange(1000.0)  # scores (lowest first): the token (0) ranks first
    far = -near  # ... last
    for t in range(1, 4):
        order = torch.tensor([9, 8, 7, 0, 5])  # the proposal's 4th
        policy._first_scores = {"secant": far, "reread": near, "proposal": order}
        policy.accepted(t, 0)
    shares = policy._stream_shares()
    assert shares["reread"] == 1.0
    assert shares["secant"] == STREAM_FLOOR
    assert shares["proposal"] == pytest.approx(2 ** (1 - math.log2(5)))
    policy.begin_prompt(torch.zeros(5, 4))  # a new prompt: no record
    assert policy._stream_shares() == dict.fromkeys(STREAMS, 1.0)


def test_a_later_batch_is_topped_up_by_the_rankings_that_have_more_when_one_runs_out(monkeypatch):
    """The proposal's order holds its top 2,048 only: once every one of them is verified, its part of a later batch
    goes to the rankings that still have unseen candidates (by their shares), so batches keep their size; switched
    off, the batch shrinks to what those rankings were asked for."""
    from types import SimpleNamespace

    from lminvert.invert import linear

    vocab = 100
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[:20] = True  # the proposal's order (ids 0-19) is spent
    ctx = SimpleNamespace(seen=seen, checked=20, unseen=lambda ranked, k: ranked[~seen[ranked]][:k])
    streams = {
        "secant": torch.arange(vocab, 0, -1.0),
        "reread": torch.arange(float(vocab)),
        "proposal": torch.arange(20),
    }
    share = {"secant": 0.5, "reread": 0.25, "proposal": 1.0}
    picks = torch.cat([torch.arange(99, 91, -1), torch.arange(20, 24)])  # what the three were asked: 8, 4, 0 unseen
    topped = linear._refill(ctx, picks, streams, share, 16)
    assert len(topped) == len(topped.unique()) == 16 and not seen[topped].any()
    assert torch.equal(topped[: len(picks)], picks)
    assert topped[len(picks) :].tolist() == [91, 90, 89, 24]  # the 4 missing: secant 3 (its share 2/3), reread 1
    monkeypatch.setattr(linear, "REFILL", False)
    assert torch.equal(linear._refill(ctx, picks, streams, share, 16), picks)


def test_an_ablation_is_a_configuration_of_the_rankers():
    """Each ranker is left out by its setting, and the policy mixes exactly the rankers it names."""
    from lminvert.invert.linear import LinearPolicy, SecantPolicy
    from lminvert.invert.rankers import RANKERS

    assert list(LinearPolicy().rankers) == list(RANKERS)
    only = LinearPolicy(local_from=0, carried=0, reread=False, reading=False, sink=False)
    assert list(only.rankers) == ["secant", "next-token"]
    assert list(SecantPolicy().rankers) == ["secant", "local", "carried", "reread", "sink"]


def test_a_ranking_is_scores_or_an_order():
    """Both kinds of ranking answer the same two questions: a token's place, and the best unseen candidates."""
    from types import SimpleNamespace

    from lminvert.invert.rankers import rank_of, top_unseen

    scores = torch.tensor([3.0, -1.0, 2.0, 0.5, 9.0])
    order = torch.tensor([4, 2, 0])
    assert [rank_of(scores, i) for i in range(5)] == [3, 0, 2, 1, 4]
    assert [rank_of(order, i) for i in (4, 2, 0, 1)] == [0, 1, 2, 6]  # a token the order lacks: twice its length
    seen = torch.tensor([False, True, False, False, False])

    def unseen(ranking, count):
        ids = ranking[~seen[ranking]]
        return ids[:count]

    ctx = SimpleNamespace(checked=1, unseen=unseen)
    assert top_unseen(ctx, scores, 2).tolist() == [3, 2]
    assert top_unseen(ctx, order, 2).tolist() == [4, 2]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_a_layer_without_its_own_table_ranks_position_0_with_the_table_of_a_layer_above(name, isolated_cache, caplog):
    from lminvert.invert.tables import first_position_table, first_table_for, table_path

    model = lminvert.load_model(name)
    probe = model.probe
    top, low = probe.layer(probe.n_layers), probe.layer(1)
    ids = [1234, 77, 9000, 5, 40000]
    states = encode(model, [ids], low)
    with caplog.at_level("WARNING", logger="lminvert.invert.tables"):
        before = first_table_for(model, low, progress=False)  # nothing kept above: the layer's own is built
    assert before.at == low and table_path(model, low, "table").is_file()
    assert f"lminvert models --prepare {name}" in caplog.text  # the user is told how to build it once for all
    caplog.clear()
    table_path(model, low, "table").unlink()
    model = lminvert.load_model(name)  # a fresh process: nothing held in memory
    first_position_table(model, top, progress=False)  # what the preparation keeps
    (result,) = invert(model, states, scout=False)  # the table's ranking alone (a scout adds its own first batch)
    assert result.token_ids == ids and result.uncertain_positions == []
    assert result.positions[0].candidates_checked <= 8  # the lifted target is nearest its own token's row
    assert not table_path(model, low, "table").is_file()  # no forward of the whole vocabulary at layer 1
    assert "no first-position table" not in caplog.text
    assert first_table_for(model, low, progress=False).at == top
    table_path(model, top, "table").unlink()
    fresh = lminvert.load_model(name)
    assert first_table_for(fresh, top, progress=False).at == top  # the last layer: nothing above, its own is built


def test_the_final_layer_ranks_position_0_with_the_last_blocks_table_through_the_final_norm(isolated_cache):
    """With only the last block's table kept (what the preparation keeps), the final layer's ranking is that table
    through the final norm: every token's own final state alone, up to rounding, and no table of its own is built."""
    from lminvert.invert.tables import first_position_table, first_table_for, table_path

    model = lminvert.load_model("tiny-llama")
    probe = model.probe
    last, final = probe.layer(probe.n_layers), probe.layer("final")
    first_position_table(model, last, progress=False)
    ranked = first_table_for(model, final, progress=False)
    assert ranked.at == final and not table_path(model, final, "table").is_file()
    tokens = torch.tensor([[3], [17], [250]])
    alone = probe.states(tokens, [final])[final][:, 0].float()
    assert torch.allclose(ranked.table[tokens[:, 0]].float(), alone, rtol=1e-4, atol=1e-5)
    ids = [12, 345, 6]
    (result,) = invert(model, encode(model, [ids], final), scout=False)  # the table's ranking alone
    assert result.token_ids == ids and result.uncertain_positions == []
    assert result.positions[0].candidates_checked <= 8


def test_sinks_are_positions_after_the_first_far_over_the_median_norm():
    """``sinks.sinks``: positions after the first whose state's norm is over RATIO times the median of those
    positions' (position 0, the first sink, never counts); none where too few positions give a median."""
    from lminvert.invert import sinks

    states = torch.ones(8, 4)
    states[0] *= 1000.0  # the first position's sink
    states[1] *= 50.0
    states[5] *= 3.0  # within RATIO of the median
    assert sinks.sinks(states) == [1]
    assert sinks.sinks(states[:3]) == []  # two positions after the first: no median to speak of
    assert sinks.sinks(torch.ones(6, 4)) == []


def test_the_engine_takes_known_first_tokens_and_claims_nothing_wrong_after_a_wrong_one():
    """``InvertConfig(known=...)``: the engine starts after the known first tokens (placeholders there: uncertain,
    reason KNOWN, no candidate) and recovers the rest over that prefix; after a wrong known token no later position is
    claimed wrongly."""
    from lminvert.invert.engine import InvertConfig, invert_prompts
    from lminvert.invert.results import KNOWN

    model = lminvert.load_model("tiny-llama")
    prompt = [5, 1717, 9, 4242, 77, 1200]
    states = encode(model, [prompt], 2).states[0]
    (given,) = invert_prompts(model, [states], 2, InvertConfig(known=(5, 1717)))
    assert given.token_ids == prompt and given.candidates_checked[:2] == [0, 0]
    assert [p.reason for p in given.positions[:2]] == [KNOWN] * 2 and given.verdicts[:2] == ["uncertain"] * 2
    assert given.verdicts[2:] == ["certified"] * 4
    (wrong,) = invert_prompts(model, [states], 2, InvertConfig(known=(5, 1718), max_candidates=256))
    for token, truth, verdict in zip(wrong.token_ids[2:], prompt[2:], wrong.verdicts[2:], strict=True):
        assert token == truth or verdict == "uncertain", (wrong.token_ids, wrong.verdicts)
