"""The output processor alone (no model, no cache): text, stop rules, held-back tails."""

from __future__ import annotations

from typing import Any

from attnlab.serving.detokenize import IncrementalDetokenizer
from attnlab.serving.metrics import EngineMetrics
from attnlab.serving.output_processor import OutputProcessor, find_stop
from attnlab.serving.outputs import Request, Seq
from attnlab.serving.params import SamplingParams


class CharTokenizer:
    """Token ``i`` is the character ``chr(97 + i)``; token 25 ('z') is EOS."""

    eos_token_id = 25

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join(chr(97 + i) for i in ids)


def _seq(params: SamplingParams) -> tuple[dict[str, Request], Seq]:
    req = Request("r", [0, 1], params, arrival=0.0, order=0)
    seq = Seq(0, req, 0, None, IncrementalDetokenizer(CharTokenizer(), req.prompt_ids))
    req.seqs.append(seq)
    return {"r": req}, seq


def _feed(proc: OutputProcessor, seq: Seq, tokens: list[int]) -> str | None:
    for t in tokens:
        reason = proc.process(seq, t, None)
        if reason is not None:
            seq.finish_reason = reason
            return reason
    return None


def test_stop_string_is_cut_and_its_possible_start_held_back() -> None:
    proc = OutputProcessor(eos_ids={25}, max_model_len=100, metrics=EngineMetrics())
    requests, seq = _seq(SamplingParams(max_tokens=20, stop=("cde",)))
    assert _feed(proc, seq, [7, 2, 3]) is None  # "hcd": "cd" could begin "cde"
    (out,) = proc.collect(requests)
    assert out.outputs[0].text == "h" and out.outputs[0].token_ids == [7, 2, 3]
    assert _feed(proc, seq, [4]) == "stop"
    (out,) = proc.collect(requests)
    assert out.finished and out.outputs[0].text == "" and out.outputs[0].finish_reason == "stop"
    assert not requests and proc.metrics.requests_finished == 1
    assert proc.metrics.generation_tokens == 4


def test_eos_length_and_ignore_eos() -> None:
    proc = OutputProcessor(eos_ids={25}, max_model_len=100, metrics=EngineMetrics())
    _, seq = _seq(SamplingParams(max_tokens=5))
    assert _feed(proc, seq, [3, 25]) == "stop" and seq.text == "d"
    _, seq = _seq(SamplingParams(max_tokens=3, ignore_eos=True))
    assert _feed(proc, seq, [3, 25, 4]) == "length" and seq.text == "dze"
    small = OutputProcessor(eos_ids=set(), max_model_len=4, metrics=EngineMetrics())
    _, seq = _seq(SamplingParams(max_tokens=10))  # 2 prompt tokens + 2 fill the context
    assert _feed(small, seq, [3, 4, 5]) == "length" and seq.output_ids == [3, 4]


def test_find_stop_takes_the_earliest() -> None:
    assert find_stop("abcdef", ("de", "bc")) == 1
    assert find_stop("abcdef", ("de", "bc"), keep=True) == 3
    assert find_stop("abc", ("x",)) is None
