"""Forward+backward time of every registered loss, against pytorch-metric-learning and LoOp's base losses.

    python bench/loss_speed.py [--batches 128 512] [--dim 512] [--threads 2] [--out bench/results/loss_speed]

For each loss and batch size B (d=512, float32, CPU): our milliseconds, the same loss from
pytorch-metric-learning (with its miner where the loss defines one) timed in the same run, and for each
LoOp loss its own base form (same code, sample-to-sample hard negatives instead of the closed-form
optimum). Each figure is the minimum over repeats (at least 3, more while under a time budget), after a
warm-up. Ratios < 1 mean we are faster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch
from lib.options import bench_parser, out_option, threads_option

from training.losses import LOSSES

Timed = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]


def pml_peers() -> dict[str, Callable[[], Timed]]:
    """pytorch-metric-learning's implementation of each loss it shares with us."""
    from pytorch_metric_learning import distances, losses, miners, reducers, regularizers

    def with_miner(loss: torch.nn.Module, miner: torch.nn.Module | None = None) -> Timed:
        def run(embeddings: torch.Tensor, labels: torch.Tensor, _: dict) -> torch.Tensor:
            pairs = miner(embeddings, labels) if miner is not None else None
            return loss(embeddings, labels, pairs)

        return run

    return {
        "contrastive": lambda: with_miner(losses.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0)),
        "triplet": lambda: with_miner(losses.TripletMarginLoss(margin=0.1)),
        "hphn-triplet": lambda: with_miner(
            losses.TripletMarginLoss(margin=0.2, reducer=reducers.MeanReducer()), miners.BatchHardMiner()
        ),
        "lifted": lambda: with_miner(losses.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)),
        "ms": lambda: with_miner(
            losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5),
            miners.MultiSimilarityMiner(epsilon=0.1),
        ),
        "npair": lambda: with_miner(
            losses.NPairsLoss(
                distance=distances.DotProductSimilarity(normalize_embeddings=False),
                embedding_regularizer=regularizers.LpRegularizer(),
            )
        ),
        "angular": lambda: with_miner(losses.AngularLoss(alpha=45)),
    }


def make_batch(name: str, batch_size: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A batch in the loss's registered layout, scaled to ``batch_size``."""
    layout = LOSSES[name].layout
    per_group = layout.samples_per_class
    groups = torch.arange(batch_size // per_group).repeat_interleave(per_group)
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.functional.normalize(torch.randn(len(groups), dim, generator=generator), dim=1)
    if layout.kind == "clusters_x_examples":
        return embeddings, groups // 2, {"cluster_ids": groups}  # two clusters per class
    return embeddings, groups, {}


def best_ms(run: Timed, embeddings: torch.Tensor, labels: torch.Tensor, info: dict, budget_s: float) -> float:
    def once() -> float:
        leaf = embeddings.clone().requires_grad_(True)
        started = time.perf_counter()
        run(leaf, labels, info).backward()
        return time.perf_counter() - started

    once()  # warm-up
    timings = [once()]
    while len(timings) < 3 or (sum(timings) < budget_s and len(timings) < 20):
        timings.append(once())
        if timings[0] > budget_s:  # a single call over budget: three are enough
            break
    return 1000 * min(timings)


def ours(name: str, **override: object) -> Timed:
    spec = LOSSES[name]
    loss = spec.factory(**{**spec.defaults, **spec.fixed, **override})
    return lambda embeddings, labels, info: loss(embeddings, labels, **info)


def main() -> None:
    parser = bench_parser(__doc__, threads_option(2), out_option(help="write OUT.md and OUT.json"))
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of repeats per measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    peers = pml_peers()
    rows = []
    for name in sorted(LOSSES):
        for batch_size in args.batches:
            embeddings, labels, info = make_batch(name, batch_size, args.dim, seed=batch_size)
            # Losses with learnable parts (PDDM) are sized to the embedding dimension.
            sized = {"embedding_dim": args.dim} if "embedding_dim" in LOSSES[name].defaults else {}
            row = {
                "loss": name,
                "batch": batch_size,
                "ours_ms": best_ms(ours(name, **sized), embeddings, labels, info, args.budget),
            }
            if name in peers:
                row["peer"] = "pml"
                row["peer_ms"] = best_ms(peers[name](), embeddings, labels, info, args.budget)
            elif LOSSES[name].fixed.get("hard_negatives") == "loop":
                row["peer"] = "base"
                base = ours(name, hard_negatives="endpoints", **sized)
                row["peer_ms"] = best_ms(base, embeddings, labels, info, args.budget)
            if "peer_ms" in row:
                row["ratio"] = row["ours_ms"] / row["peer_ms"]
            rows.append(row)
            peer = (
                f"{row.get('peer', '-'):>4} {row.get('peer_ms', float('nan')):10.2f} ms"
                if "peer" in row
                else ""
            )
            ratio = f"ratio {row['ratio']:.3f}" if "ratio" in row else ""
            print(f"{name:>18} B={batch_size:<4} ours {row['ours_ms']:9.2f} ms  {peer}  {ratio}", flush=True)

    lines = [
        f"Forward+backward ms, d={args.dim}, float32, CPU, {args.threads} threads, min over repeats. "
        "`ratio` = ours / peer (pml: pytorch-metric-learning 2.9.0; base: the LoOp loss's own base form).",
        "",
        "| loss | B | ours ms | peer | peer ms | ratio |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        peer_ms = f"{row['peer_ms']:.2f}" if "peer_ms" in row else "-"
        ratio = f"{row['ratio']:.3f}" if "ratio" in row else "-"
        peer = row.get("peer", "-")
        lines.append(
            f"| {row['loss']} | {row['batch']} | {row['ours_ms']:.2f} | {peer} | {peer_ms} | {ratio} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(table + "\n")
        args.out.with_suffix(".json").write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
