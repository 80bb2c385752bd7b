"""Training with per-block compile: new document boundaries, moving routers and new loss scales reuse the graphs
compiled in step 1 (one per block kind), and the graph count does not grow with depth."""

from __future__ import annotations

import pytest

import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend
from torch._dynamo.utils import counters

from torchtitan_glm.compile import apply_compile
from torchtitan_glm.components.loss import update_router_bias

from .builders import BATCH, SEQLEN, build_model, debug_args, make_batch, train_forward, training_loss


def block_kinds(args) -> int:
    """Distinct compiled graphs the model needs: one per (attention, mlp) layer kind, the MTP layer, the LM head."""
    return len(set(zip(args.layer_types, args.mlp_layer_types))) + (args.num_nextn_predict_layers == 1) + 1


def _step(model, optimizer, step: int, token_scale, mtp_scale):
    batch = make_batch(step, model.args.vocab_size)
    out = train_forward(model, batch, token_scale=token_scale, mtp_scale=mtp_scale)
    training_loss(out).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_router_bias(model, [s.counts for s in out.moe_stats], rate=0.05)
    return batch, out


def test_five_steps_compile_once():
    model = build_model(seed=0)
    counter = CompileCounterWithBackend("aot_eager")
    apply_compile(model, backend=counter, components=["model", "loss"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    n_tokens = BATCH * SEQLEN
    # Loss scales as the trainer passes them (0-dim tensors) and as plain Python floats: neither may recompile.
    scales = [(torch.tensor(1.0 / n_tokens), torch.tensor(0.1 / n_tokens)), (1.0 / n_tokens, 0.1 / n_tokens),
              (torch.tensor(2.0 / n_tokens), 0.3 / n_tokens), (0.5 / n_tokens, torch.tensor(0.2 / n_tokens)),
              (torch.tensor(0.7), torch.tensor(0.05))]
    router_weights = [m.gate.weight.detach().clone() for m in _moes(model)]

    batch, out = _step(model, optimizer, 0, *scales[0])
    frames = counter.frame_count
    assert frames == block_kinds(model.args) == 5, (
        f"step 1 compiled {frames} graphs; expected one per block kind (KDA+dense, KDA+MoE shared by layers 1-2, "
        f"DSA+MoE, MTP, LM head)")
    doc_ids, routing, losses = [batch.doc_ids], [_routing(out)], [out.loss.item()]
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in range(1, 5):
            batch, out = _step(model, optimizer, step, *scales[step])
            doc_ids.append(batch.doc_ids)
            routing.append(_routing(out))
            losses.append(out.loss.item())
    assert counter.frame_count == frames, f"recompiled: {frames} graphs after step 1, {counter.frame_count} after 5"
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # The steps really differed in the data-dependent parts.
    assert all(not torch.equal(doc_ids[0], d) for d in doc_ids[1:]), "document boundaries did not change"
    assert len(set(routing)) == len(routing), "expert loads did not change between steps"
    moved = [not torch.equal(w, m.gate.weight) for w, m in zip(router_weights, _moes(model))]
    assert all(moved), "router weights did not move"


def _moes(model):
    return [m for m in model.modules() if type(m).__name__ == "MoE"]


def _routing(out) -> tuple:
    return tuple(tuple(s.counts.tolist()) for s in out.moe_stats)


def test_graph_count_independent_of_depth():
    """GLM-5.3-Flash's layer pattern (3 dense layers, DSA every 4th) at 12 layers needs one graph per layer kind,
    far below Dynamo's recompile limit, so no layer silently falls back to eager however deep the model is."""
    args = debug_args(num_hidden_layers=12, layer_types=None, mlp_layer_types=None, indexer_types=None,
                      first_k_dense_replace=3)
    model = build_model(seed=0, args=args)
    counter = CompileCounter()  # plain eager backend: only Dynamo's capture matters here
    apply_compile(model, backend=counter, components=["model", "loss"])
    batch = make_batch(0, args.vocab_size)
    out = train_forward(model, batch, token_scale=1.0, mtp_scale=0.1)
    out.loss.backward()
    kinds = block_kinds(args)
    assert kinds == 5
    assert counter.frame_count == kinds, f"{counter.frame_count} graphs for {kinds} block kinds"
    assert counter.frame_count < torch._dynamo.config.recompile_limit
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("document_masking", ["true", "false"])
@pytest.mark.long
def test_accumulating_trainer_steps_compile_once(tmp_path, world_of_one, document_masking):
    """The trainer under FSDP2 with two microbatches per step (training.global_batch_size; FSDP2's deferred reduce
    and held gathers switch between microbatches, outside the compiled blocks): steps 2-3 reuse step 1's graphs,
    with no graph break. Also with data.document_masking = false, where the batches carry no document ids (the
    unmasked kernels: plain causal attention, KDA without varlen boundaries)."""
    from torchtitan_glm.config import load_config
    from torchtitan_glm.train import Trainer

    counters.clear()
    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.seq_len", "64",
                       "--training.local_batch_size", "1", "--training.global_batch_size", "2",
                       "--parallelism.fsdp_reshard_after_forward", "never", "--training.steps", "3",
                       "--compile.enable", "true", "--compile.backend", "aot_eager", "--checkpoint.enable", "false",
                       "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "1",
                       "--data.document_masking", document_masking, f"--job.dump_folder={tmp_path}"])
    trainer = Trainer(cfg)
    assert trainer.accumulation.steps == 2 and trainer.accumulation.hold_gathered
    trainer.step = 1
    batches, documents = trainer.next_batches()
    assert all((trainer._device_batch(b).doc_ids is None) == (document_masking == "false") for b in batches)
    trainer.train_step(batches, documents)
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0
    with torch.compiler.set_stance("fail_on_recompile"):
        for step in (2, 3):
            trainer.step = step
            trainer.train_step(*trainer.next_batches())
    assert counters["stats"]["unique_graphs"] == compiled
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in trainer.stats.resolve(3))
