"""What draft trees would give an EAGLE-3 head, without running one: the rank of the target's
greedy token among the head's drafts, depth by depth, along the target's own answers.

    .venv/bin/python bench/head_trees.py --target SMOLLM2_GGUF --head build/smollm2-head \
        --answers build/.smollm2-draft.distill/heldout-b8ee191a64ab

At every answer position the head drafts a chain from the target's features (teacher forced: the
chain reads the target's tokens, which is what a tree's accepted path reads). A static tree is a
set of rank paths (the root's best child is (0,), its second (1,), the best child of that (1, 0)
...); a round keeps the longest prefix of the position's true ranks that is a node. The best tree
of N nodes takes the N paths the answers follow most often (a path is never more frequent than
its parent), so its tokens a round are an upper bound for a static tree of that size on these
answers, and the chain of K is the tree (0,), (0, 0), ... A verification of N + 1 positions
costs what `bench/engine_step.py` measures for that many (docs/performance.md).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import numpy as np

DEPTH = 6  # chained drafts per position
WORST_RANK = 8  # ranks from here on count as "not proposed"
SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def ranks(target, head, examples) -> np.ndarray:
    """``[positions, DEPTH]``: the rank of the target's token among the head's logits at each
    chained depth (`WORST_RANK` where it is worse or outside the head's vocabulary)."""
    import torch

    from specrt.distill.eagle import chained

    index = torch.full((len(head.t2d),), -1, dtype=torch.long)
    index[head.t2d] = torch.arange(int(head.t2d.sum()))
    found = []
    with torch.no_grad():
        for example in examples:
            tokens, chain = chained(head, target, example, DEPTH)
            # the first answer token comes from the prompt's pass: rounds start after it
            bases = torch.arange(len(example.prompt) - 1, len(tokens) - 2)
            table = np.full((len(bases), DEPTH), WORST_RANK, dtype=np.int64)
            for depth, hidden in enumerate(chain):
                inside = bases + depth + 2 < len(tokens)
                base = bases[inside]
                truth = index[torch.from_numpy(tokens)[base + depth + 2]]
                logits = head.logits(hidden[0, base])  # [n, head vocab]
                known = truth >= 0
                true_logit = logits.gather(1, truth.clamp(0)[:, None])
                rank = (logits > true_logit).sum(1).numpy()
                column = np.where(known.numpy(), np.minimum(rank, WORST_RANK), WORST_RANK)
                table[inside.numpy(), depth] = column
            found.append(table)
    return np.concatenate(found)


def path_shares(table: np.ndarray) -> dict[tuple[int, ...], float]:
    """Each rank path's share of the positions whose true ranks begin with it."""
    counts: collections.Counter = collections.Counter()
    for row in table:
        for depth in range(DEPTH):
            if row[depth] >= WORST_RANK:
                break
            counts[tuple(int(r) for r in row[: depth + 1])] += 1
    return {path: count / len(table) for path, count in counts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target: HF folder or GGUF file")
    parser.add_argument("--head", required=True, help="the head, in its authors' layout")
    parser.add_argument("--answers", required=True, help="a folder of the target's answers")
    args = parser.parse_args()

    from specrt.distill import _load_target, data
    from specrt.export.eagle import Eagle3Head, read_head

    with tempfile.TemporaryDirectory() as scratch:  # a GGUF file is read into a folder there
        target, _, _ = _load_target(Path(args.target), Path(scratch) / "out", lambda m: None)
    target.eval()
    checkpoint = read_head(Path(args.head), target.config)
    embedding = target.get_input_embeddings().weight.detach()
    head = Eagle3Head.from_checkpoint(checkpoint, embedding)
    examples = [data.load(path) for path in sorted(Path(args.answers).glob("*.npz"))]
    table = ranks(target, head, examples)
    shares = path_shares(table)
    print(f"{len(examples)} answers, {len(table)} positions")
    for depth in range(DEPTH):
        within = [float(np.mean(table[:, depth] < k)) for k in (1, 2, 3, 4, 8)]
        print(f"depth {depth + 1}: target's token within the head's top 1/2/3/4/8: "
              + ", ".join(f"{share:.3f}" for share in within))  # fmt: skip
    for k in range(1, DEPTH + 1):
        chain = 1 + sum(shares.get((0,) * d, 0.0) for d in range(1, k + 1))
        print(f"chain of {k}: {chain:.3f} tokens a round")
    best = sorted(shares, key=lambda path: (-shares[path], len(path), path))
    for size in SIZES:
        nodes = best[:size]
        tokens = 1 + sum(shares[node] for node in nodes)
        depth = max(len(node) for node in nodes)
        print(f"best tree of {size} nodes (depth {depth}): {tokens:.3f} tokens a round")


if __name__ == "__main__":
    main()
