"""The layer probe's vocabulary: all input vectors, their product with one vector for rankings, and next-token
logits. The functions are the bodies of :class:`.probe.LayerProbe`'s methods of the same names (its caches stay on
the probe); ``probe`` is a :class:`.probe.LayerProbe`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import LminvertError
from .halfmath import native_bfloat16

HALF_DOTS = True  # LayerProbe.vocab_dots on a CPU through a float16 copy of the vocabulary
# a single state's next-token logits for a ranking (``ranking=True``) through vocab_dots' float16 copy, where the LM
# head is the vocabulary itself (tied and unscaled, no bias); False: the head's own product
HALF_HEAD = True
HALF_RANKS = True  # rankings' products of the whole vocabulary with many vectors in bfloat16 where native (low_vocab)


def vocab_matrix(probe, dtype: torch.dtype | None = None) -> torch.Tensor:
    """All |V| input vectors, ``embed(arange(V))``, built once (the weight itself when unscaled), on the model's
    device; ``dtype=torch.float32`` gives (and keeps) a float32 copy for rankings in a half-precision model."""
    if probe._vocab_matrix is None:
        if type(probe.embedding) is nn.Embedding:
            probe._vocab_matrix = probe.embedding.weight.detach()
        else:
            with torch.no_grad():
                ids = torch.arange(probe.vocab_size, device=probe.device)
                probe._vocab_matrix = torch.cat([probe.embed(chunk) for chunk in ids.split(16384)])
    if dtype is None or dtype == probe._vocab_matrix.dtype:
        return probe._vocab_matrix
    if dtype not in probe._vocab_copies:
        probe._vocab_copies[dtype] = probe._vocab_matrix.to(dtype)
    return probe._vocab_copies[dtype]


def low_vocab(probe, device: torch.device | None = None) -> torch.Tensor | None:
    """The vocabulary in bfloat16 on ``device`` (the probe's by default), for products of the whole vocabulary with
    many vectors that only order candidates (each one verified): where bfloat16 GEMMs are native there
    (:func:`.halfmath.native_bfloat16`) and :data:`HALF_RANKS` is on; else None (the caller computes in float32).
    Entries keep about 3 significant digits; such a product of SmolLM2's or Gemma-3's vocabulary ran in ~0.35x the
    float32 time on this project's AVX512-BF16 CPU. A fixed fact of the machine, never a timing."""
    device = probe.device if device is None else torch.device(device)
    if not HALF_RANKS or not native_bfloat16(device):
        return None
    low = vocab_matrix(probe, torch.bfloat16)
    return low if low.device == device else low.to(device)


def vocab_dots(probe, vector: torch.Tensor) -> torch.Tensor:
    """``vocab_matrix() @ vector`` ``[V]`` in float32, for rankings (they only order candidates, each of which is
    verified). On a CPU (with ``HALF_DOTS``) the product runs on a float16 copy of the vocabulary scaled to entries
    of at most 1, the vector likewise: the product is bound by the bytes it reads, and a float16 matrix-vector
    product needs no half GEMM kernel (on this project's AVX2 CPU, SmolLM2, 2 threads: 2.9 against 9.7 ms;
    relative error ~5e-4 of the largest product). Always, not where a timing says so: the candidates' order, and
    so the candidates verified, must not depend on the machine's load. A ``[20, d]`` product would be slower in
    float16 (48 against 30 ms): only vectors take this path."""
    vocab = probe.vocab_matrix(torch.float32)
    vector = vector.float()
    if probe._vocab_half is None:
        scale = float(vocab.abs().max())
        fits = HALF_DOTS and probe.device.type == "cpu" and 0 < scale < float("inf")
        probe._vocab_half = ((vocab / scale).half(), scale) if fits else False
    top = float(vector.abs().max()) if probe._vocab_half else 0.0
    if not probe._vocab_half or not 0 < top < float("inf"):
        return vocab @ vector
    half, scale = probe._vocab_half
    return (half @ (vector / top).half()).float().mul_(scale * top)


def next_token_logits(probe, state: torch.Tensor, normed: bool = False, ranking: bool = False) -> torch.Tensor:
    """The model's next-token logits from states ``[..., d]`` after the last block (``normed``: after the
    final norm already). Output soft-capping, where a model has it, is left out: it does not change the order.
    ``ranking``: the logits only order candidates (each of them verified), so one state's ``[d]`` may take
    :func:`vocab_dots`' path where the head is the vocabulary matrix itself (:data:`HALF_HEAD`: SmolLM2's tied head,
    49,152 x 576, 1.6 against 7.4 ms a state on this project's AVX-512 CPU; relative error ~5e-4 of the largest
    logit)."""
    head = probe.model.get_output_embeddings()
    if head is None:
        raise LminvertError(f"{type(probe.model).__name__} has no LM head: it cannot rank next tokens")
    with torch.no_grad():
        state = state.to(device=probe.device, dtype=probe.dtype)
        if not normed and probe.final_norm is not None:
            state = probe.final_norm(state)
        if ranking and HALF_HEAD and state.dim() == 1 and _head_is_vocabulary(probe, head):
            return vocab_dots(probe, state)
        if isinstance(head, nn.Linear) and probe.dtype != torch.float32:  # rank in float32: CPUs are slow in half
            if probe._head32 is None:
                bias = None if head.bias is None else head.bias.detach().float()
                probe._head32 = (head.weight.detach().float(), bias)
            return nn.functional.linear(state.float(), *probe._head32)
        return head(state)


def _head_is_vocabulary(probe, head: nn.Module) -> bool:
    """Whether the LM head's product is the vocabulary matrix's (:func:`vocab_matrix`): a plain ``nn.Linear`` without a
    bias whose weight is that matrix (tied to an unscaled embedding)."""
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    vocab = vocab_matrix(probe)
    return head.weight.shape == vocab.shape and head.weight.data_ptr() == vocab.data_ptr()
