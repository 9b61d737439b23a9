"""Looking at an alignment: a summary in numbers, and a picture of its tiles (matplotlib, the
``viz`` extra). Works on the results of every backend (they are copied to the host)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np


def _host(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "cpu"):
        return x.cpu().numpy()          # torch
    if hasattr(x, "get"):
        return x.get()                  # CuPy
    return np.asarray(x)                # JAX, lists


def _rows(alignment):
    sorted_ids = _host(alignment.sorted_token_ids)
    expert_ids = _host(alignment.expert_ids)
    totals = _host(alignment.num_tokens_post_pad).reshape(-1)
    if sorted_ids.ndim == 1:
        return sorted_ids[None], expert_ids.reshape(1, -1), totals[:1]
    return sorted_ids, expert_ids, totals


def _sentinel(row: np.ndarray, total: int) -> Optional[int]:
    """``numel``, read from the row's tail (every entry past the total holds it)."""
    if total < row.shape[0]:
        return int(row[total])
    top = int(row.max()) if row.size else 0
    return top if (row == top).sum() > 1 else None  # padding inside segments, or none


def _block_size(experts: np.ndarray, total: int) -> Optional[int]:
    """Tile height: the total over the tiles before the trailing run of -1."""
    owned = experts.shape[0]
    while owned and experts[owned - 1] == -1:
        owned -= 1
    return total // owned if owned and total % owned == 0 else None


def row_stats(alignment) -> List[Dict[str, Any]]:
    """Per row (one for base, one per adapter slot for LoRA): total, routes, tiles owned,
    experts used, padding fraction."""
    stats = []
    for row, experts, total in zip(*_rows(alignment)):
        total = int(total)
        sentinel = _sentinel(row, total)
        head = row[:total]
        routes = int((head != sentinel).sum()) if sentinel is not None else total
        owned = experts[experts >= 0]
        stats.append(dict(total=total, routes=routes, tiles=int(owned.size),
                          experts=int(np.unique(owned).size),
                          padding=(total - routes) / total if total else 0.0))
    return stats


def summary(alignment) -> str:
    """A line or two of numbers about an alignment."""
    stats = row_stats(alignment)
    name = type(alignment).__name__
    if len(stats) == 1 and name != "LoraAlignment":
        s = stats[0]
        return (f"{name}: {s['routes']} routes in {s['tiles']} tiles of {s['experts']} experts, "
                f"{s['total']} entries with padding ({100 * s['padding']:.1f} %)")
    used = [s for s in stats if s["total"]]
    routes = sum(s["routes"] for s in used)
    total = sum(s["total"] for s in used)
    return (f"{name}: {len(used)} of {len(stats)} slots hold routes; {routes} routes in "
            f"{sum(s['tiles'] for s in used)} tiles, {total} entries with padding "
            f"({100 * (total - routes) / total if total else 0:.1f} %)")


def html(alignment) -> str:
    """The summary and a table of rows, for notebooks."""
    stats = row_stats(alignment)
    rows = "".join(
        f"<tr><td>{i}</td><td>{s['routes']}</td><td>{s['tiles']}</td><td>{s['experts']}</td>"
        f"<td>{s['total']}</td><td>{100 * s['padding']:.1f} %</td></tr>"
        for i, s in enumerate(stats) if s["total"] or len(stats) == 1)
    return (f"<p>{summary(alignment)}</p><table><tr><th>row</th><th>routes</th><th>tiles</th>"
            f"<th>experts</th><th>entries</th><th>padding</th></tr>{rows}</table>")


def draw(alignment, ax=None, block_size: Optional[int] = None):
    """Draw each row's tiles as bars: one colour an expert, the filled part its routes, the
    rest padding. Returns the matplotlib axes."""
    import matplotlib.pyplot as plt

    sorted_rows, expert_rows, totals = _rows(alignment)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.4 * len(totals)))
    cmap = plt.get_cmap("tab20")
    for r, (row, experts, total) in enumerate(zip(sorted_rows, expert_rows, totals)):
        total = int(total)
        B = block_size or _block_size(experts, total)
        if not total or not B:
            continue
        sentinel = _sentinel(row, total)
        for t in range(total // B):
            tile = row[t * B:(t + 1) * B]
            filled = int((tile != sentinel).sum()) if sentinel is not None else B
            e = int(experts[t])
            color = cmap(e % 20) if e >= 0 else "lightgrey"
            ax.barh(r, filled / B, left=t, height=0.8, color=color)
            ax.barh(r, 1 - filled / B, left=t + filled / B, height=0.8, color=color,
                    alpha=0.25, hatch="//")
    ax.set(xlabel="tile (bars: routes; hatched: padding)", ylabel="row",
           title=summary(alignment))
    ax.set_yticks(range(len(totals)))
    return ax
