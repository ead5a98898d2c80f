"""What a model's one-time preparation (``lminvert models --prepare``) makes for inversion, so that a fresh machine
inverts at every layer as a prepared one does, and nothing is built on a user's first prompt that could be built here.

* the linear reading map (:mod:`.reading`) at every layer, fitted on one forward of its training prompts that
  computes all layers at once (built on first use, it costs that forward per layer: seconds at layer 1, a minute at
  SmolLM2's last);
* a quick reading network (:mod:`.reader`, cached as :data:`.reader.QUICK_KIND`) at the last :attr:`Preparation.deep`
  layers, where the linear map reads the token worst: fewer training prompts and a smaller network than ``--reader``'s,
  trained in the preparation's time; a network ``--reader`` trained is used before it.

Like every reading, these only order candidates: each one is verified and the acceptor alone gives verdicts, so they
change speed, never an answer. :func:`prepare` skips what is cached already (idempotent).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..models import LoadedModel
from .reader import QUICK_KIND, load_reader, train_readers
from .reading import reading_maps

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare` makes: reading maps at every layer (``maps``), quick networks at the last ``deep`` layers,
    trained with ``network``'s options of :func:`.reader.train_reader`."""

    maps: bool = True
    deep: int = 1
    network: dict[str, int] = field(default_factory=lambda: {"text": 1000, "random": 500, "hidden": 1024, "epochs": 4})


def prepare(model: LoadedModel, settings: Preparation = Preparation(), progress: bool = True) -> list[str]:
    """Make what ``settings`` asks for that is not cached yet; one line per part made, with its seconds."""
    done = []
    probe = model.probe
    if settings.maps:
        start = time.perf_counter()
        layers = probe.layers("all")
        reading_maps(model, layers)
        done.append(f"reading maps at layers 1-{probe.n_layers}: {time.perf_counter() - start:.1f} s")
    deep = [probe.layer(probe.n_layers - i) for i in range(min(settings.deep, probe.n_layers))]
    wanted = [layer for layer in deep if load_reader(model, layer) is None]
    if wanted:
        start = time.perf_counter()
        train_readers(model, wanted, progress=progress, kind=QUICK_KIND, **settings.network)
        names = ", ".join(layer.name for layer in wanted)
        done.append(f"quick reading networks at layers {names}: {time.perf_counter() - start:.1f} s")
    return done
