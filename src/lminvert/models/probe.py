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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from ..errors import LminvertError
from .halfmath import HalfAsFloat32, LinearMath, all_linear_plain, half_is_slow, native_bfloat16
from .hf_internals import Cache, CacheLayerMixin, attn_implementation
from .layers import Layer, LayerSpec, parse_layers
from .observed import ObservedForward, PlainKeys, PlainRows


def _foreign(hook: object) -> bool:
    """A hook someone added (not one transformers installs itself, e.g. to capture outputs: those read, not edit)."""
    return not getattr(hook, "__module__", "").startswith("transformers.")


def has_hooks(model: nn.Module) -> bool:
    """Whether forward hooks other than transformers' own are registered on any module of ``model`` (the probe's own
    are removed after use): they may change what the weights compute, which neither the weights hash nor
    transformers' hidden states show, and injectivity cannot be assumed of what they compute."""
    return any(
        _foreign(hook)
        for m in model.modules()
        for hooks in (m._forward_hooks, m._forward_pre_hooks)
        for hook in hooks.values()
    )


class _Stop(Exception):
    """Raised by a hook to end the forward after the last block we need."""


PACK = 64  # continuation tokens per packed row of a cached forward (:meth:`LayerProbe._continue`); 0: one row each
# Packing pays where the copies it saves are large: from a prefix of PACK tokens and PACKED_FROM copied prefix positions
# (continuation tokens x prefix length). SmolLM2, layer 15, this project's 2-core CPU, one forward of B one-token
# continuations, packed / one row each: prefix 480, B = 1 / 8 / 32: 26.7 / 41.1 / 62.9 ms vs 25.5 / 45.8 / 134.1 ms;
# prefix 160, B = 8 / 32: 39.4 / 60.4 vs 39.6 / 73.5 ms; prefix 19 (layer 30), B = 8 / 64 / 512: 105 / 159 / 811 vs
# 93 / 155 / 814 ms (its mask makes every query attend to its packed row's other places, masked: no gain there).
PACKED_FROM = 2048
HALF_DOTS = True  # LayerProbe.vocab_dots on a CPU through a float16 copy of the vocabulary
PACKED_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask as the probe builds it

BLOCK_NAMES = ("layers", "h", "blocks")
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm")


def _owners(base: nn.Module) -> list[nn.Module]:
    """Where a base model keeps its blocks and final norm: itself, or its ``decoder`` (OPT)."""
    decoder = getattr(base, "decoder", None)
    return [base] + ([decoder] if isinstance(decoder, nn.Module) else [])


def _find_blocks(base: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    for owner in _owners(base):
        for name in BLOCK_NAMES:
            blocks = getattr(owner, name, None)
            if isinstance(blocks, nn.ModuleList) and len(blocks) == n_layers:
                return ("decoder." if owner is not base else "") + name, blocks
    found = [(n, m) for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    if len(found) == 1:
        return found[0]
    raise LminvertError(
        f"cannot find the {n_layers} transformer blocks of {type(base).__name__}: no ModuleList named "
        f"{', '.join(BLOCK_NAMES)} with {n_layers} entries"
        + (f" and {len(found)} other candidates" if found else " and no other one")
        + "; this architecture is not supported yet (teach lminvert.models.probe._find_blocks)"
    )


def _find_final_norm(base: nn.Module) -> nn.Module | None:
    for owner in _owners(base):
        for name in NORM_NAMES:
            module = getattr(owner, name, None)
            if isinstance(module, nn.Module):
                return module
    return None


class _FrozenPrefixLayer(CacheLayerMixin):
    """Read-only view of one layer of a prefix cache, broadcast over a batch of continuations.

    ``update`` returns prefix keys/values concatenated with the new ones and stores nothing, so one prefix cache
    serves any number of candidate batches. One prefix row is broadcast (expanded) to every continuation; with
    several rows, ``rows[i]`` names the prefix of continuation ``i``.
    """

    def __init__(self, inner: CacheLayerMixin, rows: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.keys, self.values = inner.keys, inner.values
        self.is_initialized = True
        self.is_sliding = getattr(inner, "is_sliding", False)  # masks are sized per kind of layer (Gemma-2/3)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def _past(self, past: torch.Tensor, batch: int) -> torch.Tensor:
        if self.rows is None:
            return past.expand(batch, *past.shape[1:])
        return past.index_select(0, self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        assert self.keys is not None and self.values is not None
        self.new = (key_states, value_states)  # the continuations' own keys and values (see NewKeys)
        batch = key_states.shape[0]
        keys = torch.cat([self._past(self.keys, batch), key_states], dim=-2)
        values = torch.cat([self._past(self.values, batch), value_states], dim=-2)
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.inner.get_seq_length()

    def get_max_length(self) -> int:
        return self.inner.get_max_length()


@dataclass(frozen=True)
class NewKeys:
    """The keys and values a batch of one-token continuations computed in each cached block (``[B, heads, 1,
    head_dim]`` per block, blocks ``1..top``): :meth:`LayerProbe.advance_from` grows a prefix by one chosen
    continuation per row from them, instead of a forward that would recompute them."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def take(self, index: torch.Tensor) -> NewKeys:
        """Rows ``index`` (copies: the batch they came from can be freed)."""
        return NewKeys(tuple((k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers))

    def at(self, position: int) -> NewKeys:
        """The keys and values of one position of each row (of :meth:`LayerProbe.chains`' several)."""
        cut = slice(position, position + 1)
        return NewKeys(tuple((k[:, :, cut], v[:, :, cut]) for k, v in self.layers))

    @staticmethod
    def stack(parts: Sequence[NewKeys]) -> NewKeys:
        """Rows of several :class:`NewKeys`, in order."""
        return NewKeys(
            tuple(
                (torch.cat([p.layers[i][0] for p in parts]), torch.cat([p.layers[i][1] for p in parts]))
                for i in range(len(parts[0].layers))
            )
        )


@dataclass
class Prefix:
    """``N`` prompt prefixes of the same length whose KV caches (blocks 1..top) were computed once, as one batched
    cache (row ``i`` of every cache tensor is prefix ``i``). Most callers hold one row."""

    rows: list[list[int]]
    layer: Layer
    cache: Cache | None  # None while the prefixes are empty
    # the rows' last tokens whose keys and values are not in the cache yet (:meth:`LayerProbe.defer`); a forward over
    # the cache needs them first (:meth:`LayerProbe.catch_up`)
    behind: int = 0

    @property
    def length(self) -> int:
        return len(self.rows[0])

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def token_ids(self) -> list[int]:
        """The ids of a one-row prefix."""
        if len(self.rows) != 1:
            raise ValueError(f"this prefix holds {len(self.rows)} rows; read .rows")
        return self.rows[0]


@dataclass(frozen=True)
class _Packing:
    """Continuations packed side by side into rows of a cached forward (:meth:`LayerProbe._continue`): row ``i``
    continues prefix row ``rows[i]`` with up to ``width`` tokens of continuations, each a block that attends to the
    prefix and to its own earlier tokens only. Unused places hold a zero input that attends to the prefix and itself
    (no attention row is empty; its state is never read). ``flat[b, j]`` is where token ``j`` of continuation ``b``
    sits in the flattened ``[rows * Q]`` (past a continuation's length: its last token's place)."""

    rows: torch.Tensor | None  # [R] the prefix row of each packed row (None: one prefix row, broadcast)
    flat: torch.Tensor  # [B, longest]
    given: torch.Tensor  # [tokens given] indices into the flattened [B * longest] inputs of the tokens that exist
    position_ids: torch.Tensor  # [R, Q]
    mask: torch.Tensor  # [R, 1, Q, prefix + Q]: True / 0 where a query may attend

    @staticmethod
    def build(
        prefix: Prefix,
        owners: list[int],
        lengths: list[int],
        width: int,
        device: torch.device,
        additive: torch.dtype | None,
    ) -> _Packing:
        """Pack continuations whose prefix rows are ``owners`` and whose token counts are ``lengths`` (one each),
        up to ``width`` tokens per packed row; ``additive``: the mask as additive floats of that dtype (eager
        attention) instead of booleans."""
        by_owner: dict[int, list[int]] = {}
        for b, owner in enumerate(owners):
            by_owner.setdefault(owner, []).append(b)
        packs: list[tuple[int, list[int]]] = []
        for owner, ids in by_owner.items():
            current: list[int] = []
            filled = 0
            for b in ids:
                if current and filled + lengths[b] > width:
                    packs.append((owner, current))
                    current, filled = [], 0
                current.append(b)
                filled += lengths[b]
            packs.append((owner, current))
        queries = max(sum(lengths[b] for b in ids) for _, ids in packs)
        longest = max(lengths)
        start, block, offset = [0] * len(owners), [], []
        for p, (_, ids) in enumerate(packs):
            used = 0
            for b in ids:
                start[b] = p * queries + used
                block += [b] * lengths[b]
                offset += range(lengths[b])
                used += lengths[b]
            block += range(-1 - used, -1 - queries, -1)  # each unused place a block of its own
            offset += [0] * (queries - used)
        count = torch.tensor(lengths)
        flat = torch.tensor(start)[:, None] + torch.minimum(torch.arange(longest), count[:, None] - 1)
        given = (torch.arange(longest) < count[:, None]).reshape(-1).nonzero().squeeze(1)
        blocks = torch.tensor(block, device=device).reshape(len(packs), queries)
        step = torch.arange(queries, device=device)
        own = (blocks[:, :, None] == blocks[:, None, :]) & (step[None, None, :] <= step[None, :, None])
        length = prefix.length
        mask = torch.cat([torch.ones(len(packs), queries, length, dtype=torch.bool, device=device), own], dim=2)
        mask = mask[:, None]
        if additive is not None:
            mask = torch.zeros(mask.shape, dtype=additive, device=device).masked_fill(~mask, torch.finfo(additive).min)
        rows = None if prefix.size == 1 else torch.tensor([owner for owner, _ in packs], device=device)
        positions = length + torch.tensor(offset, device=device).reshape(len(packs), queries)
        return _Packing(rows, flat.to(device), given.to(device), positions, mask)

    @property
    def shape(self) -> tuple[int, int]:
        return self.position_ids.shape[0], self.position_ids.shape[1]

    def inputs(self, embeds: torch.Tensor) -> dict:
        """The forward's arguments for continuations' input vectors ``embeds`` ``[B, longest, d]``."""
        packed = embeds.new_zeros(self.shape[0] * self.shape[1], embeds.shape[-1])
        flat, inputs = self.flat.reshape(-1)[self.given], embeds.reshape(-1, embeds.shape[-1])[self.given]
        packed = packed.index_put((flat,), inputs)
        return {
            "inputs_embeds": packed.reshape(*self.shape, -1),
            "attention_mask": self.mask,
            "position_ids": self.position_ids,
        }

    def states(self, packed: torch.Tensor) -> torch.Tensor:
        """``[B, longest, d]`` of a packed forward's ``[R, Q, d]``."""
        return packed.reshape(-1, packed.shape[-1])[self.flat]

    def heads(self, packed: torch.Tensor) -> torch.Tensor:
        """Keys or values ``[B, heads, longest, head_dim]`` of a packed forward's ``[R, heads, Q, head_dim]``."""
        by_place = packed.transpose(1, 2).reshape(-1, packed.shape[1], packed.shape[-1])
        return by_place[self.flat].transpose(1, 2)


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
        """Compare the probe with transformers' own ``output_hidden_states`` on two tokens (one small forward): a
        model whose blocks or final norm were mapped wrongly gets a one-line error here, never a wrong layer.

        Skipped for a model with forward hooks (e.g. one whose block outputs are replaced on purpose): transformers
        records hidden states before such hooks act, the probe reads what the next block receives."""
        if has_hooks(self.model):
            return
        name = type(self.model).__name__
        ids = torch.tensor([[0, min(1, self.vocab_size - 1)]], device=self.device)
        outputs: list[object] = []
        handle = self.blocks[0].register_forward_hook(lambda module, args, output: outputs.append(output))
        try:
            with torch.no_grad():
                ref = self.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        finally:
            handle.remove()
        self._blocks_return_tensors = bool(outputs) and all(isinstance(o, torch.Tensor) for o in outputs)
        if ref is None or len(ref) != self.n_layers + 1:
            raise LminvertError(f"{name} does not return {self.n_layers + 1} hidden states: cannot map its layers")
        try:
            ours = self.states(ids, [*range(self.n_layers + 1), "final"])
        except KeyError:
            raise LminvertError(
                f"the blocks found in {name} ('{self.blocks_name}') do not run in its forward: cannot map its "
                "layers (teach lminvert.models.probe._find_blocks)"
            ) from None

        def same(a: torch.Tensor, b: torch.Tensor) -> bool:
            return bool((a.float() - b.float()).norm() <= 1e-2 * b.float().norm() + 1e-6)

        for layer in range(self.n_layers):
            if not same(ours[layer], ref[layer]):
                raise LminvertError(
                    f"layer {layer} read from '{self.blocks_name}' of {name} is not transformers' hidden_states"
                    f"[{layer}]: cannot map this architecture (teach lminvert.models.probe._find_blocks)"
                )
        last = ours[self.n_layers]
        if same(last, ref[-1]):
            return  # the model's last hidden state is the raw residual stream (no final norm, or not applied)
        if self.final_norm is None:
            raise LminvertError(
                f"cannot find the final norm of {name} (looked for {', '.join(NORM_NAMES)}): its last hidden state "
                "is normalised by a module lminvert does not know (teach lminvert.models.probe._find_final_norm)"
            )
        if not same(self.final_norm(last), ref[-1]):
            raise LminvertError(
                f"the final norm found in {name} does not give transformers' last hidden state: cannot map 'final'"
            )

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
        if self._vocab_matrix is None:
            if type(self.embedding) is nn.Embedding:
                self._vocab_matrix = self.embedding.weight.detach()
            else:
                with torch.no_grad():
                    ids = torch.arange(self.vocab_size, device=self.device)
                    self._vocab_matrix = torch.cat([self.embed(chunk) for chunk in ids.split(16384)])
        if dtype is None or dtype == self._vocab_matrix.dtype:
            return self._vocab_matrix
        if dtype not in self._vocab_copies:
            self._vocab_copies[dtype] = self._vocab_matrix.to(dtype)
        return self._vocab_copies[dtype]

    def vocab_dots(self, vector: torch.Tensor) -> torch.Tensor:
        """``vocab_matrix() @ vector`` ``[V]`` in float32, for rankings (they only order candidates, each of which is
        verified). On a CPU (with ``HALF_DOTS``) the product runs on a float16 copy of the vocabulary scaled to entries
        of at most 1, the vector likewise: the product is bound by the bytes it reads, and a float16 matrix-vector
        product needs no half GEMM kernel (on this project's AVX2 CPU, SmolLM2, 2 threads: 2.9 against 9.7 ms;
        relative error ~5e-4 of the largest product). Always, not where a timing says so: the candidates' order, and
        so the candidates verified, must not depend on the machine's load. A ``[20, d]`` product would be slower in
        float16 (48 against 30 ms): only vectors take this path."""
        vocab = self.vocab_matrix(torch.float32)
        vector = vector.float()
        if self._vocab_half is None:
            scale = float(vocab.abs().max())
            fits = HALF_DOTS and self.device.type == "cpu" and 0 < scale < float("inf")
            self._vocab_half = ((vocab / scale).half(), scale) if fits else False
        top = float(vector.abs().max()) if self._vocab_half else 0.0
        if not self._vocab_half or not 0 < top < float("inf"):
            return vocab @ vector
        half, scale = self._vocab_half
        return (half @ (vector / top).half()).float().mul_(scale * top)

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
        return self.prefixes([token_ids], layer)

    def prefixes(self, rows: Sequence[Sequence[int]], layer: LayerSpec) -> Prefix:
        """One batched KV cache (blocks ``1..layer``) of several prefixes of the same length, in one forward."""
        resolved = self.layer(layer)
        ids = [[int(t) for t in row] for row in rows]
        if not ids or len({len(row) for row in ids}) != 1:
            raise ValueError("give at least one prefix; all prefixes must have the same length")
        if not ids[0]:
            return Prefix(ids, resolved, None)
        cache = DynamicCache(config=self.config)
        tensor = torch.tensor(ids, device=self.device)
        self.check_ids(tensor)
        with torch.no_grad(), self._cached_math():
            self._forward(
                [Layer(resolved.top_block, self.n_layers)], input_ids=tensor, past_key_values=cache, use_cache=True
            )
        return Prefix(ids, resolved, cache)

    def extend(self, prefix: Prefix, token_id: int) -> Prefix:
        """The prefix with one more token, reusing (and taking over) its cache."""
        return self.advance(prefix, token_id)[0]

    def advance(self, prefix: Prefix, token_id: int) -> tuple[Prefix, torch.Tensor]:
        """Like :meth:`extend`, also returning the new token's state ``[d]`` after block ``top_block``."""
        grown, states = self.advance_rows(prefix, [token_id])
        return grown, states[0]

    @staticmethod
    def _grown_rows(prefix: Prefix, token_ids: Sequence[int]) -> list[list[int]]:
        """The prefix's rows, each grown by its token (one per row)."""
        if len(token_ids) != prefix.size:
            raise ValueError(f"one token per prefix row: got {len(token_ids)} for {prefix.size} rows")
        return [[*row, int(t)] for row, t in zip(prefix.rows, token_ids, strict=True)]

    def _cache_of(self, prefix: Prefix) -> Cache:
        """The prefix's cache, or a new empty one for an empty prefix."""
        return prefix.cache if prefix.cache is not None else DynamicCache(config=self.config)

    def advance_rows(self, prefix: Prefix, token_ids: Sequence[int]) -> tuple[Prefix, torch.Tensor]:
        """Every row grows by its token (one forward, the cache is taken over); returns the new tokens' states
        ``[N, d]`` after block ``top_block``."""
        rows = self._grown_rows(prefix, token_ids)
        top = Layer(prefix.layer.top_block, self.n_layers)
        cache = self._cache_of(prefix)
        tensor = torch.tensor([row[len(row) - prefix.behind - 1 :] for row in rows], device=self.device)
        self.check_ids(tensor)
        with torch.no_grad(), self._cached_math():
            out = self._forward([top], input_ids=tensor, past_key_values=cache, use_cache=True)
        return Prefix(rows, prefix.layer, cache), out[top][:, -1]

    def defer(self, prefix: Prefix, token_ids: Sequence[int]) -> Prefix:
        """Every row grows by its token without a forward: its keys and values join the cache with the next forward
        that grows it (:meth:`advance_rows` or :meth:`catch_up`), together with any other deferred tokens. For a
        search that may decide the next positions without reading the cache (from plain forwards' states)."""
        if prefix.cache is None:
            raise ValueError("an empty prefix grows by advance_rows")
        return Prefix(self._grown_rows(prefix, token_ids), prefix.layer, prefix.cache, prefix.behind + 1)

    def catch_up(self, prefix: Prefix) -> bool:
        """Put the deferred tokens' keys and values in the cache (one forward; the prefix is updated in place);
        whether a forward ran."""
        if not prefix.behind:
            return False
        grown, _ = self.advance_rows(
            Prefix([row[:-1] for row in prefix.rows], prefix.layer, prefix.cache, prefix.behind - 1),
            [row[-1] for row in prefix.rows],
        )
        prefix.cache, prefix.behind = grown.cache, 0
        return True

    def advance_from(self, prefix: Prefix, token_ids: Sequence[int], new: NewKeys) -> Prefix:
        """Every row grows by its token, whose keys and values ``new`` (one row per prefix row) a verification
        forward (:meth:`continuation` with ``keys=True``) already computed: no forward runs. The cache is taken
        over (an empty prefix's is created from ``new``)."""
        if prefix.behind:
            raise ValueError("the prefix has deferred tokens: catch_up first")
        rows = self._grown_rows(prefix, token_ids)
        if new.layers[0][0].shape[0] != prefix.size:
            raise ValueError(f"one row of keys per prefix row ({prefix.size})")
        if len(new.layers) != prefix.layer.top_block:
            raise ValueError(f"keys and values of {prefix.layer.top_block} blocks needed, got {len(new.layers)}")
        cache = self._cache_of(prefix)
        for block, (keys, values) in enumerate(new.layers):
            cache.update(keys, values, block)
        return Prefix(rows, prefix.layer, cache)

    def select(self, prefix: Prefix, keep: Sequence[int]) -> Prefix:
        """Only rows ``keep`` of the prefix (its cache is taken over)."""
        if list(keep) == list(range(prefix.size)):
            return prefix
        if prefix.cache is not None:
            prefix.cache.batch_select_indices(torch.tensor(list(keep), dtype=torch.long, device=self.device))
        return Prefix([prefix.rows[i] for i in keep], prefix.layer, prefix.cache, prefix.behind)

    def final_from(self, states: torch.Tensor, layer: LayerSpec) -> torch.Tensor:
        """The last hidden state (what the LM head reads) ``[B, T, d]`` of sequences whose layer-``layer``
        states are ``states`` ``[B, T, d]``: the blocks above ``layer`` run on the given states (one forward;
        attention is causal, so right-padding a batch leaves the real positions as they are). Below ``layer`` the
        forward runs on placeholder tokens, so every family's own positions, masks and caches apply, and the blocks
        below ``layer`` hand on ``states`` without computing anything (where the mapping check saw blocks return
        plain tensors; elsewhere they run and a forward hook replaces what the last of them returns). Given a prompt's
        observed states, this is what the model computed above the observer: its next-token distribution at every
        position, without the prompt."""
        resolved = self.layer(layer)
        states = states.to(device=self.device, dtype=self.dtype)
        if states.dim() == 2:
            states = states[None]
        if resolved.is_final:
            return states
        if int(resolved) == self.n_layers:
            return states if self.final_norm is None else self.final_norm(states)

        def pre_hook(module, args, kw):
            if args:
                return (states, *args[1:]), kw
            return args, {**kw, "hidden_states": states}

        def hook(module, args, output):
            return (states, *output[1:]) if isinstance(output, tuple) else states

        below = self.blocks[: int(resolved)]
        skipped = self._blocks_return_tensors and int(resolved) > 0
        if int(resolved) == 0:
            handle = self.blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
        elif skipped:  # an instance attribute: nn.Module calls it instead of the class's (one already there is kept)
            handle = None
            kept = [block.__dict__.get("forward") for block in below]
            for block in below:
                block.forward = lambda *args, **kwargs: states
        else:
            handle = self.blocks[int(resolved) - 1].register_forward_hook(hook)
        placeholder = torch.zeros(states.shape[:2], dtype=torch.long, device=self.device)
        try:  # it only orders candidates: a half model's GEMMs may run as float32 ones here (:mod:`.halfmath`)
            with torch.no_grad(), self._cached_math():
                return self.base(input_ids=placeholder, use_cache=False).last_hidden_state
        finally:
            if handle is not None:
                handle.remove()
            if skipped:
                for block, forward in zip(below, kept, strict=True):
                    if forward is None:
                        del block.forward
                    else:
                        block.forward = forward

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
            if isinstance(head, nn.Linear) and self.dtype != torch.float32:  # rank in float32: CPUs are slow in half
                if self._head32 is None:
                    bias = None if head.bias is None else head.bias.detach().float()
                    self._head32 = (head.weight.detach().float(), bias)
                return nn.functional.linear(state.float(), *self._head32)
            return head(state)

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
        one forward). ``keys=True`` (with ``token_ids``, no ``layers``): returns ``(states, NewKeys)``, the
        continuations' keys and values in every cached block (None for an empty prefix or where no block ran, at
        layer 0), for :meth:`advance_from`.
        """
        if (token_ids is None) == (embeds is None):
            raise ValueError("give exactly one of token_ids or embeds")
        if (rows is None) != (prefix.size == 1):
            raise ValueError("give rows (the prefix row of each continuation) exactly when the prefix has several")
        if token_ids is not None:
            self.check_ids(token_ids)
            embeds = self.embed(token_ids.reshape(-1))
        assert embeds is not None
        out, new = self._continue(prefix, embeds[:, None, :], layers, rows, keys)
        out = {layer: state[:, 0, :] for layer, state in out.items()}
        if keys:
            return out[prefix.layer], new
        return out[prefix.layer] if layers is None else out

    def chains(
        self,
        prefix: Prefix,
        token_ids: torch.Tensor,
        rows: torch.Tensor | None = None,
        lengths: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, NewKeys | None]:
        """States ``[B, K, d]`` at positions ``prefix.length .. prefix.length + K - 1`` of B continuations of K
        tokens each (``token_ids`` ``[B, K]``), in one forward over the cached prefix, with their keys and values
        (``[B, heads, K, head_dim]`` per cached block; :meth:`NewKeys.at` takes one position). Causal attention makes
        position ``j``'s state that of a one-token continuation of the prefix grown by the row's first ``j`` tokens
        (rounded differently: the verification radii measure it, :mod:`lminvert.invert.tolerance`). ``rows``: as in
        :meth:`continuation`. ``lengths``: chains of different lengths (row ``b`` holds ``lengths[b]`` tokens, the
        rest of it is padding whose states are not to be read); where :meth:`packs_chains` they are packed and only
        their own tokens are computed, elsewhere the padded rows run whole."""
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
            out, new = self._continue(prefix, embeds, None, rows, keys=True, lengths=lengths)
        return out[prefix.layer], new

    def packs_chains(self, prefix: Prefix) -> bool:
        """Whether chains of different lengths over ``prefix`` run packed (their own tokens only; :meth:`chains`)."""
        return self._attention_to_pack(prefix, self.pack) is not None

    def _continue(
        self,
        prefix: Prefix,
        embeds: torch.Tensor,
        layers: Sequence[LayerSpec] | None,
        rows: torch.Tensor | None,
        keys: bool,
        lengths: Sequence[int] | None = None,
    ) -> tuple[dict[Layer, torch.Tensor], NewKeys | None]:
        """States ``[B, K, d]`` of input vectors ``embeds`` ``[B, K, d]`` appended to the cached prefix (the shared
        forward of :meth:`continuation` and :meth:`chains`), and with ``keys`` their keys and values.

        Over a cached prefix the continuations are packed (:meth:`_packing`): up to ``pack`` tokens of continuations of
        the same prefix row share one row of the forward, each attending to the prefix and to its own earlier tokens
        only (a block-diagonal mask, positions given explicitly), so the prefix's keys and values are read once per
        packed row instead of being copied for every continuation. The mask makes every state that of its own
        continuation; only the attention kernels' rounding differs (the verification radii are measured through
        this very path, :mod:`lminvert.invert.tolerance`)."""
        if prefix.behind:
            raise ValueError("the prefix has deferred tokens: catch_up first")
        wanted = [prefix.layer] if layers is None else self.layers(layers)
        if max(wanted) > prefix.layer and prefix.cache is not None:
            raise ValueError("continuation layers must not exceed the prefix's layer")
        if keys and layers is not None:
            raise ValueError("keys=True returns the states at the prefix's layer only")
        kwargs: dict = {"inputs_embeds": embeds.to(self.dtype), "use_cache": prefix.cache is not None}
        views: list[_FrozenPrefixLayer] = []
        fresh: DynamicCache | None = None  # an empty prefix: the continuations' keys and values are collected here
        packing = self._packing(prefix, embeds.shape[0], embeds.shape[1], rows, lengths)
        if prefix.cache is not None:
            index = None if rows is None else rows.to(self.device)
            if packing is not None:
                index, kwargs = packing.rows, {**kwargs, **packing.inputs(embeds.to(self.dtype))}
            views = [_FrozenPrefixLayer(layer, index) for layer in prefix.cache.layers]
            kwargs["past_key_values"] = Cache(layers=views)
        elif keys and layers is None:
            fresh = DynamicCache(config=self.config)
            kwargs.update(past_key_values=fresh, use_cache=True)
        with torch.set_grad_enabled(embeds.requires_grad), self._cached_math():
            out = self._forward(wanted, **kwargs)
        if packing is not None:
            out = {layer: packing.states(state) for layer, state in out.items()}
        if not keys:
            return out, None
        top = prefix.layer.top_block
        if fresh is not None:
            computed = [(layer.keys, layer.values) for layer in fresh.layers[:top] if layer.keys is not None]
        else:
            computed = [view.new for view in views[:top] if hasattr(view, "new")]
            if packing is not None:
                computed = [(packing.heads(k), packing.heads(v)) for k, v in computed]
        complete = top > 0 and len(computed) == top  # layer 0: no block runs
        return out, (NewKeys(tuple(computed)) if complete else None)

    def _packing(
        self,
        prefix: Prefix,
        batch: int,
        tokens: int,
        rows: torch.Tensor | None,
        lengths: Sequence[int] | None = None,
    ) -> _Packing | None:
        """How ``batch`` continuations of ``tokens`` tokens each (or of ``lengths``) over a cached prefix are packed
        into rows, or None (one row each): where the attention cannot take them (:meth:`_attention_to_pack`) or, for
        continuations of equal lengths, where packing would not pay (a prefix shorter than ``pack``, or fewer than
        ``packed_from`` prefix positions copied; ``packed_from = 0`` packs whatever can be packed, as
        :func:`.always_packed` does). Chains of different lengths are packed wherever they can be: only their own
        tokens are computed."""
        copied = batch * tokens * prefix.length
        if lengths is None and self.packed_from > 0 and (prefix.length < self.pack or copied < self.packed_from):
            return None
        width = max(self.pack, tokens)
        attention = self._attention_to_pack(prefix, width)
        if attention is None:
            return None
        owners = [0] * batch if rows is None else rows.tolist()
        counts = [tokens] * batch if lengths is None else list(lengths)
        additive = self.dtype if attention == "eager" else None
        return _Packing.build(prefix, owners, counts, width, self.device, additive)

    def _attention_to_pack(self, prefix: Prefix, width: int) -> str | None:
        """The attention implementation that will take packed rows of ``width`` tokens over ``prefix``, or None:
        without a cache (nothing to share), with packing off, with an implementation that takes no custom 4D mask,
        or where a sliding window or attention chunk could end inside the packed row (the mask would not repeat it)."""
        if prefix.cache is None or self.pack <= 0:
            return None
        attention = attn_implementation(self.model.config)
        if attention not in PACKED_ATTENTION:
            return None
        windows = [getattr(self.config, name, None) for name in ("sliding_window", "attention_chunk_size")]
        if any(isinstance(w, int) and w > 0 and prefix.length + width > w for w in windows):
            return None
        return attention
