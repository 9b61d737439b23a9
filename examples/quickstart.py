"""Align a small realistic batch: 64 tokens, 128 experts, top-8 routing, 4 LoRA adapters.

Runs on the GPU when CuPy sees one, else on the NumPy backend, and says which ran.
"""

import numpy as np

import moe_lora_align as mla

TOKENS, EXPERTS, TOPK, BLOCK, LORAS = 64, 128, 8, 16, 4


def main():
    rng = np.random.default_rng(0)
    # Each token picks 8 distinct experts; a quarter of the tokens use no adapter (-1).
    topk_ids = np.argsort(rng.random((TOKENS, EXPERTS)), axis=1)[:, :TOPK].astype(np.int32)
    mapping = rng.integers(LORAS, size=TOKENS).astype(np.int32)
    mapping[rng.random(TOKENS) < 0.25] = -1
    used = np.unique(mapping[mapping >= 0])
    lora_ids = np.full(LORAS + 1, -1, np.int32)
    lora_ids[1:1 + used.size] = used

    if mla.gpu_available():
        import cupy

        xp, backend = cupy, f"GPU ({cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()})"
    else:
        xp, backend = np, "NumPy backend (no GPU found)"
    base, lora = mla.align_moe_and_lora(xp.asarray(topk_ids), xp.asarray(mapping), BLOCK,
                                        EXPERTS, LORAS, lora_ids=xp.asarray(lora_ids))
    to_host = (lambda a: a.get()) if xp is not np else np.asarray
    expert_ids, total = to_host(base.expert_ids), int(to_host(base.num_tokens_post_pad)[0])
    numel = TOKENS * TOPK

    print(f"backend: {backend}")
    print(f"batch: {TOKENS} tokens x top-{TOPK} = {numel} routes over {EXPERTS} experts, "
          f"block_size {BLOCK}")
    tiles = expert_ids[: total // BLOCK]
    per_expert = np.bincount(tiles, minlength=EXPERTS)
    busy = np.flatnonzero(per_expert)
    print(f"base: {total} padded rows in {tiles.size} tiles; {busy.size} experts have routes; "
          f"padding overhead {100 * (total - numel) / numel:.0f}%")
    print("  tiles per expert (first 8 busy): " +
          ", ".join(f"e{e}:{per_expert[e]}" for e in busy[:8]))
    totals = to_host(lora.num_tokens_post_pad)
    for slot in range(LORAS):
        routes = int((mapping == slot).sum()) * TOPK
        print(f"adapter {slot}: {routes:4d} routes -> {int(totals[slot]):5d} padded rows, "
              f"{int(totals[slot]) // BLOCK} tiles")
    print(f"base-model tokens (no adapter): {int((mapping < 0).sum())}")


if __name__ == "__main__":
    main()
