"""Incremental decode of a Glm5Model: the trunk's blocks and weights, in serving's form (no second model).

    hidden, state = prefill(model, tokens, lengths=..., capacity=...)   # the chunked training path + caches
    hidden = decode_step(model, next_tokens, state)                      # one token per row, caches advance

`model.lm_head(hidden)` gives the logits. Each row of `tokens` [B, T] is one prompt, left-padded to T (a row of
length n keeps its prompt in its last n columns; the padding never reaches the prompt: it runs as a separate
document and is not cached). Per layer type (models/glm5/cache.py): KDA keeps its FP32 recurrent state and the
short convs' last inputs and steps through the recurrent form (ops/kda_decode.py); a DSA layer keeps the kv latent
of every token and attends in the absorbed form over it; its KPool indexer keeps the pooled keys, each written once
when its pool closes, plus the open pool's per-token keys. With indexer_fp8_emulation the cached pooled keys and the
queries take serving's FP8 rounding, as in training. The MTP layer is not run.

Single process (no FSDP/TP wrapping); no gradient.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .batch import batch_layout
from .cache import DecodeState
from .mhc import mean_hc_head

if TYPE_CHECKING:
    from .model import Glm5Model

__all__ = ["DecodeState", "decode_step", "indexer_fp8", "prefill", "prompt_lengths", "runs_indexer"]


def prompt_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] prompt lengths from a left-padding mask [B, T] (1 = token, 0 = padding before the prompt); ValueError
    naming `attention_mask` if a row is empty or has padding after a token."""
    mask = attention_mask.to(torch.long)
    if mask.ndim != 2 or bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"attention_mask must be a [B, T] tensor of 0 and 1, got shape {tuple(mask.shape)}")
    left_padded = (mask[:, 1:] >= mask[:, :-1]).all(1) & (mask[:, -1] == 1)  # zeros, then ones to the end
    if not bool(left_padded.all()):
        rows = torch.nonzero(~left_padded).flatten().tolist()
        raise ValueError(f"attention_mask rows {rows} are not left-padded prompts (zeros, then ones up to the last "
                         "column, at least one); right padding is not supported")
    return mask.sum(1)


@torch.no_grad()
def prefill(model: Glm5Model, tokens: torch.Tensor, *, lengths: torch.Tensor | None = None,
            capacity: int, selected: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, DecodeState]:
    """Run left-padded prompts tokens [B, T] (row b's prompt is its last lengths[b] tokens; default: all T) through
    the training forward's blocks, and build the decode state for `capacity` tokens per row.

    Returns (final hidden states [B, T, D] after the final norm, the DecodeState). `selected`, if given, receives the
    [B, T, K] token indices (row positions) of each DSA layer that runs an indexer."""
    bsz, seqlen = tokens.shape
    device = tokens.device
    if lengths is None:
        lengths = torch.full((bsz,), seqlen, dtype=torch.long, device=device)
    lengths = lengths.to(device=device, dtype=torch.long)
    if lengths.shape != (bsz,) or bool(((lengths < 1) | (lengths > seqlen)).any()):
        raise ValueError(f"lengths must be [B] = [{bsz}] prompt lengths in [1, {seqlen}], got {lengths.tolist()}")
    if capacity < seqlen:
        raise ValueError(f"capacity {capacity} is smaller than the prompts' width {seqlen}")
    doc_ids = None
    if bool((lengths < seqlen).any()):  # padding: its own document before each prompt
        doc_ids = (torch.arange(seqlen, device=device) >= (seqlen - lengths).unsqueeze(1)).long()
    batch = batch_layout(doc_ids, (bsz, seqlen), device)
    streams = _streams(model, tokens)
    caches, prev = [], None
    for layer in model.layers.values():
        out, cache = layer.prefill(streams, batch, prev, capacity=capacity)
        streams, prev = out.streams, out.indices if out.indices is not None else prev
        if selected is not None and runs_indexer(layer):
            selected.append(out.indices)
        caches.append(cache)
    return _head(model, streams), DecodeState(caches, lengths.clone(), capacity, int(lengths.max()))


@torch.no_grad()
def decode_step(model: Glm5Model, tokens: torch.Tensor, state: DecodeState, *,
                selected: list[torch.Tensor] | None = None) -> torch.Tensor:
    """One more token per row, tokens [B], at each row's next position: final hidden states [B, D]; the caches and
    positions in `state` advance. `selected`, if given, receives each indexer layer's [B, K] token indices
    (prompt positions, -1 = none)."""
    if state.longest >= state.capacity:
        raise ValueError(f"the decode state holds {state.capacity} tokens per row and is full; prefill with a larger "
                         "capacity")
    streams = _streams(model, tokens.view(-1, 1))
    prev = None
    for layer, cache in zip(model.layers.values(), state.layers):
        out = layer.decode(streams, cache, state.pos, prev)
        streams, prev = out.streams, out.indices if out.indices is not None else prev
        if selected is not None and runs_indexer(layer):
            selected.append(out.indices[:, 0])
    state.pos += 1
    state.longest += 1
    return _head(model, streams)[:, 0]


def runs_indexer(layer) -> bool:
    """Whether the layer runs its own sparse selection (a DSA layer with a full indexer, past the dense stage)."""
    return layer.is_dsa and layer.self_attn.indexer is not None and not layer.self_attn.dense


def _streams(model: Glm5Model, tokens: torch.Tensor) -> torch.Tensor:
    """The mHC streams entering layer 0: each token's embedding, hc_mult times (as Glm5Model.hidden_states)."""
    embeds = model.embed_tokens(tokens)
    return embeds.unsqueeze(-2).expand(*tokens.shape, model.args.hc_mult, -1).contiguous()


def _head(model: Glm5Model, streams: torch.Tensor) -> torch.Tensor:
    """Stream contraction and final norm (as Glm5Model.hidden_states)."""
    return model.norm(model.hc_head(streams) if model.args.hc_head == "learned" else mean_hc_head(streams))


@contextmanager
def indexer_fp8(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every KPool indexer of `model` uses serving's FP8 inputs (indexer_fp8_emulation) or not,
    whatever the model was built with: to decode as an FP8-indexer serving engine does."""
    from .dsa import KPoolIndexer

    indexers = [m for m in model.modules() if isinstance(m, KPoolIndexer)]
    before = [m.fp8_emulation for m in indexers]
    try:
        for m in indexers:
            m.fp8_emulation = enabled
        yield
    finally:
        for m, b in zip(indexers, before):
            m.fp8_emulation = b
