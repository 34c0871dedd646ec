"""``attnlab demo``: a walk-through of self-attention on a real pretrained model.

It follows the tutorial: tokenize a sentence, try the simplest self-attention
(Q = K = V = the token embeddings) and see why it is not enough, then look at
what the real model's heads do, layer by layer, and check attnlab against
transformers on the same weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="walk through self-attention on all-MiniLM-L6-v2",
        description=(
            "Tokenize a sentence, show the simplest Q = K = V self-attention and its near-identity "
            "weights, then the real model's multi-head attention per layer and head; write "
            "heatmap PNGs and compare attnlab with transformers on the same weights."
        ),
    )
    p.add_argument("--text", default="time flies like an arrow", help="the sentence to look at")
    p.add_argument(
        "--out", default="attnlab-demo", help="folder for the heatmaps (default: ./attnlab-demo)"
    )
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="skip loading the transformers model for the parity check",
    )
    p.set_defaults(func=run)


def _rule(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 72 - len(title)))


def run(args: argparse.Namespace) -> int:
    import torch

    import attnlab
    from attnlab.analysis.attention_stats import diagonal_share, summarize_heads
    from attnlab.functional import sdpa_reference
    from attnlab.interop.hf import require_transformers
    from attnlab.interop.pretrained import minilm_path
    from attnlab.viz.heatmap import heads_grid_figure, heatmap_figure, save_png

    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tf = require_transformers()
    tf.utils.logging.disable_progress_bar()
    path = minilm_path()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    model = attnlab.from_hf(path)
    text = args.text.strip()
    if not text:
        raise ValueError("--text is empty")
    batch = tokenizer(text, return_tensors="pt")
    n = batch["input_ids"].shape[1]
    limit = model.config.max_position_embeddings
    if n > limit:
        raise ValueError(f"--text has {n} tokens; the model takes at most {limit}")
    tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())

    _rule("1. Tokens")
    print(f"text: {text!r}")
    print(f"{n} tokens (with [CLS] and [SEP]): {tokens}")

    _rule("2. The simplest self-attention: Q = K = V = X")
    print("X = the model's input embeddings (token + position + type, then LayerNorm)")
    with torch.no_grad():
        x = model.embeddings(batch["input_ids"])  # [1, n, D]
        _, simple = sdpa_reference(x, x, x, return_weights=True)  # weights [1, n, n]
    assert simple is not None
    simple = simple[0]
    diag = diagonal_share(simple)
    print("weights = softmax(X X^T / sqrt(d)), each token's row:")
    width = max(len(t) for t in tokens) + 1
    print(" " * width + "".join(f"{t[:7]:>8}" for t in tokens))
    for t, row in zip(tokens, simple.tolist()):
        print(f"{t:<{width}}" + "".join(f"{w:8.2f}" for w in row))
    print(
        f"\nmean weight on the token itself: {diag:.2f}. A token's embedding is most similar to "
        "itself,\nso without learned projections each token mostly attends to itself and learns "
        "little\nfrom its context: the problem that separate W_Q, W_K, W_V solve."
    )
    save_png(
        heatmap_figure(simple, tokens, title="Q = K = V: weights near the identity"),
        out / "simple_attention.png",
    )

    _rule("3. The real model: all-MiniLM-L6-v2 in attnlab")
    cfg = model.config
    print(
        f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
        f"of dim {cfg.head_dim}, {model.num_parameters():,} parameters"
    )
    with torch.no_grad():
        ours = model(**batch, output_attentions=True)
    assert ours.attentions is not None
    print("for each layer and head, the token each query attends to most:")
    for layer, w in enumerate(ours.attentions):
        heads = summarize_heads(w[0], tokens, layer=layer)
        print(
            f"\nlayer {layer}" + " " * 4 + "  ".join(f"{t[:8]:>8}" for t in tokens) + "   entropy"
        )
        for h in heads:
            cells = "  ".join(f"{t[:8]:>8}" for t in h.targets)
            print(f"  head {h.head:>2}   {cells}   {h.mean_entropy:5.2f}")
        save_png(
            heads_grid_figure(w[0], tokens, title=f"layer {layer}: every head"),
            out / f"layer{layer}_heads.png",
        )
    last = ours.attentions[-1][0].mean(0)
    save_png(
        heatmap_figure(last, tokens, title="last layer, mean over heads"),
        out / "last_layer_mean.png",
    )
    print(
        "\nEarly layers spread attention or look at neighbours; many later heads send most "
        "weight to\n[CLS] or [SEP], a known 'attention sink' pattern (Clark et al., 2019)."
    )

    if not args.no_compare:
        _rule("4. attnlab vs transformers on the same weights")
        hf = tf.BertModel.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            theirs = hf(**batch, output_attentions=True)
            fast = model(**batch)  # the default backend, no weights requested
        diff = (ours.last_hidden_state - theirs.last_hidden_state).abs().max().item()
        diff_fast = (fast.last_hidden_state - theirs.last_hidden_state).abs().max().item()
        diff_att = max(
            (a - b).abs().max().item() for a, b in zip(ours.attentions, theirs.attentions)
        )
        print(
            f"transformers BertModel (eager), {sum(p.numel() for p in hf.parameters()):,} parameters"
        )
        print(f"max |difference| of last_hidden_state, reference backend: {diff:.2e}")
        print(f"max |difference| of last_hidden_state, default backend:   {diff_fast:.2e}")
        print(f"max |difference| of attention weights, all layers:         {diff_att:.2e}")

    _rule("Files")
    for p in sorted(out.glob("*.png")):
        print(f"  {p}")
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    return 0
