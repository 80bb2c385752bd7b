"""Generation from a Glm5Model: prefill the prompts, then decode one token per step (models/glm5/decode.py).

    from torchtitan_glm.generation import generate
    out = generate(model, input_ids, max_new_tokens=32)                 # greedy: [B, T + 32]
    out = generate(model, input_ids, max_new_tokens=32, temperature=0.8, top_p=0.95, generator=g)

Rows of different lengths come left-padded with an `attention_mask` (1 = token), as transformers takes them; the
output keeps that layout. Temperature 0 is greedy (the first maximal logit, deterministic); otherwise tokens are
sampled from softmax(logits / temperature) restricted to the smallest set of top tokens whose probability reaches
top_p (nucleus sampling).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchtitan_glm.models.glm5.decode import decode_step, prefill, prompt_lengths

__all__ = ["generate", "sample"]


def sample(logits: torch.Tensor, *, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else nucleus sampling (module docstring)."""
    _check_sampling(temperature, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the better tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the best token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> torch.LongTensor:
    """input_ids [B, T] (left-padded when `attention_mask` [B, T] is given) -> [B, T + max_new_tokens].

    A row that produces `eos_token_id` is finished: its later tokens are `pad_token_id` (default: the eos id), and
    the loop stops early when every row is. `on_step(tokens [B])` sees each step's new tokens (for streaming)."""
    if input_ids.ndim != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be an integer [B, T] tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    vocab = model.args.vocab_size
    if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < vocab:
        raise ValueError(f"input_ids must be token ids in [0, {vocab}) (the model's vocab_size)")
    input_ids = input_ids.long()
    bsz, seqlen = input_ids.shape
    lengths = None if attention_mask is None else prompt_lengths(attention_mask.to(input_ids.device))
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    _check_sampling(temperature, top_p)
    fill = pad_token_id if pad_token_id is not None else eos_token_id
    out = torch.full((bsz, seqlen + max_new_tokens), 0 if fill is None else fill, dtype=torch.long,
                     device=input_ids.device)
    out[:, :seqlen] = input_ids
    if max_new_tokens == 0:
        return out
    hidden, state = prefill(model, input_ids, lengths=lengths, capacity=seqlen + max_new_tokens)
    logits = model.lm_head(hidden[:, -1])
    finished = torch.zeros(bsz, dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        tokens = sample(logits, temperature=temperature, top_p=top_p, generator=generator)
        if eos_token_id is not None:
            tokens = torch.where(finished, out[:, seqlen + step], tokens)
            finished |= tokens == eos_token_id
        out[:, seqlen + step] = tokens
        if on_step is not None:
            on_step(tokens)
        if step + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
            break
        logits = model.lm_head(decode_step(model, tokens, state))
    return out
