"""A folder of attention pictures that opens with an index page (for ``visualize`` and ``demo``).

:func:`write_attention_pictures` writes, for one sequence: the explorer
(:mod:`attnlab.viz.explorer`), one head grid per layer, an annotated heatmap of the last
layer's mean, and per-head entropy, attention-distance and first-token-share maps.
:func:`write_index` writes ``index.html`` linking and showing every file, self-contained
like the explorer (relative links only, works from ``file://``).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

__all__ = ["IndexEntry", "write_attention_pictures", "write_index"]


@dataclass
class IndexEntry:
    """One item of the index page.

    Attributes:
        file: path relative to the folder (a ``.png`` is shown, anything else linked), or
            ``""`` for text only.
        caption: what it shows.
        text: preformatted text shown under the caption (a table...).
    """

    file: str
    caption: str
    text: str = ""


def write_attention_pictures(
    out: str | Path,
    attentions: Sequence[Tensor],
    tokens: list[str],
    *,
    name: str = "model",
    subtitle: str = "",
    on_layer: Callable[[int], None] | None = None,
) -> list[IndexEntry]:
    """Write the explorer and the PNGs for one sequence's attention; return index entries.

    Args:
        out: folder (created).
        attentions: one ``[H, L, L]`` or ``[1, H, L, L]`` tensor per layer.
        tokens: the ``L`` tokens.
        name: the model's name for titles.
        subtitle: a line for the explorer (the text...).
        on_layer: called after each layer's picture (progress display).

    Raises:
        ValueError: no layers, or weights that do not match the tokens.
    """
    from attnlab.analysis.attention_stats import attention_head_stats
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.heatmap import heads_grid_figure, heatmap_figure, save_png
    from attnlab.viz.plots import head_stat_figure

    out = Path(out)
    if not attentions:
        raise ValueError("attentions is empty: pass one tensor per layer")
    layers = [w[0] if w.dim() == 4 else w for w in attentions]
    entries = [
        IndexEntry(
            "explorer.html",
            "Attention explorer: pick a layer and a head in two panels, hover a token to see where it attends",
        )
    ]
    write_explorer(
        out / "explorer.html", layers, tokens, title=f"{name}: attention", subtitle=subtitle
    )
    stats = []
    for i, w in enumerate(layers):
        stats += attention_head_stats(w, layer=i)
        save_png(
            heads_grid_figure(w, tokens, title=f"{name}, layer {i}: every head"),
            out / f"layer{i}_heads.png",
        )
        entries.append(IndexEntry(f"layer{i}_heads.png", f"Layer {i}: every head"))
        if on_layer is not None:
            on_layer(i)
    mean = layers[-1].float().mean(0)
    save_png(
        heatmap_figure(mean, tokens, title=f"{name}: last layer, mean over heads"),
        out / "last_layer_mean.png",
    )
    entries.append(IndexEntry("last_layer_mean.png", "Last layer, mean over heads (annotated)"))
    for stat, caption in (
        ("entropy", "Entropy per head and layer: low = focused, high (up to log L) = spread out"),
        ("mean_distance", "Mean attention distance per head and layer, in tokens"),
        ("first_token_share", "Share of attention on the first token: attention sinks"),
    ):
        save_png(
            head_stat_figure(stats, stat, title=f"{name}: {stat.replace('_', ' ')}"),
            out / f"{stat}.png",
        )
        entries.append(IndexEntry(f"{stat}.png", caption))
    return entries


def write_index(
    out: str | Path, title: str, entries: Sequence[IndexEntry], *, intro: str = ""
) -> Path:
    """Write ``index.html`` in ``out`` showing/linking ``entries``; return its path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    for e in entries:
        cap = html.escape(e.caption)
        block = f"<section><h2>{cap}</h2>"
        if e.file.endswith(".png"):
            f = html.escape(e.file)
            block += f'<a href="{f}"><img src="{f}" alt="{cap}"></a>'
        elif e.file:
            f = html.escape(e.file)
            block += f'<p><a class="open" href="{f}">open {f}</a></p>'
        if e.text:
            block += f"<pre>{html.escape(e.text)}</pre>"
        parts.append(block + "</section>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px auto; padding: 0 16px; max-width: 1200px; box-sizing: border-box; color: #1d2433; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 16px; margin: 28px 0 8px; }}
img {{ max-width: 100%; border: 1px solid #dde1e8; border-radius: 6px; }}
pre {{ background: #f3f5f8; padding: 10px; border-radius: 6px; overflow-x: auto; font-size: 12px; }}
a.open {{ font-size: 16px; font-weight: 600; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(intro)}</p>
{"".join(parts)}
</body></html>
"""
    path = out / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
