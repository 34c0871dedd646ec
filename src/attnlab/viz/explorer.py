"""A self-contained HTML attention explorer: one file, no CDN, no server, works from ``file://``.

Shape notation: ``N`` layers, ``H`` heads, ``L`` queries, ``S`` keys.

The page embeds the weights as JSON and a few dozen lines of plain JavaScript: pick a
layer and a head (or the mean of the heads) in two panels side by side, hover a query
token to see where it attends (key tokens shaded by weight, the weights listed in
order), and read the whole map as a heatmap table. In the spirit of bertviz (Vig, 2019,
"A multiscale visualization of attention in the Transformer model"), without its
notebook and its JavaScript dependencies.
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

__all__ = ["explorer_html", "write_explorer"]

#: Longest sequence the page embeds (the weights grow as N·H·L·S).
MAX_TOKENS = 256


def _weights_json(attentions: Sequence[Tensor], decimals: int) -> list[list[list[list[float]]]]:
    out = []
    for w in attentions:
        if w.dim() == 4:
            if w.shape[0] != 1:
                raise ValueError(
                    f"pass the weights of one sequence: got batch {w.shape[0]} in {tuple(w.shape)}"
                )
            w = w[0]
        out.append(w.detach().float().cpu().round(decimals=decimals).tolist())
    return out


def explorer_html(
    attentions: Sequence[Tensor],
    tokens: Sequence[str],
    *,
    key_tokens: Sequence[str] | None = None,
    title: str = "attention explorer",
    subtitle: str = "",
    decimals: int = 3,
) -> str:
    """The explorer page for one sequence, as an HTML string.

    Args:
        attentions: one ``[H, L, S]`` (or ``[1, H, L, S]``) tensor per layer, as a model
            returns with ``output_attentions=True``.
        tokens: the ``L`` query tokens.
        key_tokens: the ``S`` key tokens (default ``tokens``).
        title: page title.
        subtitle: a line under the title (model name, text...).
        decimals: weights are rounded to this many decimals in the page.

    Returns:
        The HTML text (UTF-8, self-contained).

    Raises:
        ValueError: no layers, shapes that do not match the tokens or each other, or
            more than :data:`MAX_TOKENS` tokens.
    """
    if len(attentions) == 0:
        raise ValueError("attentions is empty: pass one [H, L, S] tensor per layer")
    keys = list(tokens if key_tokens is None else key_tokens)
    if max(len(tokens), len(keys)) > MAX_TOKENS:
        raise ValueError(
            f"{max(len(tokens), len(keys))} tokens: the explorer embeds at most {MAX_TOKENS}; "
            "explore a shorter text"
        )
    data = _weights_json(attentions, decimals)
    shapes = {(len(w), len(w[0]), len(w[0][0])) for w in data}
    if len(shapes) != 1:
        raise ValueError(f"every layer must have the same [H, L, S] shape, got {sorted(shapes)}")
    _, lq, s = shapes.pop()
    if (lq, s) != (len(tokens), len(keys)):
        raise ValueError(
            f"weights are [H, {lq}, {s}] but there are {len(tokens)} query and {len(keys)} key tokens"
        )
    payload = json.dumps(
        {"tokens": list(tokens), "keys": keys, "weights": data}, separators=(",", ":")
    )
    payload = payload.replace("</", "<\\/")  # a token "</script>" cannot end the script
    return (
        _PAGE.replace("__TITLE__", html.escape(title))
        .replace("__SUBTITLE__", html.escape(subtitle))
        .replace("__DATA__", payload)
    )


def write_explorer(
    path: str | Path, attentions: Sequence[Tensor], tokens: Sequence[str], **kw: object
) -> Path:
    """Write :func:`explorer_html` to ``path`` (creating its folder) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(explorer_html(attentions, tokens, **kw), encoding="utf-8")  # type: ignore[arg-type]
    return path


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1d2433; background: #fafbfc; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  .sub { color: #5b6475; margin: 0 0 16px; font-size: 14px; }
  .help { color: #5b6475; font-size: 13px; margin-bottom: 14px; }
  .panels { display: flex; gap: 24px; flex-wrap: wrap; }
  .panel { background: white; border: 1px solid #dde1e8; border-radius: 8px; padding: 14px 16px; min-width: 360px; flex: 1; }
  .controls { display: flex; gap: 12px; align-items: center; margin-bottom: 12px; font-size: 14px; }
  select { font-size: 14px; padding: 2px 4px; }
  .tokens { display: flex; flex-wrap: wrap; gap: 4px; margin: 6px 0 10px; }
  .tok { padding: 3px 7px; border-radius: 4px; border: 1px solid #cfd5df; cursor: default;
         font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 14px; background: white; }
  .tok.query { outline: 2px solid #d9480f; }
  .label { font-size: 12px; color: #5b6475; text-transform: uppercase; letter-spacing: .04em; }
  .readout { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; min-height: 3.2em;
             white-space: pre-wrap; background: #f3f5f8; border-radius: 4px; padding: 6px 8px; }
  table.heat { border-collapse: collapse; margin-top: 10px; font-size: 11px; }
  table.heat td, table.heat th { min-width: 38px; height: 22px; text-align: center; padding: 0 2px; }
  table.heat th { font-weight: normal; color: #5b6475; font-family: ui-monospace, Menlo, Consolas, monospace;
                  font-size: 10px; max-width: 70px; overflow: hidden; white-space: nowrap; }
  table.heat th.row { text-align: right; padding-right: 6px; }
  table.heat tr.hl th.row { color: #d9480f; font-weight: bold; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<p class="sub">__SUBTITLE__</p>
<p class="help">Hover a token in either panel: the key tokens are shaded by how much that query attends
to them, and its weights are listed below. Pick a layer and a head in each panel to compare heads.</p>
<div class="panels" id="panels"></div>
<script id="attn-data" type="application/json">__DATA__</script>
<script>
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("attn-data").textContent);
  var T = DATA.tokens, K = DATA.keys, W = DATA.weights;
  var NL = W.length, NH = W[0].length;
  var panels = [];

  function matrix(layer, head) {
    if (head >= 0) return W[layer][head];
    var m = [];
    for (var i = 0; i < T.length; i++) {
      var row = [];
      for (var j = 0; j < K.length; j++) {
        var s = 0;
        for (var h = 0; h < NH; h++) s += W[layer][h][i][j];
        row.push(Math.round(s / NH * 1000) / 1000);
      }
      m.push(row);
    }
    return m;
  }
  function shade(w) {
    var a = Math.max(0, Math.min(1, w));
    return "rgba(217, 72, 15, " + (0.08 + 0.85 * a).toFixed(3) + ")";
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function option(sel, value, text) {
    var o = el("option", "", text); o.value = String(value); sel.appendChild(o);
  }

  function Panel(idx, layer, head) {
    var p = this;
    p.root = el("div", "panel"); p.root.id = "panel-" + idx;
    var controls = el("div", "controls");
    controls.appendChild(el("span", "", "layer"));
    p.layerSel = el("select"); p.layerSel.id = "layer-" + idx;
    for (var l = 0; l < NL; l++) option(p.layerSel, l, String(l));
    controls.appendChild(p.layerSel);
    controls.appendChild(el("span", "", "head"));
    p.headSel = el("select"); p.headSel.id = "head-" + idx;
    for (var h = 0; h < NH; h++) option(p.headSel, h, String(h));
    option(p.headSel, -1, "mean");
    controls.appendChild(p.headSel);
    p.layerSel.value = String(layer); p.headSel.value = String(head);
    p.root.appendChild(controls);
    p.root.appendChild(el("div", "label", "queries (hover one)"));
    p.queries = el("div", "tokens");
    p.root.appendChild(p.queries);
    p.root.appendChild(el("div", "label", "keys, shaded by weight"));
    p.keys = el("div", "tokens");
    p.root.appendChild(p.keys);
    p.readout = el("div", "readout", "hover a token");
    p.readout.id = "readout-" + idx;
    p.root.appendChild(p.readout);
    p.table = el("table", "heat"); p.table.id = "heat-" + idx;
    p.root.appendChild(p.table);
    T.forEach(function (t, i) {
      var span = el("span", "tok", t);
      span.setAttribute("data-query", String(i));
      span.addEventListener("mouseenter", function () { select(i); });
      p.queries.appendChild(span);
    });
    K.forEach(function (t, j) {
      var span = el("span", "tok", t);
      span.setAttribute("data-key", String(j));
      p.keys.appendChild(span);
    });
    p.layerSel.addEventListener("change", function () { p.draw(); select(current); });
    p.headSel.addEventListener("change", function () { p.draw(); select(current); });
    document.getElementById("panels").appendChild(p.root);
  }
  Panel.prototype.m = function () {
    return matrix(parseInt(this.layerSel.value, 10), parseInt(this.headSel.value, 10));
  };
  Panel.prototype.draw = function () {
    var m = this.m(), tb = this.table;
    while (tb.firstChild) tb.removeChild(tb.firstChild);
    var head = el("tr"); head.appendChild(el("th"));
    K.forEach(function (k) { var th = el("th", "", k); th.title = k; head.appendChild(th); });
    tb.appendChild(head);
    m.forEach(function (row, i) {
      var tr = el("tr"); tr.setAttribute("data-row", String(i));
      tr.appendChild(el("th", "row", T[i]));
      row.forEach(function (w) {
        var td = el("td"); td.style.background = shade(w);
        if (T.length <= 24) td.textContent = w.toFixed(2).replace(/^0/, "");
        td.title = w.toFixed(3);
        tr.appendChild(td);
      });
      tb.appendChild(tr);
    });
  };
  Panel.prototype.show = function (i) {
    var m = this.m(), row = m[i];
    var qs = this.queries.children, ks = this.keys.children, rows = this.table.rows;
    for (var a = 0; a < qs.length; a++) qs[a].classList.toggle("query", a === i);
    for (var j = 0; j < ks.length; j++) ks[j].style.background = shade(row[j]);
    for (var r = 1; r < rows.length; r++) rows[r].classList.toggle("hl", r - 1 === i);
    var order = row.map(function (w, j) { return [w, j]; }).sort(function (a, b) { return b[0] - a[0]; });
    var head = this.headSel.value === "-1" ? "mean of heads" : "head " + this.headSel.value;
    var lines = ["layer " + this.layerSel.value + ", " + head + ": query " + i + " '" + T[i] + "' attends to"];
    lines.push(order.slice(0, 8).map(function (p) { return K[p[1]] + " " + p[0].toFixed(3); }).join("  "));
    this.readout.textContent = lines.join("\\n");
    this.readout.setAttribute("data-query", String(i));
    this.readout.setAttribute("data-weights", JSON.stringify(row));
  };

  var current = 0;
  function select(i) { current = i; panels.forEach(function (p) { p.show(i); }); }
  panels.push(new Panel("a", 0, 0));
  panels.push(new Panel("b", NL - 1, Math.min(1, NH - 1)));
  panels.forEach(function (p) { p.draw(); });
  select(0);
  window.attnExplorer = { select: select, data: DATA };
})();
</script>
</body>
</html>
"""
