"""The layer probe: the one place that knows where a transformers model keeps its blocks.

Layer semantics (used everywhere in lminvert; the ``Layer`` type and its one resolver live in :mod:`.layers`):

* ``0`` - the input of the first block: the input embeddings as the model uses them (after any scaling,
  e.g. Gemma's sqrt(d); for GPT-2 this includes the learned position embedding). Equal to transformers'
  ``hidden_states[0]``.
* ``1..L`` - the residual stream after block ``l``, never passed through the final norm. (transformers'
  ``output_hidden_states`` applies the final norm to its last entry for most models; we do not.)
* negative ``l`` counts from ``L`` (``-1`` is ``L``); ``"final"`` is the output of the final norm.

The probe wraps the unmodified model: it runs transformers' own forward and reads block outputs with hooks,
stopping the forward right after the highest layer asked for (no work above it, never the LM head).

:class:`LayerProbe` is a facade over small modules, each holding the bodies of a group of its methods:
:mod:`.discovery` (where an architecture keeps its blocks and final norm, and the mapping check), :mod:`.hooks` (the
truncated forward and :meth:`LayerProbe.final_from`), :mod:`.prefix` (prefix KV caches and the cached forwards over
them), :mod:`.packing` (continuations packed into rows over a prefix) and :mod:`.vocabulary` (the vocabulary's
vectors, their products, next-token logits).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import LminvertError
from . import hooks, packing, vocabulary
from . import prefix as prefix_cache
from .discovery import _find_blocks, _find_final_norm, check_mapping, has_hooks
from .halfmath import HalfAsFloat32, LinearMath, all_linear_plain, half_is_slow, native_bfloat16
from .layers import Layer, LayerSpec, parse_layers
from .observed import ObservedForward, PlainKeys, PlainRows
from .packing import PACK, PACKED_FROM, _Packing
from .prefix import NewKeys, Prefix

__all__ = ["LayerProbe", "NewKeys", "Prefix", "has_hooks"]  # what other modules import from here


class LayerProbe:
    """Hidden states at chosen layers of a transformers causal LM, with truncated and cached forwards."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self.base: nn.Module = model.base_model
        self.n_layers: int = int(self.config.num_hidden_layers)
        self.blocks_name, self.blocks = _find_blocks(self.base, self.n_layers)
        self.final_norm = _find_final_norm(self.base)
        self.embedding: nn.Module = model.get_input_embeddings()
        self.hidden_size: int = int(self.config.hidden_size)
        self.vocab_size: int = int(self.embedding.weight.shape[0])
        self._vocab_matrix: torch.Tensor | None = None
        self._vocab_copies: dict[torch.dtype, torch.Tensor] = {}
        self._vocab_half: tuple[torch.Tensor, float] | bool | None = None  # vocab_dots: (float16 copy, scale) or False
        self._head32: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.pack = PACK  # continuation tokens per packed row (0: each continuation its own row)
        self.packed_from = PACKED_FROM  # copied prefix positions from which continuations are packed (0: always)
        self._half: HalfAsFloat32 | None = None  # cached forwards of a half model on a CPU without half GEMMs
        self._screen: LinearMath | None = None  # a float32 model's linear layers in bfloat16, inside screening()
        self._screening = False
        self._blocks_return_tensors = False  # seen in the mapping check: final_from may then skip the lower blocks
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16) and half_is_slow(self.dtype):
            self._half = HalfAsFloat32(self.model, self.dtype)
        self._check_mapping()
        self._observed = ObservedForward(self)

    @contextlib.contextmanager
    def always_packed(self):
        """Within: continuations are packed wherever they can be (:meth:`_packing`), to measure that path's rounding
        on short prompts (:mod:`lminvert.invert.tolerance`)."""
        before, self.packed_from = self.packed_from, 0
        try:
            yield self
        finally:
            self.packed_from = before

    @property
    def screen_refusal(self) -> str | None:
        """Why :meth:`screening` cannot run on this model (None: it can): it needs a float32 model whose linear layers
        are all plain ones (not a quantised model's)."""
        if self.dtype != torch.float32:
            return f"this model is {str(self.dtype).removeprefix('torch.')} already"
        if not all_linear_plain(self.model):
            return "this model's linear layers are quantised"
        return None

    @property
    def numeric_path(self) -> str:
        """How the cached forwards compute: ``native`` (the dtype's own kernels), or ``half-as-float32`` (a half
        model's linear layers as float32 GEMMs rounded back where the CPU's half GEMMs are slow: ``HalfAsFloat32``)."""
        return "native" if self._half is None else "half-as-float32"

    @property
    def can_screen(self) -> bool:
        """Whether :meth:`screening` pays here: a model it can run on (:attr:`screen_refusal`) on a CPU with native
        bfloat16 GEMMs (:func:`.halfmath.native_bfloat16`; a GPU's verification is latency-bound)."""
        return self.device.type == "cpu" and self.screen_refusal is None and native_bfloat16(self.device)

    @contextlib.contextmanager
    def screening(self):
        """Within: the cached forwards (:meth:`continuation`, :meth:`chains`, prefix caches) of this float32 model run
        their linear layers as bfloat16 GEMMs (:class:`.halfmath.LinearMath`; 2.5-3x faster on this project's CPU,
        states within a few 1e-2 of the norm). For screening candidates only: the inversion accepts none on such a
        state (:mod:`lminvert.invert.engine`); the plain forward, :meth:`states`, is never affected."""
        if self._screen is None:  # checked once: a hot path (every screened batch)
            reason = self.screen_refusal
            if reason is not None:
                raise ValueError(f"screening runs a float32 model's linear layers in bfloat16; {reason}")
            self._screen = LinearMath(self.model, torch.float32, torch.bfloat16)
        before, self._screening = self._screening, True
        try:
            yield self
        finally:
            self._screening = before

    def _cached_math(self) -> contextlib.AbstractContextManager:
        """How the cached forwards run: as the model does, with float32 GEMMs for a half model on a CPU that has no
        half GEMMs, or (within :meth:`screening`) with bfloat16 GEMMs for a float32 model (:mod:`.halfmath`; the plain
        forward, :meth:`states`, always runs as the model does)."""
        if self._screening and self._screen is not None:
            return self._screen
        return self._half if self._half is not None else contextlib.nullcontext()

    def _check_mapping(self) -> None:
        """Compare the probe with transformers' own ``output_hidden_states`` on two tokens: a one-line error for a
        model mapped wrongly, never a wrong layer (:func:`.discovery.check_mapping`)."""
        check_mapping(self)

    # ------------------------------------------------------------------ basics
    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device

    @property
    def final(self) -> Layer:
        """The output of the final norm (index ``L + 1``)."""
        return Layer(self.n_layers + 1, self.n_layers)

    def layer(self, spec: LayerSpec) -> Layer:
        """Resolve one layer spec (see :func:`parse_layers`); one-line error if out of range."""
        (layer,) = parse_layers([spec], self.n_layers)
        return layer

    def layers(self, spec: LayerSpec | Sequence[LayerSpec]) -> list[Layer]:
        """Resolve ``"all"``, a comma-separated list or a sequence (see :func:`parse_layers`)."""
        return parse_layers(spec, self.n_layers)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the model's own embedding module produces them (scaling included)."""
        return self.embedding(token_ids.to(self.device))

    def vocab_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """All |V| input vectors, ``embed(arange(V))``, built once (the weight itself when unscaled), on the model's
        device; ``dtype=torch.float32`` gives (and keeps) a float32 copy for rankings in a half-precision model."""
        return vocabulary.vocab_matrix(self, dtype)

    def low_vocab(self, device: torch.device | None = None) -> torch.Tensor | None:
        """The vocabulary in bfloat16 for products that only order candidates, where native (else None):
        :func:`.vocabulary.low_vocab`."""
        return vocabulary.low_vocab(self, device)

    def vocab_dots(self, vector: torch.Tensor) -> torch.Tensor:
        """``vocab_matrix() @ vector`` ``[V]`` in float32, for rankings (they only order candidates, each of which is
        verified); on a CPU through a scaled float16 copy of the vocabulary (:func:`.vocabulary.vocab_dots`: why, and
        how close)."""
        return vocabulary.vocab_dots(self, vector)

    def check_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size):
            raise LminvertError(
                f"token ids must lie in 0..{self.vocab_size - 1} for this model; got "
                f"{int(token_ids.min())}..{int(token_ids.max())}"
            )

    # ------------------------------------------------------------------ forwards
    def _forward(self, layers: Iterable[Layer], whole: bool = False, **kwargs) -> dict[Layer, torch.Tensor]:
        """Run the base model through the highest requested (resolved) layer only and capture those layers
        (``whole``: run the whole model, :func:`.hooks.forward_layers`)."""
        return hooks.forward_layers(self, layers, whole=whole, **kwargs)

    def states(
        self,
        input_ids: torch.Tensor,
        layers: LayerSpec | Sequence[LayerSpec],
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> dict[Layer, torch.Tensor]:
        """States ``[B, T, d]`` of full sequences at one or several layers (keys: resolved layers)."""
        resolved = self.layers(layers)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        self.check_ids(input_ids)
        kwargs = {"input_ids": input_ids.to(self.device), "use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        with torch.no_grad():
            return self._forward(resolved, **kwargs)

    def plain_states(
        self,
        sequences: list[list[int]],
        layer: LayerSpec,
        upto: int = 0,
        kept: PlainKeys | None = None,
        stop: int | None = None,
    ) -> PlainRows:
        """The plain forward of full sequences of equal length (:meth:`states`), from position ``start <= upto`` on
        where ``kept`` holds that much of the first sequence's keys and values and recomputing from them reproduces
        the whole forward bit for bit (:mod:`.observed`; otherwise ``start`` is 0); there, positions from ``stop``
        (> ``upto``) on are not computed."""
        self.check_ids(torch.tensor(sequences))
        return self._observed.states(sequences, self.layer(layer), upto, kept, stop)

    def embeds_states(
        self, embeds: torch.Tensor, layers: LayerSpec | Sequence[LayerSpec], whole: bool = False
    ) -> dict[Layer, torch.Tensor]:
        """States ``[B, T, d]`` of continuous input vectors ``embeds`` ``[B, T, d]`` (the embedding module's output
        space); gradients flow through them if they require grad (e.g. to optimise a soft prompt). ``whole``: the
        whole model runs (LM head included, as the paper's reference code runs it) instead of stopping at the
        highest layer asked for; the states are the same."""
        resolved = self.layers(layers)
        if embeds.dim() == 2:
            embeds = embeds[None]
        with torch.set_grad_enabled(embeds.requires_grad):
            return self._forward(resolved, whole=whole, inputs_embeds=embeds.to(self.dtype), use_cache=False)

    def prefix(self, token_ids: Sequence[int], layer: LayerSpec) -> Prefix:
        """Compute the KV cache of ``token_ids`` for blocks ``1..layer`` (nothing above is run)."""
        return self.prefixes([token_ids], layer)

    def prefixes(self, rows: Sequence[Sequence[int]], layer: LayerSpec) -> Prefix:
        """One batched KV cache (blocks ``1..layer``) of several prefixes of the same length, in one forward."""
        return prefix_cache.prefixes(self, rows, self.layer(layer))

    def extend(self, prefix: Prefix, token_id: int) -> Prefix:
        """The prefix with one more token, reusing (and taking over) its cache."""
        return self.advance(prefix, token_id)[0]

    def advance(self, prefix: Prefix, token_id: int) -> tuple[Prefix, torch.Tensor]:
        """Like :meth:`extend`, also returning the new token's state ``[d]`` after block ``top_block``."""
        grown, states = self.advance_rows(prefix, [token_id])
        return grown, states[0]

    def advance_rows(self, prefix: Prefix, token_ids: Sequence[int]) -> tuple[Prefix, torch.Tensor]:
        """Every row grows by its token (one forward, the cache is taken over); returns the new tokens' states
        ``[N, d]`` after block ``top_block``."""
        return prefix_cache.advance_rows(self, prefix, token_ids)

    def defer(self, prefix: Prefix, token_ids: Sequence[int]) -> Prefix:
        """Every row grows by its token without a forward: its keys and values join the cache with the next forward
        that grows it (:meth:`advance_rows` or :meth:`catch_up`), together with any other deferred tokens. For a
        search that may decide the next positions without reading the cache (from plain forwards' states)."""
        return prefix_cache.defer(prefix, token_ids)

    def catch_up(self, prefix: Prefix) -> bool:
        """Put the deferred tokens' keys and values in the cache (one forward; the prefix is updated in place);
        whether a forward ran."""
        return prefix_cache.catch_up(self, prefix)

    def advance_from(self, prefix: Prefix, token_ids: Sequence[int], new: NewKeys) -> Prefix:
        """Every row grows by its token, whose keys and values ``new`` (one row per prefix row) a verification
        forward (:meth:`continuation` with ``keys=True``) already computed: no forward runs. The cache is taken
        over (an empty prefix's is created from ``new``)."""
        return prefix_cache.advance_from(self, prefix, token_ids, new)

    def advance_above(
        self, prefix: Prefix, token_ids: Sequence[int], new: NewKeys, states: torch.Tensor, layer: LayerSpec
    ) -> tuple[Prefix, torch.Tensor]:
        """Every row grows by its token, whose keys and values in blocks ``1..layer`` (``new``) and state at ``layer``
        (``states`` ``[N, d]``) a verification forward at ``layer`` (:meth:`continuation` with ``keys=True``) already
        computed: only the blocks above ``layer`` run (one forward on the states, none where ``layer`` is the last
        block's; a prefix at a higher layer, where :attr:`skips_below`). Returns the grown prefix (the cache is taken
        over) and the new tokens' states after the final norm ``[N, d]`` (what the LM head reads)."""
        return prefix_cache.advance_above(self, prefix, token_ids, new, states, self.layer(layer))

    @property
    def skips_below(self) -> bool:
        """Whether a forward can skip the blocks below a layer, running the ones above on given states
        (:meth:`final_from` does; :meth:`advance_above` needs it)."""
        return self._blocks_return_tensors

    def select(self, prefix: Prefix, keep: Sequence[int]) -> Prefix:
        """Only rows ``keep`` of the prefix (its cache is taken over)."""
        return prefix_cache.select(self, prefix, keep)

    def final_from(self, states: torch.Tensor, layer: LayerSpec) -> torch.Tensor:
        """The last hidden state (what the LM head reads) ``[B, T, d]`` of sequences whose layer-``layer``
        states are ``states`` ``[B, T, d]``: the blocks above ``layer`` run on the given states (one forward;
        attention is causal, so right-padding a batch leaves the real positions as they are). Below ``layer`` the
        forward runs on placeholder tokens, so every family's own positions, masks and caches apply, and the blocks
        below ``layer`` hand on ``states`` without computing anything (where the mapping check saw blocks return
        plain tensors; elsewhere they run and a forward hook replaces what the last of them returns). Given a prompt's
        observed states, this is what the model computed above the observer: its next-token distribution at every
        position, without the prompt."""
        return hooks.final_from(self, states, self.layer(layer))

    def states_above(self, states: torch.Tensor, layer: LayerSpec, upper: LayerSpec) -> torch.Tensor:
        """As :meth:`final_from`, the states ``[B, T, d]`` at the block layer ``upper`` above ``layer`` instead (the
        blocks above ``upper`` do not run). A position-0 state alone is its token's first-position state at ``upper``
        (position 0 attends to itself only), up to the rounding of another forward's shape."""
        return hooks.final_from(self, states, self.layer(layer), upper=self.layer(upper))

    def next_token_logits(self, state: torch.Tensor, normed: bool = False, ranking: bool = False) -> torch.Tensor:
        """The model's next-token logits from states ``[..., d]`` after the last block (``normed``: after the
        final norm already). Output soft-capping, where a model has it, is left out: it does not change the order.
        ``ranking``: they only order candidates, and one state's may be computed in float16
        (:func:`.vocabulary.next_token_logits`)."""
        return vocabulary.next_token_logits(self, state, normed, ranking)

    def continuation(
        self,
        prefix: Prefix,
        token_ids: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        layers: Sequence[LayerSpec] | None = None,
        rows: torch.Tensor | None = None,
        keys: bool = False,
    ) -> torch.Tensor | dict[Layer, torch.Tensor] | tuple[torch.Tensor, NewKeys | None]:
        """States at position ``prefix.length`` for B one-token continuations, in one batched forward.

        Give either ``token_ids`` ``[B]`` or continuous input vectors ``embeds`` ``[B, d]`` (in the space of
        the embedding module's output; gradients flow through them if they require grad). Returns ``[B, d]``
        at ``prefix.layer``, or a dict when ``layers`` (each <= prefix.layer) is given. A prefix of several rows
        needs ``rows`` ``[B]``: the prefix row each continuation extends (so several prompts' candidates share
        one forward). ``keys=True`` (with ``token_ids``; ``layers``, if given, must hold ``prefix.layer``): returns
        ``(states, NewKeys)``, the continuations' keys and values in every cached block (None for an empty prefix or
        where no block ran, at layer 0), for :meth:`advance_from`.
        """
        if (token_ids is None) == (embeds is None):
            raise ValueError("give exactly one of token_ids or embeds")
        if (rows is None) != (prefix.size == 1):
            raise ValueError("give rows (the prefix row of each continuation) exactly when the prefix has several")
        if token_ids is not None:
            self.check_ids(token_ids)
            embeds = self.embed(token_ids.reshape(-1))
        assert embeds is not None
        out, new = prefix_cache.continue_prefix(self, prefix, embeds[:, None, :], layers, rows, keys)
        out = {layer: state[:, 0, :] for layer, state in out.items()}
        if keys:
            return (out[prefix.layer] if layers is None else out), new
        return out[prefix.layer] if layers is None else out

    def chains(
        self,
        prefix: Prefix,
        token_ids: torch.Tensor,
        rows: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
        layers: Sequence[LayerSpec] | None = None,
    ) -> tuple[torch.Tensor | dict[Layer, torch.Tensor], NewKeys | None]:
        """States ``[B, K, d]`` at positions ``prefix.length .. prefix.length + K - 1`` of B continuations of K
        tokens each (``token_ids`` ``[B, K]``), in one forward over the cached prefix, with their keys and values
        (``[B, heads, K, head_dim]`` per cached block; :meth:`NewKeys.at` takes one position). Causal attention makes
        position ``j``'s state that of a one-token continuation of the prefix grown by the row's first ``j`` tokens
        (rounded differently: the verification radii measure it, :mod:`lminvert.invert.tolerance`). ``rows``: as in
        :meth:`continuation`. ``lengths``: chains of different lengths (row ``b`` holds ``lengths[b]`` tokens, the
        rest of it is padding whose states are not to be read); where :meth:`packs_chains` they are packed and only
        their own tokens are computed, elsewhere the padded rows run whole. ``layers`` (holding ``prefix.layer``):
        a dict of the states at each of them instead."""
        if token_ids.dim() != 2:
            raise ValueError("chains takes token ids [B, K]")
        if lengths is not None and (
            len(lengths) != len(token_ids) or not all(1 <= n <= token_ids.shape[1] for n in lengths)
        ):
            raise ValueError(f"one length in 1..{token_ids.shape[1]} per chain")
        if (rows is None) != (prefix.size == 1):
            raise ValueError("give rows (the prefix row of each continuation) exactly when the prefix has several")
        self.check_ids(token_ids)
        embeds = self.embed(token_ids.reshape(-1)).reshape(*token_ids.shape, -1)
        with torch.no_grad():
            out, new = prefix_cache.continue_prefix(self, prefix, embeds, layers, rows, keys=True, lengths=lengths)
        return (out[prefix.layer] if layers is None else out), new

    def packs_chains(self, prefix: Prefix) -> bool:
        """Whether chains of different lengths over ``prefix`` run packed (their own tokens only; :meth:`chains`)."""
        return packing.attention_to_pack(self, prefix, self.pack) is not None

    def _packing(
        self,
        prefix: Prefix,
        batch: int,
        tokens: int,
        rows: torch.Tensor | None,
        lengths: Sequence[int] | None = None,
    ) -> _Packing | None:
        """How continuations over a cached prefix are packed into rows, or None: one row each
        (:func:`.packing.packing_for`; the prefix cache asks through the probe: packing imports its type)."""
        return packing.packing_for(self, prefix, batch, tokens, rows, lengths)
