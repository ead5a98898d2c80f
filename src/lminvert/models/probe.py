"""The layer probe: the one place that knows where a transformers model keeps its blocks.

Layer semantics (used everywhere in lminvert):

* ``0`` - the input of the first block: the input embeddings as the model uses them (after any scaling,
  e.g. Gemma's sqrt(d); for GPT-2 this includes the learned position embedding). Equal to transformers'
  ``hidden_states[0]``.
* ``1..L`` - the residual stream after block ``l``, never passed through the final norm. (transformers'
  ``output_hidden_states`` applies the final norm to its last entry for most models; we do not.)
* negative ``l`` counts from ``L`` (``-1`` is ``L``); ``"final"`` is the output of the final norm.

The probe wraps the unmodified model: it runs transformers' own forward and reads block outputs with hooks,
stopping the forward right after the highest layer asked for (no work above it, never the LM head).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import LminvertError

LayerSpec = int | str  # what users write: 0..L, -1..-L, "final", "middle", or a resolved Layer

DEFAULT_LAYERS = "1,middle,-1"  # first block, middle block, last block: valid for a model of any depth


class Layer(int):
    """A resolved layer of one model: an int ``0..L``, or ``L + 1`` for the output of the final norm.

    Made only by :meth:`LayerProbe.layer` (the one resolver), so a ``Layer`` is always in range for its
    model. It behaves as its index (dict key, file names, arithmetic) and knows its user-facing ``name``.
    """

    n_layers: int

    def __new__(cls, index: int, n_layers: int) -> Layer:
        if not 0 <= index <= n_layers + 1:
            raise ValueError(f"layer index {index} outside 0..{n_layers + 1}")
        value = super().__new__(cls, index)
        value.n_layers = n_layers
        return value

    def __reduce__(self):  # picklable for executors
        return (Layer, (int(self), self.n_layers))

    @property
    def is_final(self) -> bool:
        return int(self) == self.n_layers + 1

    @property
    def name(self) -> str:
        """``"final"`` or the index as text: what files, results and the CLI show."""
        return "final" if self.is_final else str(int(self))

    @property
    def top_block(self) -> int:
        """The highest block (1..L) whose output this layer needs (a KV cache covers blocks 1..top_block)."""
        return min(max(int(self), 1), self.n_layers)

    def __repr__(self) -> str:
        return f"Layer({self.name})"

    def __str__(self) -> str:  # f"{layer}" shows the name ("final" for L + 1); f"{layer:03d}" the index
        return self.name


def _parse_one(spec: LayerSpec, n_layers: int) -> Layer:
    if isinstance(spec, Layer):
        if spec.n_layers != n_layers:
            raise LminvertError(f"layer {spec.name} belongs to a model with {spec.n_layers} layers, not {n_layers}")
        return spec
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "final":
            return Layer(n_layers + 1, n_layers)
        if text == "middle":
            return Layer(max(1, n_layers // 2), n_layers)
        try:
            spec = int(text)
        except ValueError:
            raise LminvertError(
                f"layer '{spec}' is not a layer: use 0..{n_layers}, -1..-{n_layers} from the top, 'middle' or 'final'"
            ) from None
    try:
        if isinstance(spec, bool):
            raise TypeError
        spec = operator.index(spec)
    except TypeError:
        raise LminvertError(f"layer {spec!r} is not a layer: use an int, 'middle' or 'final'") from None
    if not -n_layers <= spec <= n_layers:
        raise LminvertError(
            f"layer {spec} is out of range for this model: use 0..{n_layers} "
            f"(or -1..-{n_layers} from the top, 'middle' or 'final')"
        )
    return Layer(spec % (n_layers + 1) if spec < 0 else spec, n_layers)


def parse_layers(spec: LayerSpec | str | Sequence[LayerSpec], n_layers: int) -> list[Layer]:
    """The one layer resolver. ``spec``: one layer, ``"all"`` (1..L), a comma-separated list such as
    ``"1,middle,-1"``, or a sequence of layers. Returns sorted, distinct :class:`Layer` values; a one-line
    error names the bad entry."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return [Layer(i, n_layers) for i in range(1, n_layers + 1)]
        items: list[LayerSpec] = [part for part in text.split(",") if part.strip()]
    elif isinstance(spec, Sequence):
        items = list(spec)
    else:
        items = [spec]  # one int-like layer (or something that is not a layer: _parse_one says so)
    if not items:
        raise LminvertError(f"no layers given: use 'all', one layer, or a list such as {DEFAULT_LAYERS}")
    return sorted({_parse_one(item, n_layers) for item in items})


class _Stop(Exception):
    """Raised by a hook to end the forward after the last block we need."""


def _find_blocks(base: nn.Module, n_layers: int) -> nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        blocks = getattr(base, name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) == n_layers:
            return blocks
    for module in base.children():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return module
    raise LminvertError(f"cannot find the {n_layers} transformer blocks of {type(base).__name__}")


def _find_final_norm(base: nn.Module) -> nn.Module | None:
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        module = getattr(base, name, None)
        if isinstance(module, nn.Module):
            return module
    return None


class _FrozenPrefixLayer(CacheLayerMixin):
    """Read-only view of one layer of a prefix cache, broadcast over a batch of continuations.

    ``update`` returns prefix keys/values (expanded, not copied) concatenated with the new ones and stores
    nothing, so one prefix cache serves any number of candidate batches.
    """

    def __init__(self, inner: CacheLayerMixin, batch: int) -> None:
        super().__init__()
        self.inner = inner
        self.batch = batch
        self.keys, self.values = inner.keys, inner.values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        assert self.keys is not None and self.values is not None
        shape = (key_states.shape[0], *self.keys.shape[1:])
        keys = torch.cat([self.keys.expand(shape), key_states], dim=-2)
        values = torch.cat([self.values.expand(shape[:-1] + self.values.shape[-1:]), value_states], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return self.inner.get_max_length()


@dataclass
class Prefix:
    """A prompt prefix whose KV cache (blocks 1..layer) has been computed once."""

    token_ids: list[int]
    layer: Layer
    cache: Cache | None  # None for the empty prefix

    @property
    def length(self) -> int:
        return len(self.token_ids)


class LayerProbe:
    """Hidden states at chosen layers of a transformers causal LM, with truncated and cached forwards."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.config = model.config.get_text_config(decoder=True)
        self.base: nn.Module = model.base_model
        self.n_layers: int = int(self.config.num_hidden_layers)
        self.blocks = _find_blocks(self.base, self.n_layers)
        self.final_norm = _find_final_norm(self.base)
        self.embedding: nn.Module = model.get_input_embeddings()
        self.hidden_size: int = int(self.config.hidden_size)
        self.vocab_size: int = int(self.embedding.weight.shape[0])
        self._vocab_matrix: torch.Tensor | None = None

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

    def vocab_matrix(self) -> torch.Tensor:
        """All |V| input vectors, ``embed(arange(V))``, built once (the weight itself when unscaled)."""
        if self._vocab_matrix is None:
            if type(self.embedding) is nn.Embedding:
                self._vocab_matrix = self.embedding.weight.detach()
            else:
                with torch.no_grad():
                    ids = torch.arange(self.vocab_size, device=self.device)
                    self._vocab_matrix = torch.cat([self.embed(chunk) for chunk in ids.split(16384)])
        return self._vocab_matrix

    def check_ids(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size):
            raise LminvertError(
                f"token ids must lie in 0..{self.vocab_size - 1} for this model; got "
                f"{int(token_ids.min())}..{int(token_ids.max())}"
            )

    # ------------------------------------------------------------------ forwards
    def _forward(self, layers: Iterable[Layer], **kwargs) -> dict[Layer, torch.Tensor]:
        """Run the base model, capture the requested (resolved) layers, stop after the highest one."""
        wanted = sorted(set(layers))
        captured: dict[int, torch.Tensor] = {}
        top = wanted[-1]
        handles = []

        def pre_hook(module, args, kw):
            hidden = args[0] if args else kw["hidden_states"]
            captured[0] = hidden
            if top == 0:
                raise _Stop

        def make_hook(layer: int):
            def hook(module, args, output):
                captured[layer] = output[0] if isinstance(output, tuple) else output
                if layer == top:
                    raise _Stop

            return hook

        if 0 in wanted:
            handles.append(self.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True))
        for layer in wanted:
            if 1 <= layer <= self.n_layers:
                handles.append(self.blocks[layer - 1].register_forward_hook(make_hook(layer)))
        try:
            out = self.base(**kwargs)
            if self.final in wanted:
                captured[self.final] = out.last_hidden_state
        except _Stop:
            pass
        finally:
            for handle in handles:
                handle.remove()
        return {layer: captured[layer] for layer in wanted}

    def states(
        self,
        input_ids: torch.Tensor,
        layers: LayerSpec | Sequence[LayerSpec],
        attention_mask: torch.Tensor | None = None,
    ) -> dict[Layer, torch.Tensor]:
        """States ``[B, T, d]`` of full sequences at one or several layers (keys: resolved layers)."""
        resolved = self.layers(layers)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        self.check_ids(input_ids)
        kwargs = {"input_ids": input_ids.to(self.device), "use_cache": False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        with torch.no_grad():
            return self._forward(resolved, **kwargs)

    def embeds_states(self, embeds: torch.Tensor, layers: LayerSpec | Sequence[LayerSpec]) -> dict[Layer, torch.Tensor]:
        """States ``[B, T, d]`` of continuous input vectors ``embeds`` ``[B, T, d]`` (the embedding module's output
        space); gradients flow through them if they require grad (e.g. to optimise a soft prompt)."""
        resolved = self.layers(layers)
        if embeds.dim() == 2:
            embeds = embeds[None]
        with torch.set_grad_enabled(embeds.requires_grad):
            return self._forward(resolved, inputs_embeds=embeds.to(self.dtype), use_cache=False)

    def prefix(self, token_ids: Sequence[int], layer: LayerSpec) -> Prefix:
        """Compute the KV cache of ``token_ids`` for blocks ``1..layer`` (nothing above is run)."""
        resolved = self.layer(layer)
        ids = list(int(t) for t in token_ids)
        if not ids:
            return Prefix([], resolved, None)
        cache = DynamicCache(config=self.config)
        tensor = torch.tensor([ids], device=self.device)
        self.check_ids(tensor)
        with torch.no_grad():
            self._forward(
                [Layer(resolved.top_block, self.n_layers)], input_ids=tensor, past_key_values=cache, use_cache=True
            )
        return Prefix(ids, resolved, cache)

    def extend(self, prefix: Prefix, token_id: int) -> Prefix:
        """The prefix with one more token, reusing (and taking over) its cache."""
        return self.advance(prefix, token_id)[0]

    def advance(self, prefix: Prefix, token_id: int) -> tuple[Prefix, torch.Tensor]:
        """Like :meth:`extend`, also returning the new token's state ``[d]`` after block ``top_block``."""
        top = Layer(prefix.layer.top_block, self.n_layers)
        cache = prefix.cache if prefix.cache is not None else DynamicCache(config=self.config)
        tensor = torch.tensor([[int(token_id)]], device=self.device)
        self.check_ids(tensor)
        with torch.no_grad():
            out = self._forward([top], input_ids=tensor, past_key_values=cache, use_cache=True)
        return Prefix([*prefix.token_ids, int(token_id)], prefix.layer, cache), out[top][0, -1]

    def next_token_logits(self, state: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """The model's next-token logits from states ``[..., d]`` after the last block (``normed``: after the
        final norm already). Output soft-capping, where a model has it, is left out: it does not change the order."""
        head = self.model.get_output_embeddings()
        if head is None:
            raise LminvertError(f"{type(self.model).__name__} has no LM head: it cannot rank next tokens")
        with torch.no_grad():
            state = state.to(device=self.device, dtype=self.dtype)
            if not normed and self.final_norm is not None:
                state = self.final_norm(state)
            return head(state)

    def continuation(
        self,
        prefix: Prefix,
        token_ids: torch.Tensor | None = None,
        embeds: torch.Tensor | None = None,
        layers: Sequence[LayerSpec] | None = None,
    ) -> torch.Tensor | dict[Layer, torch.Tensor]:
        """States at position ``prefix.length`` for B one-token continuations, in one batched forward.

        Give either ``token_ids`` ``[B]`` or continuous input vectors ``embeds`` ``[B, d]`` (in the space of
        the embedding module's output; gradients flow through them if they require grad). Returns ``[B, d]``
        at ``prefix.layer``, or a dict when ``layers`` (each <= prefix.layer) is given.
        """
        if (token_ids is None) == (embeds is None):
            raise ValueError("give exactly one of token_ids or embeds")
        if token_ids is not None:
            self.check_ids(token_ids)
            embeds = self.embed(token_ids.reshape(-1))
        assert embeds is not None
        batch = embeds.shape[0]
        kwargs: dict = {"inputs_embeds": embeds[:, None, :].to(self.dtype), "use_cache": prefix.cache is not None}
        if prefix.cache is not None:
            view = Cache(layers=[_FrozenPrefixLayer(layer, batch) for layer in prefix.cache.layers])
            kwargs["past_key_values"] = view
        wanted = [prefix.layer] if layers is None else self.layers(layers)
        if max(wanted) > prefix.layer and prefix.cache is not None:
            raise ValueError("continuation layers must not exceed the prefix's layer")
        with torch.set_grad_enabled(embeds.requires_grad):
            out = self._forward(wanted, **kwargs)
        out = {layer: state[:, 0, :] for layer, state in out.items()}
        return out[prefix.layer] if layers is None else out
