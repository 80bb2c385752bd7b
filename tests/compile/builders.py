"""Shared builders for the compile suite: seeded debug models, packed batches, per-block inputs, comparisons."""

from __future__ import annotations

import copy
from typing import Callable, NamedTuple

import torch
from torch import nn

from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.models.glm5.args import Glm5ModelArgs, get_flavor
from torchtitan_glm.models.glm5.batch import BatchLayout, DocLayout
from torchtitan_glm.models.glm5.model import Glm5Model
from torchtitan_glm.models.glm5.seqinfo import doc_positions

BATCH, SEQLEN = 2, 32
LM_CHUNK = 24  # smaller than the B*T tokens so the chunked CE loops over full and partial chunks

# Block name -> where it lives in the debug model (layers: 0 KDA+dense, 1-2 KDA+MoE, 3 DSA+MoE).
BLOCKS = {
    "kda_dense": "layers.0",
    "kda_moe": "layers.1",
    "dsa_moe": "layers.3",
    "mtp": "mtp",
    "lm_head_loss": "lm_head",
}


def debug_args(**overrides) -> Glm5ModelArgs:
    return get_flavor("debug").replace(**overrides)


def build_model(seed: int = 0, args: Glm5ModelArgs | None = None) -> Glm5Model:
    torch.manual_seed(seed)
    return Glm5Model(args or debug_args())


def doc_ids_for(step: int, bsz: int = BATCH, seqlen: int = SEQLEN) -> torch.Tensor:
    """[B, T] int64 document ids (0 at each row start) with boundaries that differ per step and per row."""
    gen = torch.Generator().manual_seed(1000 + step)
    starts = torch.rand(bsz, seqlen, generator=gen) < 0.12
    starts[:, 0] = False
    starts[0, 5 + step] = True  # at least one boundary per step, at a step-specific place
    return starts.long().cumsum(1)


class Batch(NamedTuple):
    tokens: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor


def make_batch(step: int, vocab: int, bsz: int = BATCH, seqlen: int = SEQLEN) -> Batch:
    """Packed training batch as the dataloader makes it: labels -100 where the next token starts a document."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (bsz, seqlen), generator=gen)
    labels = torch.randint(0, vocab, (bsz, seqlen), generator=gen)
    doc_ids = doc_ids_for(step, bsz, seqlen)
    ends = torch.zeros_like(labels, dtype=torch.bool)
    ends[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return Batch(tokens, labels.masked_fill(ends, -100), doc_ids)


def train_forward(model: nn.Module, batch: Batch, *, token_scale, mtp_scale, indexer_sparse_loss: bool = False):
    return model(batch.tokens, doc_ids=batch.doc_ids, labels=batch.labels, token_scale=token_scale,
                 mtp_scale=mtp_scale, indexer_kl="sparse" if indexer_sparse_loss else "dense",
                 ce_chunk_size=LM_CHUNK)


def training_loss(out) -> torch.Tensor:
    """LM + MTP loss plus the indexer KL (which reaches the indexer) so every parameter gets a gradient."""
    return out.loss + 1e-2 * indexer_kl_loss(out.indexer_stats)


def block_of(model: Glm5Model, name: str) -> nn.Module:
    args = model.args
    assert args.layer_types[:2] == ["linear_attention"] * 2 and args.layer_types[3] == "indexed_attention"
    assert args.mlp_layer_types[:2] == ["dense", "sparse"] and args.mlp_layer_types[3] == "sparse"
    return model.get_submodule(BLOCKS[name])


def block_inputs(model: Glm5Model, name: str, *, seed: int = 0, step: int = 0,
                 one_doc: bool = False) -> tuple[tuple, dict]:
    """Seeded (args, kwargs) for calling block `name` the way Glm5Model calls it (doc boundaries, or with one_doc
    one document per row and no ids; the indexer KL on: the sparse form in the DSA layer, the dense form in the MTP
    layer, so both KL ops compile)."""
    args = model.args
    gen = torch.Generator().manual_seed(seed)
    d, n = args.hidden_size, args.hc_mult
    doc_ids = None if one_doc else doc_ids_for(step)
    doc = DocLayout(*doc_positions(doc_ids, BATCH, SEQLEN, torch.device("cpu")))

    def randn(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(True)

    if name.startswith(("kda", "dsa")):
        return (randn(BATCH, SEQLEN, n, d), BatchLayout(doc, doc_ids, None, "sparse", False)), {}
    if name == "mtp":
        return (randn(BATCH, SEQLEN, d), randn(BATCH, SEQLEN, d), BatchLayout(doc, doc_ids, None, "dense", False)), {}
    if name == "lm_head_loss":
        labels = torch.randint(0, args.vocab_size, (BATCH * SEQLEN,), generator=gen)
        labels[::7] = -100
        weights = torch.rand(BATCH * SEQLEN, generator=gen)
        return (randn(BATCH * SEQLEN, d), labels, weights), {"chunk_size": LM_CHUNK}
    raise KeyError(name)


def block_loss(out) -> torch.Tensor:
    """Scalar from any block's output tuple: every differentiable tensor output contributes."""
    total = torch.zeros(())
    for i, t in enumerate(_tensors(out)):
        if t.requires_grad:
            total = total + (t.float() * (1.0 + 0.1 * i)).square().mean()
    return total


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def output_tensors(out) -> list[torch.Tensor]:
    return [t.detach() for t in _tensors(out)]


def clone_inputs(inputs: tuple[tuple, dict]) -> tuple[tuple, dict]:
    def one(x):
        if isinstance(x, torch.Tensor):
            return x.detach().clone().requires_grad_(x.requires_grad)
        if isinstance(x, DocLayout):
            return DocLayout(*(t.clone() for t in x))
        if isinstance(x, BatchLayout):
            return x._replace(doc=one(x.doc), doc_ids=None if x.doc_ids is None else x.doc_ids.clone())
        return x

    args, kwargs = inputs
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    """max |a - e| <= rtol * max|e| + atol: fp32 tolerance relative to the tensor's magnitude (as tests/parity)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, \
        f"{what}: {actual.shape}/{actual.dtype} vs {expected.shape}/{expected.dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    if e.numel() == 0:
        return
    peak = e.abs().max().item()
    err = (a - e).abs().max().item()
    bound = rtol * peak + atol
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e} (max |expected| {peak:.3e})"


def canonical_name(name: str) -> str:
    """Parameter name without the wrappers' prefixes (torch.compile, checkpoint_wrapper)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {canonical_name(n): p.grad for n, p in model.named_parameters()}


def assert_grads_close(actual: nn.Module, expected: nn.Module, *, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every parameter's gradient within rtol of its own magnitude plus atol of the model's largest gradient
    (mHC base/scale gradients are sums with heavy cancellation, ~1e-4 of the largest; their rounding is relative
    to the terms, not to the small result)."""
    got, want = grads_by_name(actual), grads_by_name(expected)
    assert got.keys() == want.keys()
    missing = [n for n, g in want.items() if g is None]
    assert not missing, f"eager model left parameters without gradient: {missing}"
    scale = max(g.abs().max().item() for g in want.values())
    for name, g in want.items():
        assert got[name] is not None, f"{name}: no gradient in the compiled model"
        assert torch.isfinite(got[name]).all(), f"{name}: non-finite gradient"
        assert_close(got[name], g, f"grad {name}", rtol=rtol, atol=atol * scale)


def twin_models(seed: int = 0, args: Glm5ModelArgs | None = None,
                prepare: Callable[[Glm5Model], None] | None = None) -> tuple[Glm5Model, Glm5Model]:
    """(eager reference, copy with identical weights that `prepare` wraps/compiles in place)."""
    reference = build_model(seed, args)
    other = copy.deepcopy(reference)
    if prepare is not None:
        prepare(other)
    return reference, other
