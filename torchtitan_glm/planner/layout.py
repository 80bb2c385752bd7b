"""Parallel layouts (dp_replicate, dp_shard, tp, ep, cp): their `[parallelism]` keys, the one function that asks the
trainer whether it accepts a layout, and the enumeration of candidate layouts for N GPUs.

Every layout the planner plans goes through `trainer_verdict`, which runs the trainer's own config loading and
layout check on the layout's keys, so a rejected layout carries exactly the trainer's message.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

from torchtitan_glm.config import ConfigError, load_config

# Layout field -> TorchTitan's [parallelism] key, and the key's default (a default is not passed to the trainer).
PARALLELISM_KEYS = {
    "dp_replicate": ("data_parallel_replicate_degree", 1),
    "dp_shard": ("data_parallel_shard_degree", -1),
    "tp": ("tensor_parallel_degree", 1),
    "cp": ("context_parallel_degree", 1),
    "ep": ("expert_parallel_degree", 1),
}
# The data section is irrelevant to a plan; its files need not exist on the machine that plans.
NEUTRAL_DATA = ("--data.source=builtin", "--data.paths=", "--data.tokenizer=byte")


@dataclass(frozen=True)
class Layout:
    """Degrees of one layout (TorchTitan's mesh: dp_replicate x dp_shard x cp x tp = GPUs; ep borrows its ranks from
    dp_shard x cp). Always resolved: dp_shard is a degree, never -1."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1
    # parallelism.expert_fsdp: under EP the routed experts' rows sharded over the ranks that hold the same experts
    # (gathered and reduce-scattered inside their op), instead of kept whole with their gradients all-reduced.
    expert_fsdp: bool = True

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Distinct batches per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """FSDP2 shard degree of everything but the routed experts (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def reduce_deferred(self) -> bool:
        """Whether gradient accumulation reduces FSDP2's gradients once per step (distributed/grad_accumulation.py):
        no parameter split over ranks."""
        return self.dp_shard * self.cp == 1 and self.tp == 1 and self.ep == 1

    @property
    def edp(self) -> int:
        """The dp_shard x cp ranks of one replica that hold the same experts."""
        return self.fsdp // self.ep

    @property
    def expert_shards(self) -> int:
        """What the routed experts' rows are sharded over under EP: every rank holding the same experts
        (dp_replicate x edp, parallelize.py's expert_fsdp), or 1 without expert_fsdp."""
        return self.dp_replicate * self.edp if self.expert_fsdp and self.ep > 1 else 1

    @property
    def experts_sharded(self) -> bool:
        """Whether parallelize.py shards the routed experts' rows (EP, expert_fsdp, and more than one holder)."""
        return self.expert_shards > 1

    def parallelism_overrides(self, *, explicit_shard: bool = True) -> list[str]:
        """`--parallelism.key=value` arguments for train.py, every key (a key left out would take the config's
        value, not the default); dp_shard as -1 unless `explicit_shard`."""
        out = []
        for field, (key, _) in PARALLELISM_KEYS.items():
            value = getattr(self, field)
            if field == "dp_shard" and not explicit_shard:
                value = -1
            out.append(f"--parallelism.{key}={value}")
        return out + [f"--parallelism.expert_fsdp={str(self.expert_fsdp).lower()}"]

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} tp={self.tp} ep={self.ep} "
                f"cp={self.cp}" + (" (expert_fsdp off)" if self.ep > 1 and not self.expert_fsdp else ""))

    def as_dict(self) -> dict[str, int | bool]:
        return {**{f: getattr(self, f) for f in PARALLELISM_KEYS}, "expert_fsdp": self.expert_fsdp}


@dataclass(frozen=True)
class Verdict:
    """What the trainer says about a layout: accepted, or the error it raises (its message verbatim)."""

    accepted: bool
    error: Exception | None = None

    @property
    def message(self) -> str | None:
        return None if self.error is None else str(self.error)


def split_layout_args(argv: list[str]) -> tuple[dict[str, int], list[str]]:
    """Pull `--parallelism.<TorchTitan key> value` out of train.py-style arguments: ({layout field: value}, rest).

    Lets the planner read layout keys the trainer does not know yet (they are put back by `trainer_verdict`)."""
    by_key = {key: field for field, (key, _) in PARALLELISM_KEYS.items()}
    fields: dict[str, int] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        section, _, key = name.partition(".")
        if section == "parallelism" and key in by_key:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, "needs a value (integer)")
                value, i = argv[i + 1], i + 1
            try:
                fields[by_key[key]] = int(value)
            except ValueError:
                raise ConfigError(name, f"expected integer, got {value!r}", f"command line --{name}") from None
        else:
            rest.append(arg)
        i += 1
    return fields, rest


def resolve_layout(fields: dict[str, int], *, gpus: int, config=None) -> Layout:
    """A Layout from given degrees, else the config's [parallelism] (`config`), else the defaults; dp_shard = -1
    takes the rest of the GPUs. A product that does not divide is left for the trainer's validation to reject
    (dp_shard = 0 then)."""
    def degree(field: str) -> int:
        key, default = PARALLELISM_KEYS[field]
        return fields.get(field, getattr(config, key, default))

    rep, tp, cp, ep = (degree(k) for k in ("dp_replicate", "tp", "cp", "ep"))
    shard = degree("dp_shard")
    if shard == -1:
        others = rep * tp * cp
        shard = gpus // others if others > 0 and gpus % others == 0 else 0
    return Layout(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, cp=cp,
                  expert_fsdp=bool(fields.get("expert_fsdp", getattr(config, "expert_fsdp", True))))


@contextlib.contextmanager
def _world_size(gpus: int) -> Iterator[None]:
    """WORLD_SIZE as torchrun would export it for `gpus` ranks, restored afterwards (train.check_layout reads it)."""
    before = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(gpus)
    try:
        yield
    finally:
        if before is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = before


def trainer_verdict(argv: list[str], layout: Layout, *, gpus: int, explicit_shard: bool = True) -> Verdict:
    """The trainer's answer for `layout` on `gpus` ranks: its config loading (`load_config`, ConfigError naming the
    key) and `train.check_layout` (ParallelDims against the world size, the model-dependent rules, what the trainer
    does not run yet), on the layout's `[parallelism]` keys: the one place that calls the trainer's validation.
    check_layout reads the world size from WORLD_SIZE, set here for the call (a `world_size=` argument would do)."""
    from torchtitan_glm.train import check_layout

    try:
        cfg = load_config([*argv, *NEUTRAL_DATA, *layout.parallelism_overrides(explicit_shard=explicit_shard)])
        with _world_size(gpus):
            check_layout(cfg)
    except (ConfigError, ValueError) as e:
        return Verdict(False, e)
    return Verdict(True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def describable(layout: Layout, *, args, seq_len: int, gpus_per_node: int) -> str | None:
    """Why the cost model cannot describe `layout`, or None: tp within a node and dividing every head count and MLP
    width it splits; ep dividing the routed experts and dp_shard x cp; seq_len divisible by 2 x cp x index_kpool
    (zigzag chunks of whole pools). These are the planner's preconditions; whether the trainer accepts a layout is
    `trainer_verdict`'s answer (it also wants ep a multiple of cp, which the cost model does not need: --what-if
    plans such a layout, with the trainer's message)."""
    tp, cp, ep = layout.tp, layout.cp, layout.ep
    if tp > gpus_per_node:
        return f"tp={tp} spans more than one node of {gpus_per_node} GPUs"
    for name in ("linear_num_heads", "num_attention_heads", "intermediate_size", "moe_intermediate_size"):
        if getattr(args, name) % tp:
            return f"tp={tp} does not divide {name}={getattr(args, name)}"
    if cp > 1 and seq_len % (2 * cp * args.index_kpool):
        return f"seq_len={seq_len} is not divisible by 2 x cp x index_kpool = {2 * cp * args.index_kpool}"
    if args.n_routed_experts % ep:
        return f"ep={ep} does not divide n_routed_experts={args.n_routed_experts}"
    if ep > 1 and (layout.dp_shard * cp) % ep:
        return f"ep={ep} must divide dp_shard x cp = {layout.dp_shard * cp}"
    return None


def candidate_layouts(gpus: int, *, args, seq_len: int, gpus_per_node: int) -> list[Layout]:
    """Every layout of `gpus` GPUs that `describable` accepts."""
    out = []
    for tp in _divisors(gpus):
        for cp in _divisors(gpus // tp):
            for rep in _divisors(gpus // (tp * cp)):
                shard = gpus // (tp * cp * rep)
                for ep in _divisors(shard * cp):
                    layout = Layout(dp_replicate=rep, dp_shard=shard, tp=tp, ep=ep, cp=cp)
                    if describable(layout, args=args, seq_len=seq_len, gpus_per_node=gpus_per_node) is None:
                        out.append(layout)
    return out
