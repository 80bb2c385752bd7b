"""Each decoder layer's output magnitude, eager against compiled, to find where a compiled-only numerical fault
starts. Builds the model from the same seed eager, then once per --backend (compiled), runs --steps training steps
on the benchmark's tokens (forward, then backward, gradients dropped: the weights never change), and prints per
step the loss, the largest per-token CE, and each layer's largest |output|, then the first (step, layer) where a
compiled run leaves the eager one by more than --rtol (BF16 compiled and eager differ by rounding only).

    python scripts/probe_layers.py --flavor glm5_3_flash_proxy --seq-len 16384          # STAGES=probe (gpu_checks.sh)
    python scripts/probe_layers.py --flavor debug --seq-len 64 --backend eager           # CPU, dynamo alone

Written for the compiled proxy at T = 16,384 on an H100, whose training-scope loss came out as 1.7e33 and 7.4e32
in two runs (NaN with recompute_modules kda) where eager gives 14.04 (docs/performance.md, twenty-seventh session).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
from torch import nn

from benchmark import make_inputs, model_args

from torchtitan_glm.activation_checkpoint import apply_activation_checkpointing
from torchtitan_glm.compile import apply_compile
from torchtitan_glm.components.loss import indexer_kl_loss
from torchtitan_glm.config import ActivationCheckpointConfig, ConfigError
from torchtitan_glm.models.glm5 import Glm5Model
from torchtitan_glm.models.glm5.args import FLAVORS
from torchtitan_glm.models.glm5.batch import train_batch


class _Probe(nn.Module):
    """Runs a (compiled) layer and records its output's largest magnitude outside the compiled region."""

    def __init__(self, inner: nn.Module, name: str, records: list) -> None:
        super().__init__()
        self.inner, self.name, self.records = inner, name, records
        self.shares_indices = getattr(inner, "shares_indices", False)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        x = out[0].detach().float()
        self.records.append((self.name, float(torch.nan_to_num(x, nan=math.inf).abs().max())))
        return out


def probe(*, flavor: str, seq_len: int, docs: int, ac: str, recompute: tuple[str, ...], backend: str | None,
          steps: int, indexer_kl: str, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """One record per step: loss, the largest per-token CE, and each layer's largest |output| in call order."""
    args = model_args(flavor, scope="train", tile_elements=1 << 28 if device.type == "cuda" else 1 << 26)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Glm5Model(args)
    model.to_empty(device=device)
    model.init_weights()
    model.to(dtype)
    apply_activation_checkpointing(model, mode=ac, recompute_modules=recompute)
    if backend is not None:
        apply_compile(model, backend=backend, components=["model", "loss"])
    records: list = []
    for name in list(model.layers.keys()):
        model.layers[name] = _Probe(model.layers[name], f"layer{name}", records)
    tokens, labels, doc_ids = make_inputs(vocab=args.vocab_size, seq_len=seq_len, batch=1, docs=docs, device=device)
    batch = train_batch(tokens, labels, None) if docs == 1 else train_batch(tokens, labels, doc_ids,
                                                                            host_doc_ids=doc_ids.cpu())
    n = int((labels != -100).sum())
    kl = None if indexer_kl == "none" else indexer_kl
    out_rows = []
    for _ in range(steps):
        records.clear()
        out = model(batch, token_scale=1.0 / n, mtp_scale=0.1 / n, indexer_kl=kl)
        loss = out.loss + indexer_kl_loss(out.indexer_stats) if kl else out.loss
        out_rows.append(dict(loss=float(out.loss), ce_max=float(out.ce.max()), layers=dict(records)))
        loss.backward()
        for p in model.parameters():
            p.grad = None
    del model
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out_rows


def first_divergence(ref: list[dict], other: list[dict], *, rtol: float) -> tuple[int, str] | None:
    """(step, what) of the first layer output, then loss, where `other` leaves `ref` by more than rtol."""
    def far(a: float, b: float) -> bool:
        return not math.isfinite(b) or abs(a - b) > rtol * max(abs(a), 1e-12)

    for step, (r, o) in enumerate(zip(ref, other)):
        for name, value in r["layers"].items():
            if far(value, o["layers"].get(name, math.nan)):
                return step, name
        for key in ("ce_max", "loss"):
            if far(r[key], o[key]):
                return step, key
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--ac", choices=["none", "full", "selective"], default="selective")
    p.add_argument("--recompute-modules", default="", help="comma-separated, with --ac selective")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backends, comma-separated, each compared with one eager run (e.g. "
                        "inductor,aot_eager: a fault in inductor alone is in its generated code)")
    p.add_argument("--indexer-kl", choices=["dense", "sparse", "none"], default="dense")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rtol", type=float, default=0.1,
                   help="a layer's max |output| may move this much by rounding alone: 5.2%% at the proxy's last "
                        "layer, compiled against eager, T = 16,384, H100 (docs/performance.md, twenty-eighth session)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default="")
    a = p.parse_args()
    recompute = tuple(m for m in a.recompute_modules.split(",") if m)
    try:
        ActivationCheckpointConfig(mode=a.ac, recompute_modules=list(recompute)).validate()
    except ConfigError as e:
        p.error(f"--ac / --recompute-modules: {e.message}")
    if a.flavor not in FLAVORS:
        p.error(f"--flavor {a.flavor!r} is unknown; choose one of {sorted(FLAVORS)}")
    if a.seq_len < 2 or a.steps < 1 or not 1 <= a.docs <= a.seq_len // 2:
        p.error("--seq-len >= 2, --steps >= 1 and 1 <= --docs <= seq_len / 2")
    if not torch.cuda.is_available() and a.flavor != "debug":
        print(f"probe_layers.py: flavor {a.flavor!r} needs a CUDA GPU; on CPU use --flavor debug", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    common = dict(flavor=a.flavor, seq_len=a.seq_len, docs=a.docs, ac=a.ac, recompute=recompute, steps=a.steps,
                  indexer_kl=a.indexer_kl, device=device, dtype=getattr(torch, a.dtype))
    backends = [b for b in a.backend.split(",") if b]
    runs = {"eager": probe(backend=None, **common)}
    for backend in backends:
        runs[f"compiled:{backend}"] = probe(backend=backend, **common)
    for mode, rows in runs.items():
        for step, r in enumerate(rows):
            layers = " ".join(f"{k}={v:.4g}" for k, v in r["layers"].items())
            print(f"{mode} step {step}: loss {r['loss']:.6g}, max CE {r['ce_max']:.4g}; max |out| {layers}", flush=True)
    where = {b: first_divergence(runs["eager"], runs[f"compiled:{b}"], rtol=a.rtol) for b in backends}
    for backend, w in where.items():
        print(f"compiled:{backend} follows eager within rtol" if w is None else
              f"compiled:{backend} leaves eager first at step {w[0]}, {w[1]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(runs=runs, first_divergence=where), f, indent=1)


if __name__ == "__main__":
    main()
