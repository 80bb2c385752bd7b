"""How closely FP8-trained forwards agree with BF16: one set of weights, real text, three precisions.

    python scripts/precision_agreement.py [--flavor glm5_3_flash_proxy] [--hf DIR] [--seq-len 4096] [--json OUT]

(a) BF16; (b) the FP8 split (experts and MLPs FP8, indexer / MLA / KDA BF16, as serving runs them); (c) everything
FP8 (indexer, MLA and KDA projections too). For (b) and (c) against (a): Pearson correlation of the logits, top-1
agreement, mean KL(a || x) per token, and per DSA layer the overlap of the indexer's selected pools with (a)'s.
The same numbers for an FP32 forward against (a) give the noise floor BF16 itself sets (with random weights the
logits are near-uniform, so every perturbation shows; a trained checkpoint, --hf, gives the figures users see).
Runs on CUDA (the FP8 GEMMs); `--device cpu` runs the same on CPU (torch's CPU _scaled_mm), for small flavors.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import NoReturn

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_glm.components.logs import drop_benign_warnings  # noqa: E402

drop_benign_warnings()  # before torchao is imported (its import warns)
from torchtitan_glm.components.data import build_dataloader  # noqa: E402
from torchtitan_glm.components.tokenizer import build_tokenizer  # noqa: E402
from torchtitan_glm.config import DataConfig, Float8Config  # noqa: E402
from torchtitan_glm.float8 import convert_float8  # noqa: E402
from torchtitan_glm.models.glm5 import Glm5Model, from_pretrained, get_flavor  # noqa: E402
from torchtitan_glm.models.glm5.args import ModelArgsError  # noqa: E402
from torchtitan_glm.models.glm5.dsa import SparseMLA  # noqa: E402
from torchtitan_glm.models.glm5.hf_io import _cast_for_load  # noqa: E402

VARIANTS = {"fp8_split": ["indexer", "mla", "kda"], "fp8_all": []}


def corpus_batch(seq_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """One packed row of the embedded corpus (byte tokenizer), as the trainer would see it."""
    cfg = DataConfig()
    tok = build_tokenizer(cfg=cfg)
    if tok.vocab_size > vocab:
        raise SystemExit(f"the byte tokenizer needs vocab >= {tok.vocab_size}, the model has {vocab}")
    loader = build_dataloader(cfg=cfg, tokenizer=tok, seq_len=seq_len, local_batch_size=1, dp_rank=0,
                              dp_world_size=1, seed=0)
    return next(loader)


@torch.no_grad()
def run(model: Glm5Model, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list]:
    """(final hidden states [T, D], per DSA layer with an indexer the tokens of its selected pools [T, k * kpool]
    (-1 = none; the query's tail, the same in every variant, left out), the LM head weight) of one forward."""
    selected = []

    def keep(module, args, output) -> None:
        indices = output[1]
        tail = module.kpool - 1 if module.indexer.always_select_tail else 0
        selected.append(indices[..., : indices.shape[-1] - tail].flatten(0, 1).long())

    hooks = [m.register_forward_hook(keep) for m in model.modules()
             if isinstance(m, SparseMLA) and m.indexer is not None]
    try:
        out = model.hidden_states(batch["input_ids"].to(device), doc_ids=batch["doc_ids"].to(device), with_mtp=False)
    finally:
        for h in hooks:
            h.remove()
    return out.hidden.flatten(0, 1), selected, model.lm_head.weight


@torch.no_grad()
def compare(ref: tuple, other: tuple, *, chunk: int = 1024) -> dict[str, object]:
    """Logit agreement of `other` with `ref` (chunks of tokens through the LM heads in FP32, never all at once)."""
    (ha, sel_a, wa), (hb, sel_b, wb) = ref, other
    sums = torch.zeros(5, dtype=torch.float64, device=wa.device)  # x, y, xx, yy, xy
    n = top1 = 0
    kl = 0.0
    for s in range(0, ha.shape[0], chunk):
        la = ha[s:s + chunk].float() @ wa.float().t()
        lb = hb[s:s + chunk].float() @ wb.float().t()
        x, y = la.double().flatten(), lb.double().flatten()
        sums += torch.stack([x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])
        n += x.numel()
        top1 += int((la.argmax(-1) == lb.argmax(-1)).sum())
        pa = la.log_softmax(-1)
        kl += float((pa.exp() * (pa - lb.log_softmax(-1))).sum())
    sx, sy, sxx, syy, sxy = sums.tolist()
    cov, vx, vy = sxy - sx * sy / n, sxx - sx * sx / n, syy - sy * sy / n
    overlaps = []
    for a, b in zip(sel_a, sel_b):  # |A & B| / |A| per query, over queries that selected something
        bs = b.sort(-1).values
        hit = (bs.gather(-1, torch.searchsorted(bs, a).clamp(max=bs.shape[-1] - 1)) == a) & (a >= 0)
        count = (a >= 0).sum(-1)
        rows = count > 0
        overlaps.append(float((hit.sum(-1)[rows].float() / count[rows].float()).mean()))
    tokens = ha.shape[0]
    return {"pearson": cov / (vx * vy) ** 0.5, "top1_agreement": top1 / tokens, "mean_kl": kl / tokens,
            "indexer_topk_overlap": overlaps}


def _exit_2(flag: str, message: str) -> NoReturn:
    """One line naming the option on stderr, exit 2 (argparse's code for a bad argument)."""
    print(f"precision_agreement.py: error: {flag}: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_seq_len(model: Glm5Model, seq_len: int) -> None:
    """Exit 2 when a row is too short for the indexer to select anything: it selects whole pools of index_kpool
    tokens, and the first is complete at token index_kpool - 1, so shorter rows leave the overlap undefined (NaN)."""
    kpool = model.args.index_kpool
    if seq_len < kpool and any(isinstance(m, SparseMLA) and m.indexer is not None for m in model.modules()):
        _exit_2("--seq-len", f"{seq_len} tokens hold no complete pool of index_kpool = {kpool} tokens for the "
                f"indexer to select (its top-k overlap is undefined); use --seq-len >= {kpool}")


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="glm5_3_flash_proxy")
    p.add_argument("--hf", default=None, help="HF checkpoint directory (default: the flavor, seeded random init)")
    p.add_argument("--seq-len", type=int, default=4096,
                   help="tokens of the row, at least index_kpool; below index_topk + index_kpool every query "
                        "selects all of its complete pools, so the indexer overlap is 100%% by construction")
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--device", default=None, help="default: cuda; on a machine without one, say --device cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.device is None:
        if not torch.cuda.is_available():  # the proxy's forwards on CPU take many minutes: make it a choice
            p.error("no CUDA device: pass --device cpu (quick on CPU: --flavor debug --seq-len 256 --device cpu)")
        a.device = "cuda"
    device = torch.device(a.device)
    torch.manual_seed(0)
    if a.hf:
        base = from_pretrained(a.hf, dtype=torch.bfloat16, device=device)
        check_seq_len(base, a.seq_len)
    else:
        try:
            flavor_args = get_flavor(a.flavor)
        except ModelArgsError as e:
            _exit_2("--flavor", str(e))
        with torch.device("meta"):
            base = Glm5Model(flavor_args.replace(num_nextn_predict_layers=0))
        check_seq_len(base, a.seq_len)
        base.to_empty(device=device)
        base.init_weights()
        _cast_for_load(base, torch.bfloat16)
    base.eval()
    batch = corpus_batch(a.seq_len, base.args.vocab_size)
    ref = run(base, batch, device)
    result: dict[str, object] = {"flavor": a.hf or a.flavor, "seq_len": a.seq_len, "recipe": a.recipe,
                                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    model = copy.deepcopy(base).float()
    result["fp32"] = compare(ref, run(model, batch, device))
    del model
    for name, keep in VARIANTS.items():
        model = copy.deepcopy(base)
        convert_float8(model, cfg=Float8Config(enable=True, recipe=a.recipe, keep_bf16=keep))
        result[name] = compare(ref, run(model, batch, device))
        del model
    print(f"precision agreement vs BF16, {result['flavor']}, T={a.seq_len}, recipe={a.recipe}:")
    for name in ("fp32", *VARIANTS):
        r = result[name]
        overlap = ", ".join(f"{100 * o:.2f}%" for o in r["indexer_topk_overlap"])
        print(f"  {name:9s} pearson {r['pearson']:.6f} | top-1 {100 * r['top1_agreement']:.2f}% | "
              f"KL {r['mean_kl']:.3e} | indexer top-k overlap per DSA layer: {overlap}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
