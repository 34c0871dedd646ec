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
            "heatmap PNGs and an HTML attention explorer, compare attnlab with transformers on "
            "the same weights, and print what attention costs from 128 to 32768 tokens. The "
            "output folder opens with index.html."
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
    p.add_argument(
        "--no-decoder",
        action="store_true",
        help="skip the decoder section (SmolLM2-135M-Instruct answering and its attention)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary (tokens, parity differences, files, cost table) instead of "
        "the walk-through; progress goes to stderr",
    )
    p.set_defaults(func=run)


def _rule(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 72 - len(title)))


def run(args: argparse.Namespace) -> int:
    if not getattr(args, "json", False):
        return _run(args, {})
    import contextlib
    import io

    from attnlab.cli._common import print_json

    summary: dict[str, Any] = {}
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        code = _run(args, summary)
    summary["walkthrough"] = text.getvalue()
    print_json(summary)
    return code


def _run(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """The walk-through; fills ``summary`` for ``--json`` (and shows progress then)."""
    from attnlab.cli._common import Progress, writable_dir

    if not args.text.strip():
        raise ValueError("--text is empty")
    writable_dir("--out", args.out)
    steps = (4 if args.no_compare else 5) + (0 if getattr(args, "no_decoder", False) else 1)
    progress = Progress(steps, quiet=not getattr(args, "json", False))
    progress.step("loading all-MiniLM-L6-v2")
    import attnlab
    from attnlab.interop.hf import require_transformers
    from attnlab.interop.pretrained import minilm_path

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
    _simple_section(model, batch, tokens, out)
    summary["tokens"] = tokens
    progress.step("running the model, drawing the heads")
    attentions, ours = _model_section(model, batch, tokens, out)
    if not args.no_compare:
        progress.step("comparing with transformers")
        _compare_section(tf, path, model, batch, ours, summary)
    _sentence_section(model, path, text, out, compare=not args.no_compare, summary=summary)

    decoder_entries: list[Any] = []
    if not getattr(args, "no_decoder", False):
        from attnlab.cli.demo_decoder import decoder_section

        progress.step("the decoder: SmolLM2-135M-Instruct")
        decoder_entries = decoder_section(out, summary, number=6)

    progress.step("writing the explorer and the cost table")
    _explore_section(out, attentions, tokens, text, decoder_entries, summary)
    print(f"\ndone in {time.perf_counter() - start:.1f} s")
    progress.step("done")
    return 0


def _simple_section(model: Any, batch: Any, tokens: list[str], out: Path) -> None:
    """2. Self-attention with no projections, ``Q = K = V = X``: each token sees itself."""
    import torch

    from attnlab.analysis.attention_stats import diagonal_share
    from attnlab.functional import sdpa_reference
    from attnlab.viz.heatmap import heatmap_figure, save_png

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


def _model_section(model: Any, batch: Any, tokens: list[str], out: Path) -> tuple[Any, Any]:
    """3. The real model's heads: where each query looks, one grid per layer.

    Returns:
        ``(attentions, output)`` of the forward with ``output_attentions=True``.
    """
    import torch

    from attnlab.analysis.attention_stats import summarize_heads
    from attnlab.viz.heatmap import heads_grid_figure, heatmap_figure, save_png

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
    return ours.attentions, ours


def _compare_section(
    tf: Any, path: Path, model: Any, batch: Any, ours: Any, summary: dict[str, Any]
) -> None:
    """4. attnlab against transformers' eager BERT on the same weights."""
    import torch

    _rule("4. attnlab vs transformers on the same weights")
    hf = tf.BertModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = hf(**batch, output_attentions=True)
        fast = model(**batch)  # the default backend, no weights requested
    diff = (ours.last_hidden_state - theirs.last_hidden_state).abs().max().item()
    diff_fast = (fast.last_hidden_state - theirs.last_hidden_state).abs().max().item()
    diff_att = max((a - b).abs().max().item() for a, b in zip(ours.attentions, theirs.attentions))
    print(f"transformers BertModel (eager), {sum(p.numel() for p in hf.parameters()):,} parameters")
    print(f"max |difference| of last_hidden_state, reference backend: {diff:.2e}")
    print(f"max |difference| of last_hidden_state, default backend:   {diff_fast:.2e}")
    print(f"max |difference| of attention weights, all layers:         {diff_att:.2e}")
    summary["max_abs_difference"] = {
        "last_hidden_state_reference": diff,
        "last_hidden_state_default": diff_fast,
        "attentions": diff_att,
    }


def _explore_section(
    out: Path,
    attentions: Any,
    tokens: list[str],
    text: str,
    decoder_entries: list[Any],
    summary: dict[str, Any],
) -> None:
    """7. The explorer, 8. the cost table, then the index page and the list of files."""
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.report import IndexEntry, write_index

    _rule("7. Explore it yourself")
    explorer = write_explorer(
        out / "explorer.html",
        [w[0] for w in attentions],
        tokens,
        title="all-MiniLM-L6-v2: attention",
        subtitle=text,
    )
    print(f"{explorer}: pick a layer and a head, hover a token to see where it attends,")
    print("compare two heads side by side. One file, no network: open it in any browser.")

    _rule("8. What attention costs (attnlab estimate)")
    cost_text = _cost_table()
    print(cost_text)

    entries = [
        IndexEntry("explorer.html", "Attention explorer: every layer and head, hover a token"),
        IndexEntry("simple_attention.png", "Q = K = V: weights near the identity"),
        *[
            IndexEntry(f"layer{i}_heads.png", f"Layer {i}: every head")
            for i in range(len(attentions))
        ],
        IndexEntry("last_layer_mean.png", "Last layer, mean over heads"),
        IndexEntry("similarity.png", "Sentence embeddings: cosine similarity"),
        *decoder_entries,
        IndexEntry("", "What attention costs, by sequence length (attnlab estimate)", cost_text),
    ]
    index = write_index(
        out,
        f"attnlab demo: self-attention on {text!r}",
        entries,
        intro="all-MiniLM-L6-v2 (6 layers, hidden 384, 12 heads) run by attnlab"
        + ("; then SmolLM2-135M-Instruct, a real decoder." if decoder_entries else "."),
    )

    _rule("Files")
    print(f"  {index}  (start here)")
    for p in sorted([*out.glob("*.png"), *out.glob("*explorer.html")]):
        print(f"  {p}")
    summary["index"] = str(index)
    summary["files"] = [str(p) for p in sorted(out.iterdir())]
    summary["cost_table"] = cost_text


def _sentence_section(
    model: Any, path: Path, text: str, out: Path, *, compare: bool, summary: dict[str, Any]
) -> None:
    """What most users run this model for: sentence embeddings, and their similarities."""
    from attnlab.viz.heatmap import heatmap_figure, save_png

    _rule("5. Sentence embeddings: what this model is mostly used for")
    sentences = [
        text,
        "fruit flies like a banana",
        "the cat naps on the mat",
        "a kitten sleeps on a rug",
    ]
    emb, report = model.encode(sentences, return_report=True)
    sim = emb @ emb.T  # normalised embeddings: cosine similarities
    labels = sentences  # whole: the figure makes room for them
    print(
        f"mean pooling over the tokens, then L2-normalised ({report.pooling_source.split('/')[-2]}"
        f"/config.json), as sentence-transformers does; cosine similarity:"
    )
    width = max(len(label) for label in labels) + 2
    for label, row in zip(labels, sim.tolist()):
        print(f"  {label:<{width}}" + "".join(f"{v:7.2f}" for v in row))
    print("Paraphrases score high, unrelated sentences low: the vectors behind semantic search.")
    print('Try it on your own notes: attnlab embed notes.txt --query "..." --top 5')
    save_png(
        heatmap_figure(
            sim,
            labels,
            title="sentence embeddings: cosine similarity",
            axis_labels=("sentence", "sentence"),
            value_range=(-1.0, 1.0),
            value_label="cosine similarity",
        ),
        out / "similarity.png",
    )
    summary["sentence_similarity"] = sim.tolist()
    if not compare:
        return
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("(install sentence-transformers to see its numbers beside these)")
        return
    st = SentenceTransformer(str(path), device="cpu")
    theirs = st.encode(sentences, convert_to_tensor=True)
    diff = (emb - theirs).abs().max().item()
    print(
        f"sentence-transformers on the same folder: largest |difference| per component {diff:.1e}"
    )
    summary["sentence_transformers_difference"] = diff


def _cost_table() -> str:
    """The tutorial's table, extended: BERT-base sizes, dense vs sliding window vs GQA."""
    from attnlab.analysis.cost import human_bytes, human_flops
    from attnlab.analysis.scaling import SEQ_LENS, scaling_table

    rows = {(r.variant, r.seq_len): r for r in scaling_table(seq_lens=list(SEQ_LENS))}
    lines = [
        "12 layers, hidden 768, 12 heads (the tutorial's sizes); one sequence; tiled attention",
        f"{'seq_len':>7}  {'tutorial n²·d':>15}  {'attention/layer':>15}  {'window 512':>12}  "
        f"{'score matrix':>12}  {'KV cache MHA':>12}  {'KV cache GQA-4':>14}",
    ]
    for n in SEQ_LENS:
        d, w, g = rows["dense", n], rows["sliding", n], rows["gqa", n]
        lines.append(
            f"{n:>7}  {d.tutorial_n2d:>15,}  {human_flops(d.attention_flops_per_layer):>15}  "
            f"{human_flops(w.attention_flops_per_layer):>12}  {human_bytes(d.score_matrix_bytes):>12}  "
            f"{human_bytes(d.kv_cache_bytes):>12}  {human_bytes(g.kv_cache_bytes):>14}"
        )
    lines.append(
        "attention/layer = QKᵀ and weights·V, 4·n²·d FLOPs: quadratic, while a 512-key window grows "
        "linearly;\nthe score matrix is what materialised attention stores per layer (float32); "
        "GQA with 4 kv heads cuts the KV cache 3x."
    )
    return "\n".join(lines)
