"""What a model block keeps for its backward, eagerly and compiled: the tensors autograd saves (read with saved-tensor
hooks), counted by shape and dtype. Compiled, AOTAutograd's partitioner decides what is saved, and its choice can
differ by torch version and device (docs/performance.md, eighteenth session); this shows it on the machine at hand.

    python scripts/saved_activations.py --seq-len 4096            # the proxy's KDA block, BF16, on CUDA if present
"""

from __future__ import annotations

import argparse
import collections

import torch

from torchtitan_glm.models.glm5 import get_flavor
from torchtitan_glm.models.glm5.args import FLAVORS
from torchtitan_glm.models.glm5.batch import BatchLayout
from torchtitan_glm.models.glm5.dsa import DocLayout
from torchtitan_glm.models.glm5.kda import KimiDeltaAttention
from torchtitan_glm.models.glm5.seqinfo import doc_positions


def saved_by_shape(fn, *inputs) -> tuple[int, collections.Counter]:
    """(bytes, Counter of (shape, dtype)) of what one forward of fn saves for backward; runs the backward too."""
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        out = fn(*inputs)
    total = sum(t.numel() * t.element_size() for t in held)
    counts = collections.Counter((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in held)
    out.float().square().mean().backward()
    return total, counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="glm5_3_flash_proxy", choices=sorted(FLAVORS))
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--min-mib", type=float, default=16.0, help="list tensors of at least this size")
    a = p.parse_args()
    if a.seq_len < 1:
        p.error(f"--seq-len must be >= 1, got {a.seq_len}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = get_flavor(a.flavor)
    torch.manual_seed(0)
    with torch.device(device):
        block = KimiDeltaAttention(args)
        block.init_weights()
    block.to(torch.bfloat16)
    x = torch.randn(1, a.seq_len, args.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    batch = BatchLayout(DocLayout(*doc_positions(None, 1, a.seq_len, device)), None)
    print(f"KDA block of {a.flavor}, T = {a.seq_len:,}, BF16, {device.type}, torch {torch.__version__}")
    for name, fn in (("eager", block), ("compiled", torch.compile(block, fullgraph=True))):
        total, counts = saved_by_shape(fn, x, batch)
        big = {k: n for k, n in counts.items()
               if n and torch.Size(k[0]).numel() * torch.empty(0, dtype=getattr(torch, k[1])).element_size()
               >= a.min_mib * 2**20}
        print(f"{name}: {total / 2**20:,.0f} MiB saved; of at least {a.min_mib:g} MiB, by (shape, dtype): "
              + ", ".join(f"{n} x {list(shape)} {dtype}" for (shape, dtype), n in sorted(big.items())))


if __name__ == "__main__":
    main()
