"""What one vector (a prompt's last-position state, ``--leak last``) gives a search for the whole prompt, measured
before any one-vector search is built: two probes on held-out prompts (``heldout.DEEP``), SmolLM2, this CPU.

* ``--probe offsets``: ridge maps from the last position's unit state at a layer to the input vector of the token
  ``k`` positions before it (k = 0: the last token itself), fitted on sampled text and random ids
  (:func:`lminvert.invert.reading.training_prompts`, 600 text windows and 100 random-id prompts, 24 tokens); printed per
  layer and offset: the true token's median rank among the vocabulary by distance from the map's prediction, and the
  share of positions where it ranks first and within the first 100. Evaluated at positions 7 and 15 of each text.
* ``--probe swaps``: a greedy token-swap search of known length (HotFlip/GCG-style: each round, per position, the
  16 tokens the gradient of the squared distance ranks first and the model's 8 likeliest next tokens; up to
  ``--batch`` single swaps verified in one batched forward, the nearest kept if it is nearer), from a prompt of
  token 0; printed per prompt: exact or not, the rounds run, the relative distance reached, seconds.
* ``--probe prefix``: whether one vector scores a partial prompt, as a left-to-right search would need: the prompt's
  first ``--kept`` tokens kept, the next position's token replaced by each of ``--others`` random tokens and the true
  one, the last token kept at its own position, the positions between either left out (``--gap skip``: the last
  token's position id kept) or filled with " the" (``--gap fill``); printed per prompt: the true token's rank among
  the others by the last state's distance from the prompt's.

    python benchmarks/probe_last.py --probe offsets
    python benchmarks/probe_last.py --probe swaps --layer 1 --length 4 --rounds 40 --batch 128 --prompts 6
    python benchmarks/probe_last.py --probe prefix --layer 15 --length 8 --kept 3 --gap skip --prompts 8
    python benchmarks/probe_last.py --probe descent --layer 15 --length 4 --others 2000 --prompts 8

* ``--probe descent``: whether exhaustive sweeps would find the prompt, length given: coordinate descent from random
  tokens (the last one the layer's reading of the vector), each pass sweeping positions from the second-to-last down
  to 0 and then the last, each position's token set to the one whose prompt's last state lies nearest, the other
  positions held (their forwards with bfloat16 GEMMs where native: they only choose; the end is checked by a plain
  forward), until a pass changes nothing or after ``--passes``. ``--others N``: a sweep tries the true token, the
  current one and ``N`` random ones (an oracle proxy for the whole vocabulary at a fraction of its cost: more
  distractors can only add wrong minima); ``--others 0``: the whole vocabulary (no oracle; about ``V`` forwards of
  up to ``--length`` tokens per position and pass); ``--prior K``: the current token and the model's ``K`` likeliest
  after the current prefix (no oracle). Printed per prompt: exact or not, positions right after each
  pass, the final relative distance, seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch

from heldout import DEEP


def offsets(model, layers: list[str], depth: int = 8) -> None:
    from lminvert.forward import prompt_states
    from lminvert.invert.reading import training_prompts

    probe = model.probe
    vocab = probe.vocab_matrix(torch.float32).double()
    resolved = probe.layers(layers)
    train = training_prompts(model, text=600, random=100)
    states = prompt_states(model, train, resolved, progress=False)
    held = [model.tokenize(t)[:16] for t in DEEP]
    held_states = prompt_states(model, held, resolved, progress=False)

    def row(state: torch.Tensor) -> torch.Tensor:
        state = state.double()
        return torch.cat([state / state.norm(), torch.ones(1, dtype=torch.float64)])

    for layer in resolved:
        pairs = zip(train, states, strict=True)
        x = torch.stack([row(s[layer][i]) for p, s in pairs for i in range(depth - 1, len(p))])
        gram = x.T @ x
        gram += 1e-4 * gram.diagonal().mean() * torch.eye(len(gram), dtype=gram.dtype)
        cells = []
        for k in range(depth):
            y = torch.stack([vocab[p[i - k]] for p in train for i in range(depth - 1, len(p))])
            weights = torch.linalg.solve(gram, x.T @ y)
            ranks = []
            for ids, s in zip(held, held_states, strict=True):
                for i in (7, 15):
                    distance = (vocab - row(s[layer][i]) @ weights).square().sum(1)
                    ranks.append(int((distance < distance[ids[i - k]]).sum()))
            r = torch.tensor(ranks, dtype=torch.float64)
            cells.append(f"k={k}: {r.median():.0f} {(r == 0).double().mean():.2f} {(r < 100).double().mean():.2f}")
        print(f"layer {layer.name:>5} (median rank, top-1, top-100) " + " | ".join(cells), flush=True)


def swaps(model, layer_spec: str, length: int, rounds: int, batch: int, count: int) -> None:
    probe = model.probe
    layer = probe.layer(layer_spec)
    vocab = probe.vocab_matrix(torch.float32)
    rng = random.Random(0)

    def last(rows: list[list[int]]) -> torch.Tensor:
        return probe.states(torch.tensor(rows), layer)[layer][:, -1].float()

    exact = 0
    for text in DEEP[:count]:
        ids = model.tokenize(text)[:length]
        target = last([ids])[0]
        start = time.perf_counter()
        guess = [0] * length
        best = float((last([guess])[0] - target).norm())
        done = 0
        while done < rounds:
            done += 1
            inputs = vocab[torch.tensor(guess)].clone().requires_grad_(True)
            state = probe.embeds_states(inputs[None], layer)[layer][0, -1].float()
            (state - target).square().sum().backward()
            scores = inputs.grad @ vocab.T  # the loss's first-order change per swap, up to a constant per position
            with torch.no_grad():
                prior = model.model(input_ids=torch.tensor([guess])).logits[0].float()
            swaps_ = []
            for k in range(length):
                tokens = (-scores[k]).topk(16).indices.tolist()
                if k > 0:
                    tokens += prior[k - 1].topk(8).indices.tolist()
                swaps_ += [(k, t) for t in tokens if t != guess[k]]
            rng.shuffle(swaps_)
            rows = [[*guess[:k], t, *guess[k + 1 :]] for k, t in swaps_[:batch]]
            distances = (last(rows) - target).norm(dim=1)
            j = int(distances.argmin())
            if float(distances[j]) < best:
                best, guess = float(distances[j]), rows[j]
            if guess == ids:
                break
        exact += guess == ids
        print(
            f"{'exact' if guess == ids else 'wrong'} rounds={done} distance/norm={best / float(target.norm()):.4f} "
            f"{time.perf_counter() - start:.1f} s  {model.decode(ids)!r} -> {model.decode(guess)!r}",
            flush=True,
        )
    print(f"{exact}/{count} exact (layer {layer.name}, {length} tokens)")


def prefix(model, layer_spec: str, length: int, kept: int, gap: str, others: int, count: int) -> None:
    probe = model.probe
    layer = probe.layer(layer_spec)
    if layer.is_final or int(layer) < 1:
        raise SystemExit("--probe prefix takes a numbered layer from 1")
    fill = model.tokenize(" the")[0]
    generator = torch.Generator().manual_seed(0)
    block = model.model.model.layers[int(layer) - 1]  # layer l: block l's output, before the final norm

    def last(rows: list[list[int]], positions: list[int]) -> torch.Tensor:
        kept_out = {}

        def hook(module, args, out):
            kept_out["h"] = out[0] if isinstance(out, tuple) else out

        handle = block.register_forward_hook(hook)
        try:
            ids = torch.tensor(rows)
            model.model.model(input_ids=ids, position_ids=torch.tensor([positions]).expand(len(rows), -1))
        finally:
            handle.remove()
        return kept_out["h"][:, -1].double()

    ranks = []
    for text in DEEP[:count]:
        ids = model.tokenize(text)[:length]
        with torch.no_grad():
            target = last([ids], list(range(length)))[0]
        plain = probe.states(torch.tensor(ids), layer)[layer][0, -1].double()
        assert float((target - plain).norm()) <= 1e-5 * float(plain.norm()), "not lminvert's numbering of layers"
        tokens = [ids[kept], *torch.randint(0, probe.vocab_size, (others,), generator=generator).tolist()]
        if gap == "skip":
            rows = [[*ids[:kept], t, ids[-1]] for t in tokens]
            positions = [*range(kept + 1), length - 1]
        else:
            rows = [[*ids[:kept], t, *[fill] * (length - 2 - kept), ids[-1]] for t in tokens]
            positions = list(range(length))
        with torch.no_grad():
            distances = torch.cat(
                [(last(rows[i : i + 128], positions) - target).norm(dim=1) for i in range(0, len(rows), 128)]
            )
        ranks.append(int((distances[1:] < distances[0]).sum()))
        print(f"rank {ranks[-1]:>4} of {others}  {model.decode(ids)!r}", flush=True)
    r = torch.tensor(ranks, dtype=torch.float64)
    print(
        f"layer {layer.name}, {length} tokens, {kept} kept, gap {gap}: median rank {r.median():.0f} of {others}, "
        f"first in {int((r == 0).sum())}/{len(ranks)}"
    )


def descent(model, layer_spec: str, length: int, others: int, count: int, passes: int, prior_top: int) -> None:
    from lminvert.invert.prefix_prior import Prior
    from lminvert.invert.reader import reading_for
    from lminvert.invert.reading import reading_orders

    probe = model.probe
    layer = probe.layer(layer_spec)
    vocab = probe.vocab_size
    generator = torch.Generator().manual_seed(0)
    fast = probe.screening if probe.can_screen else contextlib.nullcontext
    weights = reading_for(model, layer)
    prior = Prior(model)

    def last(prefix: torch.Tensor, suffixes: torch.Tensor) -> torch.Tensor:
        """The last state of ``prefix + suffix`` for each row of ``suffixes``, the prefix's cache made once."""
        cache = probe.prefix(prefix.tolist(), layer) if len(prefix) else None
        out = []
        with torch.no_grad(), fast():
            for part in suffixes.split(1024):
                if cache is None:
                    out.append(probe.states(part, layer)[layer][:, -1].float())
                else:
                    out.append(probe.chains(cache, part)[0][:, -1].float())
        return torch.cat(out)

    exact = 0
    for text in DEEP[:count]:
        ids = torch.tensor(model.tokenize(text)[:length])
        with torch.no_grad():
            target = probe.states(ids[None], layer)[layer][0, -1].float()
        start = time.perf_counter()
        guess = torch.randint(0, vocab, (length,), generator=generator)
        guess[-1] = int(reading_orders(model, weights, target[None].to(probe.device), 1)[0][0])
        right = []
        for _ in range(passes):
            before = guess.clone()
            for k in [*range(length - 2, -1, -1), length - 1]:
                if prior_top:  # no oracle: the prior's likeliest after the current prefix, the current token
                    after = prior.logprobs([tuple(guess[:k].tolist())])[0].topk(prior_top).indices
                    tokens = torch.cat([guess[k : k + 1], after]).unique()
                elif others:
                    tokens = torch.cat(
                        [ids[k : k + 1], guess[k : k + 1], torch.randint(0, vocab, (others,), generator=generator)]
                    )
                else:
                    tokens = torch.arange(vocab)
                suffixes = guess[k:].repeat(len(tokens), 1)
                suffixes[:, 0] = tokens
                guess[k] = tokens[(last(guess[:k], suffixes) - target).norm(dim=1).argmin()]
            right.append(int((guess == ids).sum()))
            if torch.equal(guess, before):
                break
        with torch.no_grad():
            plain = probe.states(guess[None], layer)[layer][0, -1].float()
        found = torch.equal(guess, ids)
        exact += found
        print(
            f"{'exact' if found else 'wrong'} right after each pass {right} "
            f"distance/norm={float((plain - target).norm() / target.norm()):.4f} {time.perf_counter() - start:.1f} s  "
            f"{model.decode(ids.tolist())!r} -> {model.decode(guess.tolist())!r}",
            flush=True,
        )
    sweep = f"the true token, the current one and {others} random ones" if others else "the whole vocabulary"
    if prior_top:
        sweep = f"the current token and the prior's {prior_top} likeliest after the current prefix"
    print(f"{exact}/{count} exact (layer {layer.name}, {length} tokens, each sweep {sweep})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--probe", choices=("offsets", "swaps", "prefix", "descent"), required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", default="1,15,30,final", help="--probe offsets")
    parser.add_argument("--layer", default="1", help="--probe swaps")
    parser.add_argument("--length", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--kept", type=int, default=3, help="--probe prefix: the prompt's tokens kept")
    parser.add_argument("--gap", choices=("skip", "fill"), default="skip", help="--probe prefix")
    parser.add_argument(
        "--others", type=int, default=511,
        help="--probe prefix: random tokens; --probe descent: random tokens per sweep beside the true one (0: all)",
    )  # fmt: skip
    parser.add_argument("--passes", type=int, default=4, help="--probe descent: passes at most")
    parser.add_argument(
        "--prior", type=int, default=0,
        help="--probe descent: sweep the current token and the model's K likeliest after the current prefix instead "
        "(no oracle)",
    )  # fmt: skip
    args = parser.parse_args()
    import lminvert

    torch.manual_seed(0)
    model = lminvert.load_model(args.model)
    print(f"{args.model}, {torch.get_num_threads()} threads")
    if args.probe == "offsets":
        offsets(model, args.layers.split(","))
    elif args.probe == "descent":
        descent(model, args.layer, args.length, args.others, args.prompts, args.passes, args.prior)
    elif args.probe == "prefix":
        prefix(model, args.layer, args.length, args.kept, args.gap, args.others, args.prompts)
    else:
        swaps(model, args.layer, args.length, args.rounds, args.batch, args.prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
