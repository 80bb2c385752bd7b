"""Test helpers for incremental decode: a model's logits along documents by the training forward (packed) and by
prefill + one-token decode steps (each document a separate, left-padded prompt)."""

from __future__ import annotations

import torch

from torchtitan_glm.models.glm5.decode import decode_step, prefill


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Random values in every parameter (norm weights around 1) and the router bias: no init coincidence hides a
    bug (the reference init zeroes the KPool APE and sets its gate to ones)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen) * (0.3 if p.ndim == 1 else scale)
        p.copy_(noise + (1.0 if name.endswith("norm.weight") else 0.0))
    for name, b in module.named_buffers():
        if "e_score_correction_bias" in name:
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return module


def random_docs(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


@torch.no_grad()
def packed_logits(model, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The training forward over the documents packed in one row (cu_seqlens): [n_d, V] per document."""
    lengths = [len(d) for d in docs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=docs[0].device)
    logits = model.logits(torch.cat(docs).unsqueeze(0), cu)[0]
    return list(logits.split(lengths))


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, T] left-padded with token 0, lengths [B]), on the prompts' device."""
    width = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=prompts[0].device)
    for b, p in enumerate(prompts):
        tokens[b, width - len(p):] = p
    return tokens, torch.tensor([len(p) for p in prompts], device=prompts[0].device)


@torch.no_grad()
def decoded_logits(model, docs: list[torch.Tensor], prefill_lengths: list[int], *,
                   selected: list | None = None) -> list[torch.Tensor]:
    """Each document a separate prompt: its first prefill_lengths[d] tokens prefilled (one left-padded batch), the
    rest fed one token per decode step; [n_d, V] logits per document. `selected` receives, per decode step, the
    indexer layers' [B, K] selections (prompt positions)."""
    tokens, lengths = left_pad([d[:p] for d, p in zip(docs, prefill_lengths)])
    width = tokens.shape[1]
    steps = max(len(d) - p for d, p in zip(docs, prefill_lengths))
    hidden, state = prefill(model, tokens, lengths=lengths, capacity=width + steps)
    logits = model.lm_head(hidden)
    out = [[logits[b, width - p:]] for b, p in enumerate(prefill_lengths)]
    for s in range(steps):
        nxt = torch.stack([d[min(p + s, len(d) - 1)] for d, p in zip(docs, prefill_lengths)])
        step_sel = [] if selected is not None else None
        step = model.lm_head(decode_step(model, nxt, state, selected=step_sel))
        if selected is not None:
            selected.append(step_sel)
        for b, (d, p) in enumerate(zip(docs, prefill_lengths)):
            if p + s < len(d):
                out[b].append(step[b:b + 1])
    return [torch.cat(parts) for parts in out]


def max_rel_err(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Largest |actual - expected| over all documents, relative to the largest |expected|."""
    scale = max(float(e.abs().max()) for e in expected)
    return max(float((a - e).abs().max()) for a, e in zip(actual, expected)) / scale
