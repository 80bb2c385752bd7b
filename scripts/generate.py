"""Sample from a checkpoint: prefill the prompt, decode token by token, stream the text.

    python scripts/generate.py --checkpoint outputs/checkpoint --prompt "def main(" --max-new-tokens 64
    python scripts/generate.py --hf path/to/GLM-5.3-Flash --prompt "Hello" --temperature 0.7 --top-p 0.9
    python scripts/generate.py --hf DIR --prompt-ids 1,2,3 --max-new-tokens 8 --print-ids

--checkpoint: a trainer DCP checkpoint (a step-N folder, or the checkpoint folder: its newest complete step); the
model comes from its run.json, the tokenizer from the run's data.tokenizer. --hf: an HF checkpoint directory, with
its tokenizer.json if it has one. Without a tokenizer, give --prompt-ids. Temperature 0 (default) is greedy.
Generation stops at the tokenizer's eos (unless --ignore-eos) or after --max-new-tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchtitan_glm.components.checkpoint import hf_export_dir, list_hf_exports  # noqa: E402
from torchtitan_glm.generation import generate  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load(checkpoint: str | None, hf: str | None, *, dtype: torch.dtype, device: torch.device,
         tokenizer: str | None = None):
    """(model, tokenizer or None) from a DCP (--checkpoint) or HF (--hf) checkpoint; `tokenizer` overrides."""
    if checkpoint:
        from torchtitan_glm.models.glm5.dcp_io import from_dcp

        model, info = from_dcp(checkpoint, dtype=dtype, device=device)
        name = tokenizer or info.get("config", {}).get("data", {}).get("tokenizer")
    else:
        from torchtitan_glm.models.glm5 import from_pretrained

        model = from_pretrained(hf, dtype=dtype, device=device, keep_extra_tensors=False).eval()
        name = tokenizer or (hf if os.path.isfile(os.path.join(hf, "tokenizer.json")) else None)
    return model, (tokenizer_from(name) if name else None)


def tokenizer_from(name: str):
    """The tokenizer named 'byte' or by a tokenizer.json path (or the folder holding one)."""
    from torchtitan_glm.components.tokenizer import HFTokenizer, build_tokenizer
    from torchtitan_glm.config import DataConfig

    return build_tokenizer(cfg=DataConfig(tokenizer=name)) if name == "byte" else HFTokenizer(name)


def _hf_export_hint(checkpoint: str | None) -> str:
    """For a --checkpoint folder that holds only HF exports (checkpoint.last_save_model_only): '; try --hf <newest>'."""
    if not checkpoint or not os.path.isdir(checkpoint):
        return ""
    steps = list_hf_exports(checkpoint)
    return f"; it holds HF exports: try --hf {hf_export_dir(checkpoint, steps[-1])}" if steps else ""


def main(argv: list[str] | None = None) -> list[int]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="trainer DCP checkpoint: a step-N folder or the checkpoint folder")
    src.add_argument("--hf", help="HF checkpoint directory (config.json + safetensors)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer)")
    prompt.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer.json path (overrides the checkpoint's)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens tokens whatever comes")
    p.add_argument("--print-ids", action="store_true", help="print the prompt and generated token ids at the end")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32", choices=DTYPES)
    p.add_argument("--eos-id", type=int, default=None,
                   help="stop at this token id (default: the tokenizer's end-of-text, if it has one)")
    a = p.parse_args(argv)
    # checked before the model loads (generation.generate checks them too, but only after minutes on a big model)
    if a.max_new_tokens < 0:
        p.error(f"--max-new-tokens must be >= 0, got {a.max_new_tokens}")
    if not (a.temperature >= 0 and a.temperature != float("inf")):
        p.error(f"--temperature must be a finite number >= 0 (0 = greedy), got {a.temperature}")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: no CUDA device is visible")
    source = a.checkpoint or a.hf
    if not os.path.exists(source):
        p.error(f"{'--checkpoint' if a.checkpoint else '--hf'} {source} does not exist")
    if a.tokenizer not in (None, "byte") and not os.path.isfile(a.tokenizer):
        p.error(f"--tokenizer {a.tokenizer}: no such file (give 'byte' or a tokenizer.json path)")
    device = torch.device(a.device)
    try:
        model, tok = load(a.checkpoint, a.hf, dtype=DTYPES[a.dtype], device=device, tokenizer=a.tokenizer)
    except OSError as e:  # an unreadable or incomplete checkpoint folder, named by the loader
        p.error(f"cannot load {source}: {e}{_hf_export_hint(a.checkpoint)}")
    if a.prompt is not None:
        if tok is None:
            p.error("this checkpoint has no tokenizer: give --prompt-ids (or --tokenizer)")
        ids = tok.encode(a.prompt)
    else:
        try:
            ids = [int(x) for x in a.prompt_ids.split(",") if x.strip()]
        except ValueError:
            p.error(f"--prompt-ids must be comma-separated integers, got {a.prompt_ids!r}")
    if not ids:
        p.error("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < model.args.vocab_size]
    if bad:
        p.error(f"prompt ids {bad[:8]} are outside the model's vocabulary [0, {model.args.vocab_size})")
    if a.eos_id is not None and not 0 <= a.eos_id < model.args.vocab_size:
        p.error(f"--eos-id {a.eos_id} is outside the model's vocabulary [0, {model.args.vocab_size})")
    eos = None if a.ignore_eos else a.eos_id if a.eos_id is not None else tok.eos_id if tok is not None else None
    generated: list[int] = []
    shown = ""

    def stream(tokens: torch.Tensor) -> None:
        nonlocal shown
        generated.append(int(tokens[0]))
        if tok is not None:
            text = tok.decode(generated)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(shown):])
                sys.stdout.flush()
                shown = text

    if tok is not None:
        sys.stdout.write(a.prompt if a.prompt is not None else tok.decode(ids))
        sys.stdout.flush()
    gen = torch.Generator(device=device).manual_seed(a.seed)
    start = time.perf_counter()
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens=a.max_new_tokens,
                   temperature=a.temperature, top_p=a.top_p, eos_token_id=eos, generator=gen, on_step=stream)
    seconds = time.perf_counter() - start
    if tok is not None:
        sys.stdout.write(tok.decode(generated)[len(shown):] + "\n")
    new = out[0, len(ids):len(ids) + len(generated)].tolist()
    if a.print_ids:
        print("ids:", ",".join(str(i) for i in ids + new))
    print(f"[{len(new)} tokens in {seconds:.2f}s, {len(new) / max(seconds, 1e-9):.1f} tokens/s]", file=sys.stderr)
    return ids + new


if __name__ == "__main__":
    main()
