"""What the compiled training step keeps for its backward, tensor by tensor, on the CPU (no GPU needed).

The step is traced and partitioned as Inductor's partitioner decides (`dflash.memory.kept_by_training_step`), at a
scaled-down drafter shape, under bf16 autocast, with eager attention (flex attention has no CPU backward, so the
attention's part differs from the GPU's; the rest is the GPU step's). Lists the largest kept tensors and the totals
for each architecture, beside the memory plan's count of DFlash2's own part. Used to find what a new part keeps:

    python bench/kept.py [--hidden 256 --vocab 8192 --tokens 1024 --anchors 64 --budget 1.0 --top 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash.config import DrafterConfig  # noqa: E402
from dflash.drafter import drafter_class  # noqa: E402
from dflash.memory import kept_by_training_step, size  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=1024, help="T")
    ap.add_argument("--anchors", type=int, default=64, help="A")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--budget", type=float, default=1.0, help="the activation memory budget")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    H, V, T, A = args.hidden, args.vocab, args.tokens, args.anchors
    base = DrafterConfig(num_layers=args.layers, hidden_size=H, intermediate_size=3 * H, num_attention_heads=H // 32,
                         num_key_value_heads=max(1, H // 128), head_dim=32, block_size=16, target_layer_ids=[1, 2, 3],
                         mask_token_id=V - 1, vocab_size=V, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=T + 16, selector_rank=32, selector_top_k=16, conv_group_size=16)
    totals = {}
    for arch in ("dflash", "dflash2"):
        kept = kept_by_training_step(dataclasses.replace(base, arch=arch), T, A, args.budget)
        own = [k for k in kept if not k.is_input]
        totals[arch] = sum(k.nbytes for k in own)
        print(f"\n{arch}: {len(kept)} tensors kept, {size(totals[arch])} of its own "
              f"(+ {size(sum(k.nbytes for k in kept if k.is_input))} of inputs kept as they are)")
        for k in sorted(own, key=lambda k: -k.nbytes)[: args.top]:
            print(f"  {size(k.nbytes):>8}  {str(k.dtype).removeprefix('torch.'):9} {str(k.shape):24} {k.name}")
    d2 = dataclasses.replace(base, arch="dflash2")
    print(f"\nDFlash2 keeps {size(totals['dflash2'] - totals['dflash'])} beyond DFlash (with its weights' bf16 "
          f"copies); the plan counts {size(drafter_class(d2).own_activations(d2, A, 'none'))} of activations")


if __name__ == "__main__":
    main()
