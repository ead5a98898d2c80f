"""The acceptance test: L2 balls around the observed state, with radii measured on the model, not assumed.

The observed states came from a plain forward of the whole prompt (what :func:`lminvert.encode` runs, and what a
leaking system runs). The engine verifies candidates differently: a cached, batched one-position forward. The two
round differently; by how much depends on the dtype (float32: ~1e-6 of the state's norm on SmolLM2; bfloat16: up
to several 1e-2), the layer, the device and the kernels. So the radii are measured once per model weights, dtype,
layer and device type, by :func:`calibrate`, on calibration prompts the model itself provides (random token ids,
and greedy continuations of random first tokens, i.e. text the model finds likely):

* ``cached`` - the largest relative disagreement ``||v - h|| / ||h||`` between the engine's verification ``v`` of
  the true token (all calibration prompts advanced together over one batched prefix cache, the true token among
  0 to 127 other candidates per prompt, so that several batch shapes are seen; on a GPU, where batches are 16x
  larger, also among 1,023) and the plain forward's state ``h``; and of the states of chains (several positions of
  each prompt in one forward, over prefixes grown from earlier chains' keys and values, as the engine speculates);
* ``plain`` - the same for a plain forward of prefix + candidate, uncached, several rows at once, *not* shaped like
  the observer's (length t + 1). The engine confirms at the observer's shape, which on the same device reproduces
  the observation exactly; the radius measured here covers observers whose shapes or kernels it cannot reproduce
  (states from another machine, or encoded in a padded batch);
* ``gap`` - the smallest relative distance from ``h`` to the verified state of any *other* candidate. The others are
  the true token's nearest input vectors (up to ``HARD``) and random ones: a position's nearest token can still lie
  nearer (:mod:`.nearest` measures it), so the acceptor counts on a quarter of it (:attr:`.acceptor.Radii.apart`).
* ``screen`` - where the engine screens (:mod:`.engine`: a float32 model's large batches first run with bfloat16
  GEMMs, :meth:`lminvert.models.LayerProbe.screening`), the largest relative disagreement of the true token's
  screened state with ``h``, over the same batches (measured and cached apart, by :func:`screen_calibration`).

Each is measured twice, the second time with the continuations packed side by side over the shared prefix, as the
probe runs them over long prefixes (:meth:`lminvert.models.LayerProbe.always_packed`): the radii cover both paths.

The radius of a test is ``SAFETY * max(measured, FLOOR) * ||h||`` (+ the noise bound when noise was added): ``SAFETY =
4`` covers the tail beyond the sample maximum; ``FLOOR`` (float32's eps) keeps a bit-exact measurement from giving a
zero radius. ``gap`` decides how acceptance works: where the radius is narrower, a single match in the inner half of the
ball is the token; where it is wider (half precision), acceptance rests on confirmation (:mod:`lminvert.invert.search`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..forward import prompt_states
from ..models import Layer, LoadedModel
from .context import batch_scale
from .nearest import near_inputs
from .tables import build_lock, cached, kept

SAFETY = 4.0
KIND = "calibration5"  # the cache's name for it; a new name whenever measure() changes (2: prefixes grown from the
# verification's own keys and values, as the engine grows them; 3: chains of several positions measured too; 4: the
# continuations packed side by side over the shared prefix, prefix.continue_prefix; 5: HARD candidates among the others)
CHAIN = 4  # positions per chain measured (the engine's speculative verification, :mod:`.speculation`)
FLOOR = float(torch.finfo(torch.float32).eps)


def norm(state: torch.Tensor) -> float:
    """``||state||`` (accumulated in float32 on the state's device: a radius needs no more)."""
    return float(torch.linalg.vector_norm(state.float()))


@dataclass(frozen=True)
class Calibration:
    """Measured relative disagreements of one model, dtype, layer and device type (see the module docstring)."""

    cached: float  # max ||verification - plain|| / ||plain|| of the true token
    plain: float  # max ||confirmation forward - plain|| / ||plain||
    gap: float  # min ||other candidate - plain|| / ||plain||
    samples: int  # positions measured
    scale: float = 1.0  # multiplies the radii (InvertConfig.tolerance_scale)
    screen: float | None = None  # max ||screened state - plain|| / ||plain|| of the true token (None: not screening)
    # the same disagreements' SCREEN_QUANTILE (None: not screening): what the scout's ball and its rule read
    # (:func:`scout_error`), where the maximum is one outlier's (Gemma-3-270m layer 18: 5.8% at one position of 72, the
    # 90th percentile 1.9%)
    screen_typical: float | None = None

    def radius(self, target: torch.Tensor) -> float:
        """Acceptance radius of the engine's cached verification around the observed state ``target``."""
        return self.scale * SAFETY * max(self.cached, FLOOR) * norm(target)

    def confirm_radius(self, target: torch.Tensor) -> float:
        """Acceptance radius of the plain (uncached) forward of prefix + candidate."""
        return self.scale * SAFETY * max(self.plain, FLOOR) * norm(target)

    def screen_radius(self, target: torch.Tensor) -> float | None:
        """The radius around ``target`` inside which a screened state's candidate is verified in full (None: no
        screening)."""
        if self.screen is None:
            return None
        return self.scale * SAFETY * max(self.screen, FLOOR) * norm(target)

    def scaled(self, scale: float) -> Calibration:
        """The same measurements with both radii multiplied by ``scale``."""
        return replace(self, scale=scale)

    def as_dict(self) -> dict:
        return {
            "cached": self.cached,
            "plain": self.plain,
            "gap": self.gap,
            "samples": self.samples,
            "safety": SAFETY,
            "screen": self.screen,
        }


def calibration_prompts(model: LoadedModel, n: int = 3, length: int = 12, seed: int = 0) -> list[list[int]]:
    """``n`` random-id prompts and ``n`` greedy continuations of random first tokens, ``length`` tokens each: made
    once per weights, dtype and device type and kept beside the tables (the continuations cost ``length`` forwards
    through every block: 1.7-1.9 s for SmolLM2 on a 2-core CPU, which every rows search paid per call)."""
    probe = model.probe
    kind = f"calibration-prompts-{n}-{length}-{seed}"
    made = cached(model, probe.layer(-1), kind, lambda: torch.tensor(_calibration_prompts(model, n, length, seed)),
                  per_device=True)  # fmt: skip
    return [list(map(int, row)) for row in made.cpu()]


def _calibration_prompts(model: LoadedModel, n: int, length: int, seed: int) -> list[list[int]]:
    probe = model.probe
    gen = torch.Generator().manual_seed(seed)
    random_ids = torch.randint(0, probe.vocab_size, (2 * n, length), generator=gen)
    rows = [list(map(int, r)) for r in random_ids[:n]]
    natural = [[int(r[0])] for r in random_ids[n:]]
    if model.model.get_output_embeddings() is not None:
        full = probe.prefixes([[]] * n, probe.layer(-1))
        for _ in range(length - 1):
            full, last = probe.advance_rows(full, [row[-1] for row in natural])
            best = probe.next_token_logits(last).float().argmax(dim=-1).tolist()
            natural = [[*row, int(b)] for row, b in zip(natural, best, strict=True)]
    else:
        natural = [list(map(int, r)) for r in random_ids[n:]]
    return rows + natural


SHAPES = (7, 31, 127, 0)  # other candidates per prompt at successive calibration positions: several batch shapes
# of them, at most, the true token's nearest input vectors by angle, the rest random: near the first layers a position's
# nearest other token is among them, and random ones miss it (:mod:`.nearest`; the gap before, random candidates alone,
# lay up to 2.64x a position's nearest token's distance, docs/results.md)
HARD = 16


def _large_shapes(device: torch.device) -> tuple[int, ...]:
    """On a device whose policies verify larger batches (:func:`.context.batch_scale`), one batch shape as large as
    those (kernels can round differently past some batch size); none on a CPU."""
    return (64 * batch_scale(device) - 1,) if batch_scale(device) > 1 else ()


def _batch_shapes(device: torch.device) -> tuple[int, ...]:
    return (*SHAPES, *_large_shapes(device))


def measure(
    model: LoadedModel, layer: Layer, prompts: list[list[int]], seed: int = 0, screen: bool = False
) -> Calibration:
    """Measure the disagreements on ``prompts`` (equal lengths), exactly as the engine verifies and confirms (with
    ``screen``: also as it screens, the same batches over the same prefixes)."""
    return measure_layers(model, [layer], prompts, seed, screen)[layer]


class _Found:
    """One layer's relative disagreements as :func:`measure_layers` collects them."""

    def __init__(self) -> None:
        self.cached: list[float] = []
        self.plain: list[float] = []
        self.gap: list[float] = []
        self.screen: list[float] = []

    def calibration(self, screen: bool) -> Calibration:
        return Calibration(
            cached=max(self.cached, default=0.0),
            plain=max(self.plain, default=0.0),
            gap=min(self.gap) if self.gap else math.inf,
            samples=len(self.cached),
            screen=max(self.screen, default=0.0) if screen else None,
            screen_typical=_quantile(self.screen, SCREEN_QUANTILE) if screen else None,
        )


def _quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation; 0 for none)."""
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q)) if values else 0.0


def measure_layers(
    model: LoadedModel, layers: list[Layer], prompts: list[list[int]], seed: int = 0, screen: bool = False
) -> dict[Layer, Calibration]:
    """:func:`measure` at each of ``layers`` (block layers: 1..L), in the forwards of the highest one: a lower
    layer's states there are those of a forward that stops at it, bit for bit (the blocks below it compute the same
    things on the same inputs in both), and the draws do not depend on the layer."""
    probe = model.probe
    top = max(layers)
    reference = prompt_states(model, prompts, layers, progress=False)
    gen = torch.Generator().manual_seed(seed)
    sizes = _batch_shapes(probe.device)
    found = {layer: _Found() for layer in layers}
    prefix = probe.prefixes([[]] * len(prompts), top)
    for t in range(len(prompts[0])):
        true = torch.tensor([p[t] for p in prompts])
        size = sizes[t % len(sizes)]
        others = torch.randint(0, probe.vocab_size, (len(prompts), size), generator=gen)
        hard = min(HARD, size)  # the first of them: the true tokens' nearest input vectors (.nearest.near_inputs)
        if hard:
            others[:, :hard] = near_inputs(model, true, hard)
        ids = torch.cat([true[:, None], others], dim=1)  # [N, 1 + k]
        rows = torch.arange(len(prompts))[:, None].expand_as(ids)
        flat = {"token_ids": ids.reshape(-1), "rows": rows.reshape(-1), "layers": layers}
        with torch.no_grad():
            verified, new = probe.continuation(prefix, keys=True, **flat)
        if screen:
            with torch.no_grad(), probe.screening():
                fast = probe.continuation(prefix, **flat)
        extra = torch.randint(0, probe.vocab_size, (len(prompts),), generator=gen).tolist()  # a second row each
        plain_ids = torch.tensor([[*p[:t], x] for p, e in zip(prompts, extra, strict=True) for x in (p[t], e)])
        plain = probe.states(plain_ids, layers)
        for layer in layers:
            states = verified[layer].float().cpu().reshape(*ids.shape, -1)
            plains = plain[layer][:, -1].float().cpu().reshape(len(prompts), 2, -1)[:, 0]
            screened = fast[layer].float().cpu().reshape(*ids.shape, -1) if screen else None
            _record(found[layer], [r[layer][t] for r in reference], ids, states, plains, screened)
        if new is None:  # an empty prefix: the first token's keys by a forward, as the engine does
            prefix, _ = probe.advance_rows(prefix, true.tolist())
        else:  # the true tokens' keys and values from this verification, as the engine grows its prefix
            first = torch.arange(len(prompts), device=new.layers[0][0].device) * ids.shape[1]
            prefix = probe.advance_from(prefix, true.tolist(), new.take(first))
    for layer, chained in _chains(model, layers, prompts, reference).items():
        found[layer].cached += chained
    return {layer: found[layer].calibration(screen) for layer in layers}


def _record(
    found: _Found,
    reference: list[torch.Tensor],
    ids: torch.Tensor,
    states: torch.Tensor,
    plain: torch.Tensor,
    screened: torch.Tensor | None,
) -> None:
    """One position's disagreements at one layer: each prompt's true token (column 0 of ``ids``) verified among
    others (``states`` ``[N, 1 + k, d]``), by the plain forward (``plain`` ``[N, d]``) and screened."""
    for i, true in enumerate(reference):
        h = true.double()
        norm = float(h.norm())
        if norm == 0:  # a zero state (quantised activations) has no relative disagreement: its radius is 0
            continue
        dist = (states[i].double() - h).norm(dim=1) / norm
        differs = ids[i] != ids[i, 0]
        found.cached.append(float(dist[0]))
        if differs.any():
            found.gap.append(float(dist[differs].min()))
        found.plain.append(float((plain[i].double() - h).norm()) / norm)
        if screened is not None:
            found.screen.append(float((screened[i, 0].double() - h).norm()) / norm)


def _chains(
    model: LoadedModel, layers: list[Layer], prompts: list[list[int]], reference: list[dict[Layer, torch.Tensor]]
) -> dict[Layer, list[float]]:
    """Relative disagreements of chain states (``CHAIN`` true tokens per prompt in one forward) with the plain
    forward's, the prefix grown by half of each chain from its keys and values, at each of ``layers``."""
    probe = model.probe
    found: dict[Layer, list[float]] = {layer: [] for layer in layers}
    rows = torch.arange(len(prompts), device=probe.device) if len(prompts) > 1 else None
    prefix = probe.prefixes([p[:1] for p in prompts], max(layers))
    t = 1
    while t < len(prompts[0]):
        ids = torch.tensor([p[t : t + CHAIN] for p in prompts], device=probe.device)
        chained, new = probe.chains(prefix, ids, rows, layers=layers)
        assert isinstance(chained, dict)
        for layer in layers:
            states = chained[layer].double().cpu()
            for i in range(len(prompts)):
                for j in range(ids.shape[1]):
                    h = reference[i][layer][t + j].double()
                    if float(h.norm()) > 0:
                        found[layer].append(float((states[i, j] - h).norm() / h.norm()))
        for j in range(max(1, ids.shape[1] // 2)):
            tokens = ids[:, j].tolist()
            if new is None:  # no block ran (layer 0): the keys by a forward
                prefix = probe.advance_rows(prefix, tokens)[0]
            else:
                prefix = probe.advance_from(prefix, tokens, new.at(j))
            t += 1
    return found


def calibrate(model: LoadedModel, layer: Layer) -> Calibration:
    """The measured :class:`Calibration` of ``model`` at ``layer`` (cached beside the tables, per device type). Where
    the probe screens and nothing is kept yet, the screening's figures are measured in the same forwards (the same
    radii: :func:`calibrate_layers`), not in a second measurement of both when the screening first asks (SmolLM2 layer
    15 in ``lminvert audit --quick``: 8 s, then 12 s)."""
    kind = calibration_kind(model)
    fresh = kept(model, layer, kind, per_device=True) is None
    calibrate_layers(model, [layer], screen=model.probe.can_screen and fresh)
    values = kept(model, layer, kind, per_device=True)
    assert values is not None
    return Calibration(cached=float(values[0]), plain=float(values[1]), gap=float(values[2]), samples=int(values[3]))


def calibration_kind(model: LoadedModel) -> str:
    """The cache's name for :func:`calibrate`'s figures on this model's device."""
    return KIND + "".join(f"-b{n + 1}" for n in _large_shapes(model.probe.device))  # other shapes apart


SCREEN_KIND = "screen2"  # the cache's name for the screening disagreement (its maximum, then its SCREEN_QUANTILE); a
# new name whenever it is measured anew (2: the quantile kept beside the maximum)
SCREEN_QUANTILE = 0.9  # the quantile of the screened disagreements kept beside their maximum (:func:`scout_error`)


def screen_calibration(model: LoadedModel, layer: Layer) -> float:
    """The measured relative disagreement of screened states (:attr:`Calibration.screen`) of ``model`` at ``layer``:
    the calibration prompts' true tokens among random candidates, as :func:`calibrate` verifies them, on both paths
    (cached beside the tables, per device type)."""
    return float(_screened(model, layer)[0])


def scout_error(model: LoadedModel, layer: Layer) -> float:
    """The screened states' typical relative disagreement (the :data:`SCREEN_QUANTILE` quantile of those
    :func:`screen_calibration` takes the maximum of, on the worse of its two paths; cached beside it)."""
    return float(_screened(model, layer)[1])


def _screened(model: LoadedModel, layer: Layer) -> torch.Tensor:
    calibrate_layers(model, [layer], screen=True)
    value = kept(model, layer, SCREEN_KIND, per_device=True)
    assert value is not None
    return value


def calibrate_layers(model: LoadedModel, layers: list[Layer], screen: bool) -> list[Layer]:
    """:func:`calibrate` (with ``screen``: and :func:`screen_calibration`) at each of ``layers`` where not cached yet,
    measured on both paths (the second with the continuations packed side by side over the shared prefix, as the probe
    runs them over long prefixes: the radii cover both), all layers in the forwards of the highest one
    (:func:`measure_layers`: each layer's figures are those it gets alone, bit for bit; a screened measurement's radii
    equal a plain one's, its draws are the same): what a layer's first prompt would otherwise measure, seconds at each
    layer. Returns the layers measured."""
    kind = calibration_kind(model)

    def missing(layer: Layer) -> bool:
        return kept(model, layer, kind, per_device=True) is None or (
            screen and kept(model, layer, SCREEN_KIND, per_device=True) is None
        )

    wanted = [layer for layer in layers if missing(layer)]
    if not wanted:
        return []
    with build_lock(model, max(wanted), kind, per_device=True) as waited:  # another process measuring them: wait
        wanted = [layer for layer in wanted if missing(layer)] if waited else wanted
        if wanted:
            _measure_and_keep(model, wanted, kind, screen)
    return wanted


def _measure_and_keep(model: LoadedModel, wanted: list[Layer], kind: str, screen: bool) -> None:
    """:func:`calibrate_layers`' measurements of ``wanted``, on both paths, kept under ``kind``."""
    prompts = calibration_prompts(model)
    found = measure_layers(model, wanted, prompts, screen=screen)
    with model.probe.always_packed():
        packed = measure_layers(model, wanted, prompts, screen=screen)
    for layer in wanted:
        one, other = found[layer], packed[layer]
        radii = [max(one.cached, other.cached), max(one.plain, other.plain), min(one.gap, other.gap), one.samples]
        cached(model, layer, kind, lambda radii=radii: torch.tensor(radii, dtype=torch.float64), per_device=True)
        if screen:
            assert one.screen is not None and other.screen is not None
            assert one.screen_typical is not None and other.screen_typical is not None
            worst = [max(one.screen, other.screen), max(one.screen_typical, other.screen_typical)]
            cached(model, layer, SCREEN_KIND, lambda w=worst: torch.tensor(w, dtype=torch.float64), per_device=True)


NOISE_SIGMAS = 5.0  # standard deviations of the noise's norm that :func:`noise_tolerance` allows beyond its mean


def noise_tolerance(target: torch.Tensor, sigma: float) -> float:
    """Upper bound on the norm of relative Gaussian noise of level ``sigma``, from the state as observed (``target``,
    the noise in it).

    The noise is ``sigma * ||h|| * g / sqrt(d)`` with ``g ~ N(0, I_d)``; ``||g||`` concentrates at sqrt(d) with
    standard deviation ~1/sqrt(2), so within :data:`NOISE_SIGMAS` of them its norm is at most ``k ||h||`` with
    ``k = sigma * (1 + NOISE_SIGMAS / sqrt(2 d))`` (beyond: a chance of about 3e-7 per state). The clean state's norm is
    not known, only the observed one's: ``||h|| <= ||target|| + ||noise||``, so the noise's norm is at most
    ``k ||target|| / (1 - k)`` (no bound, ``inf``, where ``k >= 1``: the noise may hide the state entirely).
    """
    if sigma <= 0:
        return 0.0
    k = sigma * (1.0 + NOISE_SIGMAS / math.sqrt(2.0 * target.numel()))
    return math.inf if k >= 1.0 else float(k * norm(target) / (1.0 - k))


def add_noise(states: torch.Tensor, sigma: float | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``states + sigma * ||h_t|| * g_t / sqrt(d)`` per position (relative Gaussian noise); ``sigma`` a level, or one
    per position (``[T, 1]``: noise drawn for every position, even at level 0)."""
    if not isinstance(sigma, torch.Tensor) and sigma <= 0:
        return states
    g = torch.randn(states.shape, generator=generator, dtype=torch.float64)
    scale = sigma * states.double().norm(dim=-1, keepdim=True) / math.sqrt(states.shape[-1])
    return (states.double() + scale * g).to(states.dtype)
