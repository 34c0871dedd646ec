"""CPU seconds per training step of every model of each full `attnlab experiment` run.

Usage: python scripts/experiment_step_cost.py [extrapolation recall selective-copy gqa induction]

One thread (as `attnlab experiment` runs by default), one warm-up step, then the mean
`time.process_time` of three steps of forward, backward and AdamW at the full run's
sizes. Multiply by the steps printed to estimate a full run (docs/experiments.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnlab.experiments import extrapolation, gqa, induction, recall, selective_copy
from attnlab.models import DecoderConfig, DecoderLM


def step_seconds(model: nn.Module, batch: Callable[[], tuple[Tensor, Tensor]], n: int = 3) -> float:
    opt = torch.optim.AdamW(model.parameters(), 1e-3)

    def step() -> None:
        ids, labels = batch()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    t0 = time.process_time()
    for _ in range(n):
        step()
    return (time.process_time() - t0) / n


def main(which: list[str]) -> None:
    torch.set_num_threads(1)
    if "extrapolation" in which:
        s = extrapolation._settings(False, False)
        ids = torch.randint(0, 256, (s["batch"], s["train_len"]))
        for pos in extrapolation.POSITIONS:
            m = extrapolation._model(pos, s, 256)
            print(
                "extrapolation", pos, f"{step_seconds(m, lambda: (ids, ids)):.3f} s x", s["steps"]
            )
    if "recall" in which:
        s = recall._settings(False, False)
        d = recall.MQAR(keys=s["keys"], pairs=s["pairs"], seed=0)
        for k in s["kinds"]:
            for w in s["widths"]:
                m = recall.build(k, w, d.vocab_size, d.max_length)
                t = step_seconds(m, lambda: d.draw(s["batch"], 0))
                print("recall", k, w, f"{t:.3f} s x", s["steps"])
    if "selective-copy" in which:
        from attnlab.models.recurrent import MambaLM
        from attnlab.models.recurrent_config import MambaConfig

        s = selective_copy._settings(False, False)
        cfg = MambaConfig(
            vocab_size=s["symbols"] + 3,
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            chunk_size=16,
        )
        ids = torch.randint(0, s["symbols"] + 3, (s["batch"], 5 * s["n"] + 1))
        t = step_seconds(MambaLM(cfg), lambda: (ids, ids))
        print("selective-copy mamba", f"{t:.3f} s x 2 models x", s["steps"])
    if "gqa" in which:
        s = gqa._settings(False, False)
        cfg = DecoderConfig(
            vocab_size=256,
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=4 * s["hidden"],
            max_position_embeddings=2048,
        )
        ids = torch.randint(0, 256, (s["batch"], s["seq"]))
        t = step_seconds(DecoderLM(cfg), lambda: (ids, ids))
        print("gqa mha", f"{t:.3f} s x", s["steps"], "+ 4 x", s["uptrain"])
    if "induction" in which:
        s = induction._settings(False, False)
        ids = torch.randint(0, s["vocab"], (s["batch"], 2 * s["half"]))
        for layers in (1, 2):
            cfg = DecoderConfig(
                vocab_size=s["vocab"],
                hidden_size=s["hidden"],
                num_hidden_layers=layers,
                num_attention_heads=s["heads"],
                intermediate_size=s["hidden"],
                max_position_embeddings=2048,
                position_embedding="rope",
            )
            m = DecoderLM(cfg)
            for layer in m.layers:
                layer.feed_forward = induction.NoFeedForward()
            print("induction", layers, f"{step_seconds(m, lambda: (ids, ids)):.3f} s x", s["steps"])


if __name__ == "__main__":
    main(sys.argv[1:] or ["extrapolation", "recall", "selective-copy", "gqa", "induction"])
