"""The README's PyTorch and JAX examples, and its picture (docs/alignment.png).

    python examples/frameworks.py [--draw PATH]

Runs on CPU tensors and arrays (the NumPy backend) where there is no GPU; each framework
that is not installed is skipped, and says so.
"""

import argparse

import numpy as np

import moe_lora_align as mla


def torch_example():
    import torch

    device = "cuda" if torch.cuda.is_available() and mla.gpu_available() else "cpu"
    topk_ids = torch.randint(0, 64, (16, 4), dtype=torch.int32, device=device)
    base = mla.moe_align_block_size(topk_ids, block_size=16, num_experts=64)
    print(f"torch ({device}):", base.summary())
    # Under torch.compile(fullgraph=True) or a CUDA graph: the registered custom ops.
    import moe_lora_align.torch_ops  # noqa: F401

    step = torch.compile(lambda ids: torch.ops.moe_lora_align.moe_align_block_size(ids, 16, 64),
                         fullgraph=True, backend="aot_eager")
    sorted_ids, expert_ids, total = step(topk_ids)
    assert int(total[0]) == int(base.num_tokens_post_pad[0])


def jax_example():
    import jax
    import jax.numpy as jnp

    topk_ids = jax.random.randint(jax.random.PRNGKey(0), (16, 4), 0, 64, dtype=jnp.int32)
    mapping = jnp.array([0, 1, -1, 2] * 4, dtype=jnp.int32)
    lora = mla.moe_lora_align_block_size(topk_ids, mapping, 16, 64, max_loras=3)
    print("jax:", lora.summary())   # outside jax.jit: inside, it says to call it outside


def draw(path):
    import matplotlib

    matplotlib.use("Agg")
    from moe_lora_align import viz

    rng = np.random.default_rng(1)
    topk_ids = rng.integers(0, 8, size=(24, 2)).astype(np.int32)
    mapping = rng.integers(-1, 3, size=24).astype(np.int32)
    lora = mla.moe_lora_align_block_size(topk_ids, mapping, 4, 8, max_loras=3)
    ax = viz.draw(lora)
    ax.figure.savefig(path, dpi=110, bbox_inches="tight")
    print("drew", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draw", help="write the picture of a LoRA alignment here")
    args = ap.parse_args()
    for name, fn in (("torch", torch_example), ("jax", jax_example)):
        try:
            fn()
        except ImportError as e:
            print(f"{name}: not installed ({e.name}); skipped")
    if args.draw:
        draw(args.draw)


if __name__ == "__main__":
    main()
