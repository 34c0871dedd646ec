"""The demo's decoder section: SmolLM2-135M-Instruct answers questions, and its attention.

A real, instruction-tuned decoder (30 layers, 9 query heads sharing 3 key/value heads)
loaded natively from its GGUF file: two answers, then the causal attention of every
layer on a prompt (mean over heads), the attention explorer, and the share of attention
each layer puts on the first token (attention sinks, Xiao et al., 2023).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

QUESTIONS = (
    "What is the capital of France? Answer in one sentence.",
    "How many days are there in a week? Answer in one sentence.",
)
PROMPT = "The cat sat on the mat because it was tired and"


def _answer(model: Any, question: str, max_new_tokens: int = 32) -> str:
    import torch

    tok = model.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    eos = model.generation_config.get("eos_token_id")
    out = model.generate(ids, max_new_tokens, eos_token_id=eos)
    return str(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)).strip()


def decoder_section(out: Path, summary: dict[str, Any], *, number: int) -> list[Any]:
    """Print the section, write its pictures into ``out``; return their index entries."""
    import torch

    import attnlab
    from attnlab.interop.pretrained import smollm2_path
    from attnlab.viz.explorer import write_explorer
    from attnlab.viz.heatmap import heads_grid_figure, save_png
    from attnlab.viz.report import IndexEntry
    from attnlab.viz.sinks import first_token_shares, sink_figure

    print(f"\n== {number}. A real decoder: SmolLM2-135M-Instruct " + "=" * 27)
    path = smollm2_path()
    start = time.perf_counter()
    model = attnlab.from_gguf(path)
    c = model.config
    print(
        f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB, Q4_1 blocks dequantized to float32) "
        f"loaded in {time.perf_counter() - start:.1f} s:\n{c.num_hidden_layers} layers, hidden "
        f"{c.hidden_size}, {c.num_attention_heads} query heads sharing {c.num_key_value_heads} "
        f"key/value heads (GQA), RoPE theta {c.rope_theta:g}, {model.num_parameters():,} parameters"
    )
    answers = []
    for q in QUESTIONS:
        a = _answer(model, q)
        answers.append({"question": q, "answer": a})
        print(f"  Q: {q}\n  A: {a}")
    summary["decoder_answers"] = answers

    tok = model.tokenizer
    ids = torch.tensor([tok.encode(PROMPT, add_special_tokens=False)])
    tokens = [tok.decode([i]) for i in ids[0].tolist()]
    with torch.no_grad():
        att = model(input_ids=ids, output_attentions=True).attentions
    assert att is not None
    layers = torch.stack([w[0].mean(0) for w in att])  # [layers, L, L], mean over heads
    save_png(
        heads_grid_figure(
            layers,
            tokens,
            title=f"SmolLM2: every layer (mean over heads) on {PROMPT!r}",
            cols=6,
            label="layer",
        ),
        out / "decoder_layers.png",
    )
    shares = first_token_shares(list(att))
    save_png(
        sink_figure(shares, title="SmolLM2: attention on the first token, per layer"),
        out / "decoder_sinks.png",
    )
    write_explorer(
        out / "decoder_explorer.html",
        [w[0] for w in att],
        tokens,
        title="SmolLM2-135M-Instruct: attention",
        subtitle=PROMPT,
    )
    mean = shares.mean(1)
    print(
        f"\nOn the prompt {PROMPT!r} ({len(tokens)} tokens) attention is causal: each token "
        "sees only\nitself and the tokens before it (the upper triangles are empty). Share of "
        "attention on the first token, per layer (mean over heads):"
    )
    for lo in range(0, len(mean), 10):
        print(
            "  " + "  ".join(f"L{i:<2} {mean[i]:.2f}" for i in range(lo, min(lo + 10, len(mean))))
        )
    deep = mean[3:].mean().item()
    print(
        f"After the first layers most attention lands on the first token (mean {deep:.2f} over "
        "layers 3+),\nwhatever it is: an attention sink (Xiao et al., 2023), the reason streaming "
        "caches keep it."
    )
    summary["first_token_share_per_layer"] = mean.tolist()
    return [
        IndexEntry("decoder_explorer.html", "SmolLM2: attention explorer, every layer and head"),
        IndexEntry("decoder_layers.png", "SmolLM2: every layer, mean over heads (causal)"),
        IndexEntry("decoder_sinks.png", "SmolLM2: attention sinks, share on the first token"),
    ]
