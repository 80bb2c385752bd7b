"""Full activation checkpointing of compiled blocks (the layers and the MTP layer) keeps only each block's inputs
across the forward, as eager full AC does, with eager's gradients. torch 2.11 does not tag the ops inside
autograd.Functions of a plain checkpoint traced into the graph, and the partitioner then saved their outputs
(activation_checkpoint.for_compile); this test fails that way on torch 2.11 without for_compile."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tests.saved import saved_for_backward
from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile

from .builders import build_model, make_batch, train_forward, training_loss


class _Saved(nn.Module):
    """Calls a layer and records what it keeps for backward besides parameters and buffers: (shape, dtype, is one of
    the layer's inputs) per tensor."""

    def __init__(self, layer: nn.Module, owned: set[int], log: list) -> None:
        super().__init__()
        self.layer, self.owned, self.log = layer, owned, log
        self.shares_indices = getattr(layer, "shares_indices", False)

    def forward(self, *args, **kwargs):
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        with saved_for_backward() as held:
            out = self.layer(*args, **kwargs)
        for t in held:  # the (0,) tensor is the checkpoint's own placeholder
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.owned and t.numel():
                self.log.append((tuple(t.shape), t.dtype, ptr in inputs))
        return out


def _name(fqn: str) -> str:
    return ".".join(p for p in fqn.split(".") if p not in ("_checkpoint_wrapped_module", "layer", "_orig_mod"))


@pytest.mark.parametrize("moe_chunk_tokens", [0, 16])
def test_compiled_full_ac_blocks_keep_only_their_inputs(moe_chunk_tokens):
    model = build_model(0)
    apply_activation_checkpointing(model, mode="full", moe_chunk_tokens=moe_chunk_tokens)
    apply_compile(model, backend="aot_eager_decomp_partition", components=["model"])
    owned = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    logs = {name: [] for name in list(model.layers) + ["mtp"]}
    for name in model.layers:
        model.layers[name] = _Saved(model.layers[name], owned, logs[name])
    model.mtp = _Saved(model.mtp, owned, logs["mtp"])
    batch = make_batch(0, model.args.vocab_size, bsz=1, seqlen=64)
    training_loss(train_forward(model, batch, token_scale=1e-3, mtp_scale=1e-4)).backward()
    eager = build_model(0)
    apply_activation_checkpointing(eager, mode="full", moe_chunk_tokens=moe_chunk_tokens)
    training_loss(train_forward(eager, batch, token_scale=1e-3, mtp_scale=1e-4)).backward()
    grads = {_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {_name(n): p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert grads.keys() == want.keys()
    for key, g in grads.items():  # the blocks run the same math compiled: 1e-4 of each gradient's scale
        scale = float(want[key].abs().max())
        torch.testing.assert_close(g, want[key], rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{key}: {m}")
    for name, log in logs.items():
        assert log, f"layer {name} saved nothing: the hooks did not see the block"
        kept = [(shape, dtype) for shape, dtype, is_input in log if not is_input]
        assert not kept, f"layer {name} keeps tensors that are not its inputs for backward: {kept}"
