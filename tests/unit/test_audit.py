"""The audit: defences keep their declared bounds, the attacks recover what they should and never claim a wrong token,
KV caches are read as transformers stores them, and the command refuses bad input in one line."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import lminvert
from lminvert.audit import audit, make_leak, parse_defence
from lminvert.errors import LminvertError
from lminvert.invert.rows.attack import TieSort, unpermute
from lminvert.invert.sources import parse_source
from lminvert.models.kv import kv_block

from ..conftest import empty_cache, run_cli

DEFENCES = ["none", "noise:0.01", "quant:int8", "quant:fp8", "permute", "drop:0.25", "project:16", "noise:1"]


@pytest.fixture(scope="module")
def tiny():
    return lminvert.load_model("tiny-llama")


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """The quick audit of a tiny model on a cache of its own (:func:`empty_cache`): what other tests left in the shared
    cache for the same model and layer must not decide what this audit finds."""
    out = tmp_path_factory.mktemp("audit")
    root = empty_cache(tmp_path_factory.mktemp("audit") / "cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMINVERT_CACHE", str(root))
        doc = audit(
            out, model="tiny-llama", quick=True, kinds=["random"], defences=DEFENCES, progress=False, last_seconds=0.5
        )
    return doc, out


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(
        ["noise:0.001", "noise:0.01", "noise:0.1", "quant:bf16", "quant:fp16", "quant:fp8", "quant:int8", "quant:int4"]
    ),
    scale=st.floats(min_value=1e-2, max_value=1e3),
)
@example(seed=55, name="noise:0.001", scale=1.0)  # beyond the bound from the observed norm at 4 sigma
def test_each_defence_keeps_its_declared_error_bound(seed, name, scale):
    """What a defence ships lies within its error model's bound of the true rows, computed from the shipped row (as an
    attacker holds it)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, 96, generator=gen) * scale
    rows[:, int(torch.randint(0, 96, (1,), generator=gen))] *= 40  # an outlier coordinate, as attention sinks have
    assume(name != "quant:fp16" or float(rows.abs().max()) < 65504)  # float16's largest: beyond it a cast is inf
    shipped = parse_defence(name).apply(rows, gen)
    model = parse_source(shipped.source)
    for t in range(len(rows)):
        error = float((shipped.rows[t].double() - rows[t].double()).norm())
        assert error <= model.bound(shipped.rows[t], t) * (1 + 1e-5)


def test_structural_defences_do_what_they_declare():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 32, generator=gen)
    permuted = parse_defence("permute").apply(rows, gen)
    assert permuted.permuted and torch.equal(permuted.kept, rows)
    assert torch.equal(permuted.rows.sort(1).values, rows.sort(1).values)
    table = torch.cat([torch.randn(50, 32, generator=gen), rows[:1]])
    undone, token = unpermute(permuted.rows, table)
    assert token == 50 and torch.equal(undone, rows)
    dropped = parse_defence("drop:0.5").apply(rows, gen)
    missing = torch.isnan(dropped.rows).any(1)
    assert int(missing.sum()) == 4 and torch.equal(dropped.rows[~missing], rows[~missing])
    projected = parse_defence("project:8").apply(rows, gen)
    assert projected.rows.shape == (8, 8) and torch.allclose(projected.public(rows), projected.rows)
    p = parse_defence("project:8").matrix(32)
    assert torch.allclose(p @ p.T, torch.eye(8), atol=1e-5) and torch.allclose(projected.kept, projected.rows @ p)
    assert parse_defence("drop:0.99").apply(rows[:3], gen).rows[:, 0].isnan().sum() == 2  # never every position


def test_a_permutation_undone_up_to_ties_compares_rows_through_the_tie_map():
    """In bfloat16 a row's values repeat: matching sorted values cannot tell tied dimensions apart, so the undone rows
    may differ from the true ones, but never through :class:`TieSort`, which sorts values within tied groups."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(50, 64, generator=gen).to(torch.bfloat16).float()
    table[7, :16] = table[7, 16:32]  # token 7's row: 16 values twice
    rows = torch.cat([table[7:8], torch.randn(5, 64, generator=gen)])  # position 0 is token 7's row
    secret = torch.randperm(64, generator=gen)
    undone, token = unpermute(rows[:, secret], table)
    assert token == 7
    tied = TieSort(table[7])
    assert tied.size == 16 and torch.equal(tied(undone), tied(rows))
    assert not torch.equal(undone, rows)  # tied dimensions were swapped: the map is what makes them comparable
    assert TieSort(torch.arange(64.0)).size == 0  # nothing tied: the identity
    assert torch.equal(TieSort(torch.arange(64.0))(rows), rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rows_search_allows_a_half_model_one_unit_of_rounding(dtype):
    """Calibration prompts can find a bfloat16 cached forward bit-identical to the observer's while other prompts'
    rows differ in the last bits (SmolLM2, a permuted prompt: 7 of 8 positions left uncertain): the rows search's
    rounding radius never falls below one unit of the model's precision; a float32 model's stays at the float floor."""
    from lminvert.invert.rows.calibration import Measured
    from lminvert.invert.rows.search import RowSearch
    from lminvert.invert.sources import Exact
    from lminvert.invert.tolerance import FLOOR, SAFETY

    model = lminvert.load_model("tiny-llama", dtype=dtype)
    table = torch.zeros(model.probe.vocab_size, 4)
    search = RowSearch(model, model.probe.layer(1), lambda s, t: s, Exact(), Measured(0.0, 0.0, 0.0), table)
    row = torch.full((4,), 3.0)  # norm 6
    unit = FLOOR if dtype == "float32" else float(torch.finfo(torch.bfloat16).eps)
    assert search.radii(row, 2).cached == pytest.approx(SAFETY * unit * 6.0)


def test_bad_defences_and_leaks_are_refused_in_one_line(tiny):
    for bad in ("noise", "noise:-1", "quant:int3", "drop:1", "project:0", "permute:3", "blur"):
        with pytest.raises(LminvertError) as err:
            parse_defence(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(LminvertError, match="blocks 1"):
        make_leak("kv", tiny, tiny.probe.layer(0))
    with pytest.raises(LminvertError, match="smaller k"):
        parse_defence("project:1000").check(64)


def test_kv_rows_are_the_cache_transformers_keeps(tiny):
    ids = [5, 17, 300, 2, 999, 42, 7]
    for block in (1, tiny.probe.n_layers):
        kv = kv_block(tiny, block)
        cached = kv.cached(ids)
        states = tiny.probe.states(torch.tensor(ids), [block - 1])[block - 1][0]
        rows = torch.cat([kv.rows(states[t : t + 1], t) for t in range(len(ids))])
        assert cached.shape == (len(ids), kv.width)
        assert float((rows - cached).norm() / cached.norm()) < 1e-5
        with torch.no_grad():
            before = tiny.model(input_ids=torch.tensor([ids])).logits
            with kv.replaced(cached):
                after = tiny.model(input_ids=torch.tensor([ids])).logits
            with kv.replaced(torch.zeros_like(cached)):
                zeroed = tiny.model(input_ids=torch.tensor([ids])).logits
        assert torch.allclose(before, after, atol=1e-4) and not torch.allclose(before, zeroed, atol=1e-4)


def _cells(rows, **match):
    return [r for r in rows if all(r[k] == v for k, v in match.items())]


def test_no_defence_leaks_every_token_from_states_and_kv_alike(run):
    doc, _ = run
    rows = doc["rows"]
    for leak in ("states", "kv"):
        cell = _cells(rows, leak=leak, defence="none")
        assert cell and all(r["exact"] for r in cell)
        assert all(r["top1"] == 1.0 and r["dloss"] == 0.0 for r in cell)  # no defence: the deployment is unchanged
    for leak in ("states", "kv"):  # a secret permutation is undone; a public projection searched through
        for defence in ("permute", "project:16", "noise:0.01", "quant:int8"):
            assert all(r["exact"] for r in _cells(rows, leak=leak, defence=defence)), (leak, defence)


def test_no_wrong_token_is_ever_claimed_and_heavy_noise_is_uncertain(run):
    doc, _ = run
    assert all(r["wrong_claimed"] == 0 for r in doc["rows"])
    heavy = _cells(doc["rows"], defence="noise:1")
    assert heavy and all(r["verdicts"]["uncertain"] == r["length"] for r in heavy if r["leak"] != "last")
    dropped = _cells(doc["rows"], defence="drop:0.25", leak="states")
    assert all(r["verdicts"]["uncertain"] >= 2 for r in dropped)  # 2 of 8 positions missing: guessed, uncertain
    last = _cells(doc["rows"], leak="last")  # 8 tokens: longer than one vector's search finds in half a second
    assert last and all(r["verdicts"]["uncertain"] == len(r["recovered"]) and not r["exact"] for r in last)
    assert {r["route"] for r in last} == {"last", "last-table"}  # projected or permuted: the last token guessed


def test_the_last_leak_gives_back_a_short_prompt_whole_through_the_one_vector_search(tiny, tmp_path):
    """The audit's ``last`` leak runs ``lminvert invert --leak last``'s search: a short prompt's last state gives it
    back whole and certified with no defence, never a wrong prompt claimed under noise; a permuted vector falls back
    to the last token's guess."""
    prompts = tmp_path / "short.txt"
    prompts.write_text("Hi\nOK go\n")
    doc = audit(
        tmp_path / "out", model="tiny-llama", quick=True, prompts_file=str(prompts), leaks=["last"],
        defences=["none", "noise:0.01", "permute"], progress=False, last_seconds=5,
    )  # fmt: skip
    rows = doc["rows"]
    truth = [list(tiny.tokenize(text)) for text in ("Hi", "OK go")]
    assert all(len(ids) <= 2 for ids in truth)
    none = _cells(rows, defence="none")
    assert none and all(r["exact"] and r["verdicts"]["certified"] == r["length"] for r in none)
    assert all(r["wrong_claimed"] == 0 for r in rows) and all(r["route"] == "last" for r in none)
    assert all(r["route"] == "last-table" and len(r["recovered"]) == 1 for r in _cells(rows, defence="permute"))


def test_a_loaded_model_is_audited_as_it_is_and_a_missing_directory_or_model_is_one_line(tiny, tmp_path):
    """``audit(out, model=<a loaded model>)`` runs on that model, recorded by its name (its config was not JSON: a
    TypeError); no ``out`` or a model of no kind is a one-line error before any work."""
    doc = audit(
        tmp_path / "loaded", model=tiny, quick=True, prompts=1, length=4, layers=[1], leaks=["states"],
        defences=["none"], progress=False,
    )  # fmt: skip
    assert doc["config"]["models"] == [tiny.name] and doc["rows"] and all(r["exact"] for r in doc["rows"])
    for call, needle in [(lambda: audit(None, model="tiny-llama"), "audit needs a directory"),
                         (lambda: audit(tmp_path / "x", model=3), "model must be a model's name")]:  # fmt: skip
        with pytest.raises(LminvertError, match=needle):
            call()


def test_the_report_holds_the_leak_matrix_and_a_verdict_per_layer(run):
    doc, out = run
    text = (out / "results.md").read_text()
    assert "Leak matrix, states" in text and "Leak matrix, kv" in text and "lminvert audit --quick" in text
    assert any(note.startswith("states at layer 1:") for note in doc["summary"]["notes"])
    assert (out / "figures" / "audit_kv.png").exists()


def test_the_command_refuses_bad_input_before_any_work(tmp_path):
    for args in (
        ["--defences", "noise:x"],
        ["--leaks", "cache"],
        ["--leaks", "kv", "--layers", "0"],
        ["--prompts", str(tmp_path / "missing.txt")],
        ["--size", "last_seconds=-1"],
    ):
        result = run_cli("audit", "--model", "tiny-llama", "--quick", *args, "--out", str(tmp_path / "o"))
        assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_the_state_memo_runs_a_candidate_once_and_changes_no_answer(tiny):
    """The states the rows searches of one leak and layer verified are kept (invert.rows.memo.StateMemo): a second
    defence's search over the same prompts runs far fewer candidates through the model and finds the same tokens with
    the same verdicts as a search without the memo; a memo over its limit drops the prefixes used longest ago."""
    from lminvert.invert.rows.attack import Attack
    from lminvert.invert.rows.memo import StateMemo

    layer = tiny.probe.layer(2)
    leak = make_leak("states", tiny, layer)
    prompts = [[5, 17, 300, 2, 999, 42], [9, 8, 7, 6, 5]]
    clean = [leak.capture(ids) for ids in prompts]
    without, kept = Attack(leak, memo=False), Attack(leak)
    assert without.memo is None and kept.memo is not None
    computed = []
    for label in ("noise:0.01", "quant:int8"):
        generator = torch.Generator().manual_seed(0)
        shipped = [parse_defence(label).apply(rows, generator) for rows in clean]
        a, b = without.run(shipped), kept.run(shipped)
        assert [(r.token_ids, r.verdicts) for r in a] == [(r.token_ids, r.verdicts) for r in b], label
        assert [r.token_ids for r in b] == prompts, label
        computed.append(kept.memo.computed)
    assert kept.memo.hits > 0 and computed[1] - computed[0] < computed[0] / 2  # the second defence mostly hits

    memo = StateMemo(tiny, layer)
    prefix = tiny.probe.prefix(prompts[0][:3], layer)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    first = memo.states(prompts[0][:3], ids, lambda missing: tiny.probe.continuation(prefix, missing))
    torch.testing.assert_close(first, tiny.probe.continuation(prefix, ids), rtol=1e-5, atol=1e-5)
    again = memo.states(prompts[0][:3], ids.flip(0), lambda _: pytest.fail("a kept state ran through the model"))
    assert torch.equal(again, first.flip(0)) and memo.hits == 6 and memo.computed == 6
    small = StateMemo(tiny, layer, limit=1)
    for t in (2, 3, 4):
        small.states(
            prompts[0][:t], ids, lambda x, t=t: tiny.probe.continuation(tiny.probe.prefix(prompts[0][:t], layer), x)
        )
    assert list(small._kept) == [tuple(prompts[0][:4])] and small.bytes == first.numel() * first.element_size()
    order = memo.prediction(prompts[0][:3], lambda: torch.arange(tiny.probe.vocab_size).flip(0))
    again = memo.prediction(prompts[0][:3], lambda: pytest.fail("a kept prediction was computed again"))
    assert torch.equal(order, again) and int(order[0]) == tiny.probe.vocab_size - 1


def test_a_first_token_several_fit_is_chosen_by_the_next_row(tiny):
    """Where position 0's row does not single out its token (an attention sink's norm lets noise cover the gaps
    between first tokens), the next row chooses among the nearest: here the row lies nearer another first token than
    its own, beyond the error bound of both. Without the lookahead the nearer wrong token is kept; with it the prompt
    comes back whole. Either way position 0 is a guess: every verdict ``uncertain``, none claimed."""
    from lminvert.invert.rows.attack import Attack
    from lminvert.invert.rows.search import RowSearch

    layer = tiny.probe.layer(2)
    leak = make_leak("states", tiny, layer)
    ids = [5, 17, 300, 2, 999, 42]
    attack = Attack(leak, memo=False)
    shipped = leak.capture(ids)
    table = attack.table
    gaps = (table - table[ids[0]]).norm(dim=1)
    gaps[ids[0]] = float("inf")
    other = int(gaps.argmin())
    shipped[0] = table[ids[0]] + 0.6 * (table[other] - table[ids[0]])  # nearer the other token
    found = {}
    for lookahead in (False, True):
        search = RowSearch(
            tiny, layer, leak.rows_of, parse_source("noise:0.05"), attack._measure(None), table, lookahead=lookahead
        )
        found[lookahead] = search.run(shipped)
    assert found[False].token_ids[0] == other
    assert found[True].token_ids == ids
    assert all(v == "uncertain" for f in found.values() for v in f.verdicts)


def _rows_search(model, layer, leak, attack, source: str, lookahead: bool):
    """A rows search of ``leak`` under ``source`` with ``attack``'s measurement and table, no capture."""
    from lminvert.invert.rows.search import RowSearch

    return RowSearch(
        model, layer, leak.rows_of, parse_source(source), attack._measure(None), attack.table, lookahead=lookahead
    )


def test_a_later_guess_whose_state_is_sink_like_is_chosen_by_the_next_row(tiny):
    """Where a later position's own row does not choose and its guess's state is sink-like (a capture made elsewhere:
    :mod:`lminvert.invert.rows.sinklike`, told here), the next row chooses among every token of the vocabulary
    (:meth:`lminvert.invert.rows.lookahead.Lookahead.later`): the row at position 2 lies nearer another token's than
    its own, beyond the error bound of both. Without it the nearer wrong token is kept; with it the prompt comes back
    whole. Without a measured rate the choice stays a guess: every verdict from position 2 on ``uncertain``."""
    from lminvert.invert.rows.attack import Attack

    layer = tiny.probe.layer(2)
    leak = make_leak("states", tiny, layer)
    ids = [5, 17, 300, 2, 999, 42]
    attack = Attack(leak, memo=False)
    shipped = leak.capture(ids)
    rows = leak.rows_of(tiny.probe.continuation(tiny.probe.prefix(ids[:2], layer), torch.arange(1000)).float(), 2)
    gaps = (rows - rows[ids[2]]).norm(dim=1)
    gaps[ids[2]] = float("inf")
    other = int(gaps.argmin())
    shipped[2] = rows[ids[2]] + 0.6 * (rows[other] - rows[ids[2]])  # nearer the other token

    class Told:  # position 2's guess is sink-like
        def fragile(self, prefix, token, memo=None):
            return len(prefix) == 2

    asked = []
    found = {}
    for lookahead in (False, True):
        search = _rows_search(tiny, layer, leak, attack, "noise:0.05", lookahead)
        search.sinks = Told()
        later = search.ahead.later
        search.ahead.later = lambda prefix, *a, later=later, **k: asked.append(list(prefix)) or later(prefix, *a, **k)
        found[lookahead] = search.run(shipped)
    assert asked == [ids[:2]]  # only at the sink-like guess, only with the lookahead
    assert found[False].token_ids[2] == other
    assert found[True].token_ids == ids
    for f in found.values():
        assert all(v != "uncertain" for v in f.verdicts[:2]) and all(v == "uncertain" for v in f.verdicts[2:])


def test_a_later_sink_is_found_from_a_wrong_guess(tiny, monkeypatch):
    """:meth:`lminvert.invert.rows.lookahead.Lookahead.later` given a wrong own guess (the token whose row lies
    farthest from the position's): the next row chooses the true token, under the next token found from the guess or,
    where nothing fits under that one, from the token whose own row lay nearest in the same chains; a guess, never
    claimed, without a measured rate. With one try alone, nothing wrong is claimed either."""
    from lminvert.invert.rows import lookahead
    from lminvert.invert.rows.attack import Attack

    layer = tiny.probe.layer(2)
    leak = make_leak("states", tiny, layer)
    ids = [5, 17, 300, 2, 999, 42]
    attack = Attack(leak, memo=False)
    shipped = leak.capture(ids)
    search = _rows_search(tiny, layer, leak, attack, "noise:0.01", True)
    rows = leak.rows_of(tiny.probe.continuation(tiny.probe.prefix(ids[:2], layer), torch.arange(1000)).float(), 2)
    wrong = int((rows - shipped[2]).norm(dim=1).argmax())
    order = torch.cat(
        [torch.tensor([wrong]), torch.arange(tiny.probe.vocab_size)[torch.arange(tiny.probe.vocab_size) != wrong]]
    )
    decision, ran, _ = search.ahead.later(ids[:2], shipped[2], order, shipped[3], None, None)
    assert decision.token == ids[2] and decision.verdict == "uncertain" and ran >= tiny.probe.vocab_size
    monkeypatch.setattr(lookahead, "LATER_TRIES", 1)
    once, _, _ = search.ahead.later(ids[:2], shipped[2], order, shipped[3], None, None)
    assert once.token in (ids[2], wrong) and once.verdict == "uncertain"


def test_each_rule_by_the_next_row_is_measured_once_under_its_own_name(tiny):
    """:meth:`lminvert.invert.rows.lookahead.Lookahead.calibration`: position 0's rule and a later sink's are measured
    apart, each once, kept under their own names; none without a capture."""
    from lminvert.invert.rows.lookahead import LATER, Lookahead

    kept: list[str] = []
    capture = lambda ids: torch.zeros(3, 4)  # noqa: E731
    ahead = Lookahead(None, capture=capture, kept=lambda name, build: kept.append(name) or build())
    ahead._measure = lambda: torch.tensor([4.0, 0.0])
    ahead._measure_later = lambda: torch.tensor([2.0, 1.0])
    assert ahead.calibration() == (4, 0) and ahead.calibration(LATER) == (2, 1)
    assert ahead.calibration() == (4, 0) and ahead.calibration(LATER) == (2, 1)
    assert kept == ["", LATER]
    assert Lookahead(None).calibration(LATER) is None


@pytest.mark.parametrize("reuse", [False, True])
@pytest.mark.parametrize("at", [1, 2, "final"])
def test_the_running_prefix_grows_the_caches_a_search_would_compute_whole(tiny, at, reuse, monkeypatch):
    """rows.running.Running: the prediction after the recovered prefix and the probe's prefix at the layer, grown a
    token at a time, are those computed over the whole prefix (the same order; states within float32 rounding), and
    a prefix that is not the running one is not served by it. With ``reuse``, a token that was one of the position's
    candidates grows the cache from their forward (only the blocks above the layer run: none at the last block's), so
    a forward through every block runs only where it was not."""
    from lminvert.invert.rows.running import Running, predicted

    probe = tiny.probe
    layer = probe.layer(at)
    ids = [5, 17, 300, 2, 999, 42, 7, 64]
    running = Running(tiny, layer, reuse)
    assert running.reuse == reuse  # tiny-llama's blocks can be skipped: reuse holds at every layer
    forwards = []
    advance = probe.advance_rows
    monkeypatch.setattr(probe, "advance_rows", lambda *args: forwards.append(1) or advance(*args))
    candidates = torch.tensor([4, 8, 15, 16, 23, 42])
    offered = 0
    for t, token in enumerate(ids):
        if t and t % 3 != 2:  # the token among the position's candidates (at every third position it is not)
            states = running.candidates(torch.tensor([11, token, 3]))
            whole = probe.continuation(probe.prefix(ids[:t], layer), torch.tensor([11, token, 3]))
            torch.testing.assert_close(states, whole, rtol=1e-5, atol=1e-5)
            offered += 1
        running.add(token)
        assert running.holds(ids[: t + 1]) and not running.holds(ids[:t]) and not running.holds([])
        if t % 2 and t % 3 == 2:  # caches not asked for here: the tokens added since join the next forward
            continue
        whole = predicted(tiny, ids[: t + 1])
        torch.testing.assert_close(running.log_probs(), whole, rtol=1e-5, atol=1e-5)
        assert torch.equal(running.log_probs().argsort(descending=True)[:20], whole.argsort(descending=True)[:20]), t
        grown = probe.continuation(running.prefix(), candidates)
        again = probe.continuation(probe.prefix(ids[: t + 1], layer), candidates)
        torch.testing.assert_close(grown, again, rtol=1e-5, atol=1e-5)
    # with reuse, a forward only where the cache grew by a token that was no candidate (positions 0, 2 and 5, the
    # last caught up by position 6's candidates); without, one wherever the cache is asked for after a token was added
    # (every position but 5, and at 6 twice: the candidates, then the check after the token)
    assert len(forwards) == (len(ids) - offered if reuse else 8)


def test_a_missing_position_is_chosen_by_the_next_row(tiny):
    """A dropped position whose token the model ranks far down its prediction: the prediction's first is wrong, the
    next row (shipped whole) chooses the right one (the rest of the prompt comes back whole too); every verdict from
    the missing position on is ``uncertain``, and none is claimed wrongly."""
    from lminvert.invert.rows.attack import Attack
    from lminvert.invert.rows.running import predicted

    layer = tiny.probe.layer(2)
    leak = make_leak("states", tiny, layer)
    prefix = [5, 17, 300]
    ids = [
        *prefix,
        int(predicted(tiny, prefix).argsort(descending=True)[100]),
        999,
        42,
    ]  # the prediction's 101st token at position 3
    shipped = leak.capture(ids)
    shipped[3] = float("nan")
    attack = Attack(leak, memo=False)
    found = {}
    for lookahead in (False, True):
        found[lookahead] = _rows_search(tiny, layer, leak, attack, "noise:0.01", lookahead).run(shipped)
    assert found[False].token_ids[3] != ids[3]
    assert found[True].token_ids == ids
    for f in found.values():
        assert all(v == "uncertain" for v in f.verdicts[3:]) and all(v != "uncertain" for v in f.verdicts[:3])


def test_the_secant_model_changes_which_candidates_run_not_the_answer(tiny):
    """invert.rows.rankers.Secant (the engine's secant model, carried from position to position) only orders candidates:
    searches with and without it recover the same tokens with the same verdicts from states and from a KV cache; a
    later batch's order is still every token once; for states the first fit is the position-1 map, for KV rows
    there is none until candidates are verified."""
    from lminvert.invert.rows.attack import Attack
    from lminvert.invert.rows.rankers import Secant

    layer = tiny.probe.layer(2)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tiny.probe.vocab_size, (8,), generator=generator).tolist() for _ in range(2)]
    for name in ("states", "kv"):
        leak = make_leak(name, tiny, layer)
        shipped = [parse_defence("noise:0.001").apply(leak.capture(ids), generator) for ids in prompts]
        # without the reading, whose first candidates hold tiny-llama's true tokens: later batches run
        plain, carried = (Attack(leak, memo=False, secant=on, reading=False) for on in (False, True))
        a, b = plain.run(shipped), carried.run(shipped)
        assert [r.token_ids for r in b] == prompts, name
        assert [(r.token_ids, r.verdicts) for r in a] == [(r.token_ids, r.verdicts) for r in b], name
        assert sum(sum(r.checked[1:]) for r in b) > 32 * 7 * len(prompts), name  # later batches ran
        secant = Secant(tiny, layer, states=name == "states")
        secant.begin_prompt()
        assert (secant.ranker.jac is not None) == (name == "states")
        secant.begin(3, shipped[0].rows[3])
        batch = torch.arange(64)
        prefix = tiny.probe.prefix(prompts[0][:3], leak.states_layer)
        secant.add(batch, leak.rows_of(tiny.probe.continuation(prefix, batch), 3))
        secant.ranker.fit(secant.ctx)
        order = secant.order()
        assert order is not None and torch.equal(order.sort().values, torch.arange(tiny.probe.vocab_size))


def test_growing_the_prefix_from_the_candidates_forward_changes_no_answer(tiny):
    """RowSearch(reuse): the recovered prefix grown from the chosen candidate's forward (the block above the layer run
    on its state) gives the same tokens and verdicts as one grown by a forward through every block, from states and
    from a KV cache, and the prompts are recovered whole."""
    from lminvert.invert.rows.attack import Attack

    layer = tiny.probe.layer(1)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, tiny.probe.vocab_size, (8,), generator=generator).tolist() for _ in range(2)]
    for name in ("states", "kv"):
        leak = make_leak(name, tiny, layer if name == "states" else tiny.probe.layer(2))
        shipped = [parse_defence("noise:0.001").apply(leak.capture(ids), generator) for ids in prompts]
        grown, reused = Attack(leak, memo=False, reuse=False), Attack(leak, memo=False)
        a, b = grown.run(shipped), reused.run(shipped)
        assert [r.token_ids for r in b] == prompts, name
        assert [(r.token_ids, r.verdicts) for r in a] == [(r.token_ids, r.verdicts) for r in b], name


def test_screening_changes_which_candidates_run_in_full_not_the_answer(tiny, monkeypatch):
    """rows.screen: with large later batches screened with bfloat16 GEMMs first, the searches recover the same tokens
    with the same verdicts from states and from a KV cache, and candidates were screened out; where a position's row
    fits nothing after fitted ones (searched through the vocabulary), the screened-out candidates are verified in full
    before the position counts as swept, so it checks every token exactly once."""
    from dataclasses import replace

    from lminvert.invert.rows.attack import Attack
    from lminvert.invert.rows.screen import Screened

    screened_out, taken = [], []
    add, take = Screened.add, Screened.take
    monkeypatch.setattr(Screened, "add", lambda self, ids, d: screened_out.append(len(ids)) or add(self, ids, d))

    def taking(self, *within):
        before, got = self.count, take(self, *within)
        taken.append((before, len(got)))
        return got

    monkeypatch.setattr(Screened, "take", taking)
    layer = tiny.probe.layer(2)
    generator = torch.Generator().manual_seed(3)  # prompts some of whose positions need later batches
    prompts = [torch.randint(0, tiny.probe.vocab_size, (8,), generator=generator).tolist() for _ in range(2)]
    for name in ("states", "kv"):
        leak = make_leak(name, tiny, layer)
        shipped = [parse_defence("noise:0.001").apply(leak.capture(ids), generator) for ids in prompts]
        # without the reading, whose first candidates hold tiny-llama's true tokens: later batches run
        full, screened = (Attack(leak, memo=False, reading=False, screen=on) for on in (False, True))
        assert not full.screen and 0 < screened.calibration.screened() < 0.1
        screened_out.clear()
        a, b = full.run(shipped), screened.run(shipped)
        assert [r.token_ids for r in b] == prompts, name
        assert [(r.token_ids, r.verdicts) for r in a] == [(r.token_ids, r.verdicts) for r in b], name
        assert sum(screened_out) > 0, name
    leak = make_leak("states", tiny, layer)
    rows = leak.capture(prompts[0])
    rows[5] = torch.randn(rows.shape[1], generator=generator) * rows[5].norm() / rows.shape[1] ** 0.5
    broken = replace(parse_defence("noise:0.001").apply(rows, generator), rows=rows)
    taken.clear()
    found, plain = (Attack(leak, memo=False, screen=on).run([broken])[0] for on in (True, False))
    assert found.checked[5] == tiny.probe.vocab_size and found.verdicts[5] == "uncertain"
    # where nothing fits (position 5, and the positions after it, given a guess) the nearest is the same token
    assert (found.token_ids, found.verdicts) == (plain.token_ids, plain.verdicts)
    # every screened-out candidate (thousands) ran in full before the sweep ended
    assert any(before == got > 1000 for before, got in taken), taken


def test_the_calibration_runs_its_forwards_once_for_every_leak_map_and_later_run(tiny, isolated_cache, monkeypatch):
    """invert.rows.calibration: the cached and screened forwards' states of one layer are computed once, kept beside the
    tables bit for bit, and serve a states leak and a KV leak reading that layer, and a projection of either; a new
    process (the model's memo emptied) reads them from disk without a forward of a candidate."""
    from lminvert.invert.rows.calibration import KIND, SCREEN_KIND, Calibration

    def forget() -> None:  # as in a new process: the loaded model keeps none of them
        for key in [k for k in tiny.memo if isinstance(k, tuple) and k[0] in (KIND, SCREEN_KIND)]:
            del tiny.memo[key]

    forget()
    layer = tiny.probe.layer(1)
    states, kv = make_leak("states", tiny, layer), make_leak("kv", tiny, tiny.probe.layer(2))
    assert kv.states_layer == layer
    first = Calibration(tiny, layer, states.rows_of, states.capture)
    measured, screened = first.measured(), first.screened()
    assert 0 < measured.rounding < 1e-4 and measured.first == measured.rest == 0.0 and 0 < screened < 0.1
    again = first._run()  # the kept states are the forwards' own, bit for bit
    assert first._cached is not None and len(first._cached) == len(again) > 100
    for (t, a, b), (u, c, d) in zip(first._cached, again, strict=True):
        assert t == u and torch.equal(a, c) and torch.equal(b, d) and a.dtype == c.dtype
    assert list(isolated_cache.glob(f"tables/*{KIND}*"))
    runs = []
    for name in ("continuation", "chains"):
        real = getattr(type(tiny.probe), name)
        monkeypatch.setattr(type(tiny.probe), name, lambda *a, real=real, **k: runs.append(1) or real(*a, **k))
    forget()
    other = Calibration(tiny, layer, kv.rows_of, kv.capture)
    assert other.measured().rounding > 0 and other.screened() > 0 and not runs
    projection = torch.randn(kv.width, 8, generator=torch.Generator().manual_seed(0))
    assert other.measured(lambda rows: rows @ projection).rounding > 0 and not runs


def test_the_calibration_of_several_layers_runs_in_one_pass_the_forwards_each_layer_runs_alone(tiny, isolated_cache):
    """invert.rows.calibration.calibrate_rows: the cached forward's states and the gap's candidates of every block layer
    asked for come from the forwards of the highest, equal bit for bit to what each layer's own calibration runs; layer
    0 runs alone; what is kept is then read, not run again."""
    from lminvert.invert.rows import calibration as rc

    def forget() -> None:
        for key in [k for k in tiny.memo if isinstance(k, tuple) and k[0] in (rc.KIND, rc.GAP_KIND)]:
            del tiny.memo[key]

    forget()
    probe = tiny.probe
    layers = [probe.layer(0), probe.layer(1), probe.layer(probe.n_layers)]
    assert rc.calibrate_rows(tiny, layers) == layers
    assert rc.calibrate_rows(tiny, layers) == []  # kept: nothing runs again
    for layer in layers:
        alone = rc.Calibration(tiny, layer, lambda states, t: states, lambda ids: torch.empty(0))
        kept = alone._kept(rc.KIND, lambda: pytest.fail("the kept states were run again"))
        run = alone._run()  # the layer's own forwards
        assert len(kept) == len(run) > 50
        for (t, a, b), (u, c, d) in zip(kept, run, strict=True):
            assert t == u and torch.equal(a, c) and torch.equal(b, d)
        others = rc._others(tiny, [layer], alone.prompts)[layer]
        assert torch.equal(rc.kept(tiny, layer, rc.GAP_KIND, per_device=True).cpu(), others)


@pytest.mark.parametrize("source", [None, "noise:0.01"])
def test_block_1s_candidates_read_from_the_table_are_the_cached_forwards_bit_for_bit(tiny, source, monkeypatch):
    """invert.rows.search.ALONE_TABLE: block 1's cache (an alone view) verifies its later candidates from the layer-0
    table instead of a prefix's forward; every distance, margin and verdict is the same, bit for bit, and no prefix is
    made for a later position."""
    from lminvert.invert.rows import search
    from lminvert.invert.rows.attack import Attack, Observed

    leak = make_leak("kv", tiny, tiny.probe.layer(1))
    ids = [5, 310, 17, 17, 4021, 9, 88]
    rows = leak.capture(ids)
    if source is not None:
        rows = parse_source(source).simulate(rows, torch.Generator().manual_seed(0))
    found = {}
    for on in (False, True):
        monkeypatch.setattr(search, "ALONE_TABLE", on)
        made: list[int] = []
        real = type(tiny.probe).prefix
        counted = lambda self, *a, made=made, real=real, **k: made.append(1) or real(self, *a, **k)  # noqa: E731
        monkeypatch.setattr(type(tiny.probe), "prefix", counted)
        found[on] = Attack(leak, memo=False).run([Observed(rows, source)])[0]
        monkeypatch.undo()
        assert (not made) == on or source is not None, made
    off, on = found[False], found[True]
    assert on.token_ids == off.token_ids and on.verdicts == off.verdicts and on.checked == off.checked
    assert on.distances == off.distances and on.margins == off.margins


def test_the_reading_and_the_prediction_rank_every_token_once_fused_or_not(monkeypatch):
    """rows.rankers.StateReading.ranked: every token once; the fused order alternates with the plain one, so a token
    stands at most twice as far down as there; without FUSE, the reading's and the prediction's first tokens
    alternate."""
    from lminvert.invert.proposal import fuse, ranked
    from lminvert.invert.rows import rankers

    gen = torch.Generator().manual_seed(5)
    prior, reading = torch.randn(500, generator=gen).log_softmax(0), torch.randn(500, generator=gen).log_softmax(0)
    reader = rankers.StateReading.__new__(rankers.StateReading)  # ranked() reads no state of its own
    monkeypatch.setattr(rankers, "FUSE", False)
    plain = reader.ranked(prior, reading)
    assert plain[:2].tolist() == [int(reading.argmax()), int(prior.argmax())]
    monkeypatch.setattr(rankers, "FUSE", True)
    both = reader.ranked(prior, reading)
    assert sorted(both.tolist()) == list(range(500)) and sorted(plain.tolist()) == list(range(500))
    assert int(both[0]) == int(fuse(prior, reading, rankers.FUSED).argmax())
    place = torch.empty(500, dtype=torch.long)
    place[plain] = torch.arange(500)
    assert all(int((both == t).nonzero()) <= 2 * int(place[t]) + 1 for t in range(500))
    assert torch.equal(ranked(prior, descending=True), prior.argsort(descending=True))  # no ties among these


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.booleans(), st.integers(1, 6))
def test_the_first_candidates_alone_are_the_whole_orders_first(top, seed, fuse, ties):
    """rows.search.PARTIAL: StateReading.ranked's order cut to its first ``top`` by partial sorts is the whole order's
    first ``top`` (scores drawn from ``ties`` distinct values per source too: ties may change places, never members
    beyond the last tied place), fused or not."""
    from lminvert.invert.rows import rankers

    gen = torch.Generator().manual_seed(seed)
    prior, reading = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    if ties < 6:  # few distinct scores: many ties
        prior, reading = prior.mul(ties).round(), reading.mul(ties).round()
    reader = rankers.StateReading.__new__(rankers.StateReading)
    old = rankers.FUSE
    rankers.FUSE = fuse
    try:
        whole, first = reader.ranked(prior, reading), reader.ranked(prior, reading, top)
    finally:
        rankers.FUSE = old
    assert len(first) == top and len(set(first.tolist())) == top
    if ties == 6:  # no ties: the very same candidates in the same order
        assert torch.equal(first, whole[:top])
