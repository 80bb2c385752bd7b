"""Actor vs rollout: do the training forward and incremental decode give the same log-probabilities?

    python scripts/rollout_agreement.py [--hf DIR | --checkpoint DIR | --flavor glm5_3_flash_proxy]
        [--precisions bf16,fp8_split,fp8_indexer] [--num-sequences 16 --prompt-len 512 --continuation-len 128]
        [--jsonl FILE] [--json OUT]

For each sequence (prompt + continuation) it computes the log-probability of every continuation token (a) with the
training forward (all sequences packed in one row, chunked KDA, all pools at once) and (b) as a serving engine
does: the prompts prefilled as one left-padded batch, then the continuation fed one token per decode step
(recurrent KDA, absorbed MLA over the latent cache, pooled indexer keys written when pools close). The first
continuation token's log-prob comes from the prefill, the others from decode steps.

Precisions (each applied to both paths unless said):
  fp32                  the model in FP32: the noise floor of the two computation orders
  bf16                  BF16 parameters and activations (FP32-kept modules stay FP32)
  fp8_split             BF16 + the trainer's FP8 split (experts and MLPs FP8, indexer / MLA / KDA BF16; --recipe)
  fp8_indexer           BF16; decode with serving's FP8 indexer (Hadamard + E4M3 query and cached pooled keys),
                        the training forward as the model was built (what an actor without the emulation sees)
  fp8_indexer_trained   BF16; both paths with the FP8 indexer (training with indexer_fp8_emulation)

JSON (--json): {"model", "device", "sequences", "prompt_tokens": [per sequence], "continuation_tokens",
"variants": {name: {"tokens", "pearson", "pearson_undefined", "mean_abs_diff", "max_abs_diff", "top1_agreement",
"indexer_overlap": [per DSA layer with an indexer], "decode_seconds"}}}. pearson/diffs are over the continuation
tokens' log-probs; pearson is null where undefined (fewer than 2 tokens, or constant), pearson_undefined says why;
top1_agreement is the fraction of those positions where both paths' argmax tokens agree; indexer_overlap is, per
DSA layer, the mean over decoded queries of |A & B| / |A| with A, B the tokens of the pools each path selected
(the query's own tail, identical by construction, left out).

Prompts: --jsonl (one {"prompt": text or ids, "continuation": text or ids} per line; text needs a tokenizer:
--tokenizer, else the --hf export's tokenizer.json or the --checkpoint run's data.tokenizer;
continuations of different lengths are cut to the shortest, since all rows decode together) or the
embedded corpus (this Python's standard library, byte tokenizer), where prompt i has --prompt-len - (i % 4) tokens
so prompts end at every offset within a pool.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_glm.components.logs import drop_benign_warnings  # noqa: E402

drop_benign_warnings()  # before torchao is imported (its import warns)
from torchtitan_glm.config import Float8Config  # noqa: E402
from torchtitan_glm.float8 import convert_float8  # noqa: E402
from torchtitan_glm.models.glm5 import Glm5Model, get_flavor  # noqa: E402
from torchtitan_glm.models.glm5.decode import decode_step, indexer_fp8, prefill, runs_indexer  # noqa: E402
from torchtitan_glm.models.glm5.dsa import SparseMLA  # noqa: E402
from torchtitan_glm.models.glm5.hf_io import _cast_for_load  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8_split", "fp8_indexer", "fp8_indexer_trained")
FIELDS = ("tokens", "pearson", "pearson_undefined", "mean_abs_diff", "max_abs_diff", "top1_agreement",
          "indexer_overlap", "decode_seconds")


# ----------------------------------------------------------------------------------------------- sequences
def corpus_sequences(n: int, prompt_len: int, continuation_len: int, seed: int = 0) -> list[tuple[list, list]]:
    """(prompt ids, continuation ids) from the embedded corpus through the byte tokenizer: n files (seeded choice),
    prompt i of prompt_len - (i % 4) tokens from a seeded offset, then continuation_len tokens."""
    from torchtitan_glm.components.data import builtin_corpus_files
    from torchtitan_glm.components.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    files = builtin_corpus_files()
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for path in files:
        if len(out) == n:
            break
        p = max(1, prompt_len - len(out) % 4)
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tok.encode(f.read())
        if len(ids) < p + continuation_len:
            continue
        start = rng.randrange(0, len(ids) - p - continuation_len + 1)
        out.append((ids[start:start + p], ids[start + p:start + p + continuation_len]))
    if len(out) < n:
        raise SystemExit(f"the embedded corpus has only {len(out)} files of >= {prompt_len + continuation_len} tokens")
    return out


def jsonl_sequences(path: str, tok) -> list[tuple[list, list]]:
    """(prompt ids, continuation ids) per line of a jsonl file (SystemExit naming the line on a bad one)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                parts = [rec["prompt"], rec["continuation"]]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{lineno}: expected {{\"prompt\": ..., \"continuation\": ...}} ({e})") from e
            ids = []
            for part in parts:
                if isinstance(part, str):
                    if tok is None:
                        raise SystemExit(f"{path}:{lineno}: text needs a tokenizer: the model source has none "
                                         "(no tokenizer.json / run data.tokenizer); give --tokenizer or token ids")
                    ids.append(tok.encode(part))
                else:
                    ids.append([int(i) for i in part])
            if not ids[0] or not ids[1]:
                raise SystemExit(f"{path}:{lineno}: prompt and continuation must both be non-empty")
            out.append((ids[0], ids[1]))
    if not out:
        raise SystemExit(f"{path} holds no sequences")
    return out


# ------------------------------------------------------------------------------------------------- two paths
@torch.no_grad()
def training_path(model: Glm5Model, seqs: list[tuple[list, list]], device: torch.device):
    """Training forward over the sequences packed in one row: (log-probs [N, C], argmax [N, C] of the positions
    predicting the continuation tokens, per indexer layer the selected pool tokens [N, C - 1, k*kpool] of the
    continuation queries that decode runs, in prompt positions)."""
    docs = [torch.tensor(p + c) for p, c in seqs]
    lengths = [len(d) for d in docs]
    starts = torch.tensor([0] + lengths).cumsum(0)
    tokens = torch.cat(docs).unsqueeze(0).to(device)
    captured = []
    hooks = [m.register_forward_hook(lambda mod, args, out: captured.append((mod, out[1])))
             for m in model.modules() if isinstance(m, SparseMLA) and m.indexer is not None and not m.dense]
    try:
        hidden = model.hidden_states(tokens, starts.to(device), with_mtp=False).hidden[0]
    finally:
        for h in hooks:
            h.remove()
    logps, top1, rows = [], [], []
    for (p, c), s in zip(seqs, starts.tolist()):
        q = torch.arange(s + len(p) - 1, s + len(p) + len(c) - 1, device=device)  # positions predicting c
        logits = model.lm_head(hidden[q]).float()
        lp = logits.log_softmax(-1)
        logps.append(lp.gather(-1, torch.tensor(c, device=device).unsqueeze(-1)).squeeze(-1))
        top1.append(logits.argmax(-1))
        rows.append((s, q[:-1] + 1))  # the decoded queries: positions p .. p + C - 2 of the sequence
    selected = []
    for mod, indices in captured:
        pools = _pool_part(indices[0], mod.indexer)
        selected.append([torch.where(pools[q] >= 0, pools[q] - s, -1) for s, q in rows])
    return torch.stack(logps), torch.stack(top1), selected


@torch.no_grad()
def decode_path(model: Glm5Model, seqs: list[tuple[list, list]], device: torch.device):
    """Prefill of the left-padded prompts, then one decode step per continuation token: (log-probs [N, C],
    argmax [N, C], per indexer layer the selected pool tokens [N, C - 1, k*kpool], seconds of the decode steps)."""
    width = max(len(p) for p, _ in seqs)
    cont = len(seqs[0][1])
    tokens = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, (p, _) in enumerate(seqs):
        tokens[b, width - len(p):] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p, _ in seqs], device=device)
    target = torch.tensor([c for _, c in seqs], device=device)  # [N, C]
    hidden, state = prefill(model, tokens.to(device), lengths=lengths, capacity=width + cont)
    logits = [model.lm_head(hidden[:, -1]).float()]
    steps: list[list[torch.Tensor]] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(cont - 1):
        sel: list[torch.Tensor] = []
        logits.append(model.lm_head(decode_step(model, target[:, i], state, selected=sel)).float())
        steps.append(sel)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    logits = torch.stack(logits, 1)  # [N, C, V]
    logp = logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    indexers = [m.self_attn.indexer for m in model.layers.values() if runs_indexer(m)]
    selected = [[_pool_part(torch.stack([s[j][b] for s in steps]), ix) for b in range(len(seqs))]
                for j, ix in enumerate(indexers)] if steps else [[] for _ in indexers]
    return logp, logits.argmax(-1), selected, seconds


def _pool_part(indices: torch.Tensor, indexer) -> torch.Tensor:
    """The selected pools' tokens of [..., K] indices (the query's tail, the same on both paths, dropped)."""
    tail = indexer.kpool - 1 if indexer.always_select_tail else 0
    return indices[..., : indices.shape[-1] - tail].long()


def _pearson(x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, str | None]:
    """(Pearson correlation, None), or (None, why) where it is undefined: fewer than 2 values or a constant side."""
    if x.numel() < 2:
        return None, f"{x.numel()} log-prob, needs >= 2"
    if bool(x.min() == x.max()) or bool(y.min() == y.max()):
        return None, "constant log-probs"
    xc, yc = x - x.mean(), y - y.mean()
    return float((xc * yc).sum() / ((xc * xc).sum() * (yc * yc).sum()).sqrt()), None


def compare(a, b) -> dict[str, object]:
    """Agreement of the decode path `b` with the training path `a` (module docstring)."""
    (lp_a, top_a, sel_a), (lp_b, top_b, sel_b, seconds) = a, b
    x, y = lp_a.flatten().double(), lp_b.flatten().double()
    pearson, why = _pearson(x, y)
    diff = (x - y).abs()
    overlaps = []
    for layer_a, layer_b in zip(sel_a, sel_b):
        hits = total = 0.0
        for ta, tb in zip(layer_a, layer_b):  # per sequence [C - 1, width]
            for qa, qb in zip(ta, tb):
                sa, sb = set(qa[qa >= 0].tolist()), set(qb[qb >= 0].tolist())
                if sa:
                    hits += len(sa & sb) / len(sa)
                    total += 1
        overlaps.append(hits / total if total else 1.0)
    return {"tokens": x.numel(), "pearson": pearson, "pearson_undefined": why, "mean_abs_diff": float(diff.mean()),
            "max_abs_diff": float(diff.max()), "top1_agreement": float((top_a == top_b).double().mean()),
            "indexer_overlap": overlaps, "decode_seconds": seconds}


# ------------------------------------------------------------------------------------------------------ main
def variant_model(base: Glm5Model, name: str, recipe: str) -> Glm5Model:
    """The model a precision runs (base is BF16)."""
    if name == "fp32":
        return copy.deepcopy(base).float()
    if name == "fp8_split":
        model = copy.deepcopy(base)
        convert_float8(model, cfg=Float8Config(enable=True, recipe=recipe, keep_bf16=["indexer", "mla", "kda"]))
        return model
    return base


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf", default=None, help="HF checkpoint directory")
    src.add_argument("--checkpoint", default=None, help="trainer DCP checkpoint (step-N folder or checkpoint folder)")
    p.add_argument("--flavor", default="glm5_3_flash_proxy", help="without a checkpoint: this flavor, seeded init")
    p.add_argument("--precisions", default="bf16,fp8_split,fp8_indexer")
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--num-sequences", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--continuation-len", type=int, default=128)
    p.add_argument("--jsonl", default=None, help="prompts and continuations (see the module docstring)")
    p.add_argument("--tokenizer", default=None,
                   help="'byte' or a tokenizer.json, for text in --jsonl (default: the checkpoint's, as generate.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = [n.strip() for n in a.precisions.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names:
        p.error(f"--precisions: unknown {unknown}; choose from {list(PRECISIONS)}")
    for flag, value in (("--num-sequences", a.num_sequences), ("--prompt-len", a.prompt_len),
                        ("--continuation-len", a.continuation_len)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if a.jsonl and not os.path.isfile(a.jsonl):
        p.error(f"--jsonl {a.jsonl}: no such file")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is visible (use --device cpu)")
    if a.tokenizer not in (None, "byte") and not os.path.exists(a.tokenizer):
        p.error(f"--tokenizer {a.tokenizer}: no such file (give 'byte' or a tokenizer.json path)")
    source = a.hf or a.checkpoint
    if source and not os.path.exists(source):
        p.error(f"{'--hf' if a.hf else '--checkpoint'} {source} does not exist")
    if not source:
        try:
            flavor = get_flavor(a.flavor).replace(num_nextn_predict_layers=0)
        except ValueError as e:
            p.error(f"--flavor: {e}")
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from generate import load, tokenizer_from  # the checkpoint's tokenizer as generate.py finds it

    if source:
        try:
            base, tok = load(a.checkpoint, a.hf, dtype=torch.bfloat16, device=device, tokenizer=a.tokenizer)
        except OSError as e:  # an unreadable or incomplete checkpoint folder, named by the loader
            p.error(f"cannot load {source}: {e}")
        label = source
    else:
        tok = tokenizer_from(a.tokenizer) if a.tokenizer else None
        with torch.device("meta"):
            base = Glm5Model(flavor)
        base.to_empty(device=device)
        base.init_weights()
        _cast_for_load(base, torch.bfloat16)
        label = a.flavor
    base.eval()
    if a.jsonl:
        seqs = jsonl_sequences(a.jsonl, tok)
        if not seqs or min(len(pr) for pr, _ in seqs) < 1 or min(len(c) for _, c in seqs) < 1:
            p.error(f"--jsonl {a.jsonl}: every line needs a non-empty prompt and continuation")
        if len({len(c) for _, c in seqs}) != 1:
            cut = min(len(c) for _, c in seqs)
            print(f"rollout_agreement: continuations cut to the shortest, {cut} tokens (all rows decode together)",
                  file=sys.stderr)
            seqs = [(pr, c[:cut]) for pr, c in seqs]  # one decode step per token, all rows together
    else:
        seqs = corpus_sequences(a.num_sequences, a.prompt_len, a.continuation_len, seed=a.seed)
    outside = [i for i, (pr, c) in enumerate(seqs) if not 0 <= min(pr + c) <= max(pr + c) < base.args.vocab_size]
    if outside:
        p.error(f"sequences {outside[:8]} hold token ids outside the model's vocabulary [0, {base.args.vocab_size})")
    result: dict[str, object] = {
        "model": label, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "sequences": len(seqs), "prompt_tokens": [len(pr) for pr, _ in seqs],
        "continuation_tokens": len(seqs[0][1]), "variants": {},
    }
    for name in names:
        model = variant_model(base, name, a.recipe)
        with indexer_fp8(model, True) if name == "fp8_indexer_trained" else nullcontext():
            train = training_path(model, seqs, device)
        with indexer_fp8(model, True) if name.startswith("fp8_indexer") else nullcontext():
            dec = decode_path(model, seqs, device)
        result["variants"][name] = compare(train, dec)
        if model is not base:
            del model
    print(f"rollout agreement (training forward vs incremental decode), {label}, {len(seqs)} sequences, "
          f"{result['continuation_tokens']} continuation tokens each, {result['device']}:")
    print(f"  {'precision':20s} {'pearson':>9s} {'mean|d|':>9s} {'max|d|':>9s} {'top-1':>7s}  "
          "indexer overlap per DSA layer")
    for name, r in result["variants"].items():
        overlap = ", ".join(f"{100 * o:.2f}%" for o in r["indexer_overlap"])
        pearson = f"{r['pearson']:9.6f}" if r["pearson"] is not None else f"{'n/a':>9s}"
        print(f"  {name:20s} {pearson} {r['mean_abs_diff']:9.2e} {r['max_abs_diff']:9.2e} "
              f"{100 * r['top1_agreement']:6.2f}%  {overlap}")
    for name, r in result["variants"].items():
        if r["pearson_undefined"]:
            print(f"  {name}: pearson n/a ({r['pearson_undefined']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
