"""The output processor: sampled tokens -> text, stop decisions and the step's outputs.

The engine's last role in a step (vLLM v1's ``OutputProcessor``): each sampled token is
appended to its sequence, detokenised incrementally (never a broken UTF-8 character),
checked against EOS, ``stop_token_ids``, stop strings (cut from the text), a finished
grammar, ``max_tokens`` and the context; then :meth:`OutputProcessor.collect` gathers
every request's new text into :class:`~attnlab.serving.outputs.RequestOutput` objects
for the clients, holding back the tail of the text that could still begin a stop
string. It owns no tensors and no cache: the engine frees a finished sequence's blocks
and grows a running one's from the reason :meth:`OutputProcessor.process` returns.
"""

from __future__ import annotations

import time

from attnlab.serving.metrics import EngineMetrics
from attnlab.serving.outputs import CompletionDelta, Request, RequestOutput, Seq, TokenLogprob

__all__ = ["OutputProcessor", "find_stop"]


def find_stop(text: str, stops: tuple[str, ...], *, keep: bool = False) -> int | None:
    """Where ``text`` ends at its first stop string (after it when ``keep``), or None."""
    hits = [(i, i + len(s) if keep else i) for s in stops if (i := text.find(s)) >= 0]
    return min(hits)[1] if hits else None


class OutputProcessor:
    """Detokenises, applies the stop rules and builds each step's outputs.

    Args:
        eos_ids: the end-of-sequence tokens (a stop unless ``ignore_eos``).
        max_model_len: the context; a sequence that fills it finishes with ``"length"``.
        metrics: the engine's counters (first-token times, generated tokens, finished
            requests).
    """

    def __init__(self, *, eos_ids: set[int], max_model_len: int, metrics: EngineMetrics) -> None:
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.metrics = metrics

    def process(self, seq: Seq, tok: int, lp: TokenLogprob | None) -> str | None:
        """Append the sampled ``tok`` to ``seq`` (its text and pending delta).

        Returns:
            The finish reason (``"stop"``, ``"length"``) when ``seq`` ends here, else None.
        """
        req, p = seq.request, seq.request.params
        if req.first_token_time is None:
            req.first_token_time = now = time.perf_counter()
            self.metrics.record_ttft(now - req.arrival)
        self.metrics.generation_tokens += 1
        seq.output_ids.append(tok)
        delta = seq.pending or CompletionDelta(index=seq.index)
        seq.pending = delta
        delta.token_ids.append(tok)
        if lp is not None:
            delta.logprobs.append(lp)
        reason = None
        if seq.matcher is not None:
            seq.matcher.advance(tok)
        if tok in self.eos_ids and not p.ignore_eos:
            reason = "stop"
        elif tok in p.stop_token_ids:
            reason = "stop"
            if p.include_stop_str_in_output:
                seq.text += seq.detok.add(tok) + seq.detok.flush()
        else:
            seq.text += seq.detok.add(tok)
        if reason is None and p.stop and len(seq.output_ids) >= p.min_tokens:
            cut = find_stop(seq.text, p.stop, keep=p.include_stop_str_in_output)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and seq.matcher is not None and seq.matcher.done:
            seq.text += seq.detok.flush()
            reason = "stop"
        if reason is None and (
            len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason == "length":
            seq.text += seq.detok.flush()
        return reason

    def collect(self, requests: dict[str, Request]) -> list[RequestOutput]:
        """Every request's news since the last call; finished requests leave ``requests``."""
        outs: list[RequestOutput] = []
        for rid, req in list(requests.items()):
            deltas = [d for seq in req.seqs if (d := self._delta(seq)) is not None]
            finished = req.finished
            if deltas or finished:
                timings = (
                    req.timing.summary(req.arrival, req.first_token_time) if finished else None
                )
                outs.append(
                    RequestOutput(
                        rid,
                        deltas,
                        finished,
                        len(req.prompt_ids),
                        req.cached_tokens,
                        req.error,
                        timings,
                    )
                )
            if finished:
                del requests[rid]
                self.metrics.requests_finished += 1
        return outs

    @staticmethod
    def _delta(seq: Seq) -> CompletionDelta | None:
        """``seq``'s news: new tokens, and its text up to what could begin a stop string."""
        d = seq.pending
        stops = seq.request.params.stop
        hold = max(len(s) for s in stops) - 1 if seq.finish_reason is None and stops else 0
        upto = max(seq.sent, len(seq.text) - hold)
        if d is None and upto == seq.sent and seq.finish_reason is None:
            return None
        d = d or CompletionDelta(index=seq.index)
        d.text = seq.text[seq.sent : upto]
        seq.sent = upto
        if seq.finish_reason is not None and seq.sent == len(seq.text):
            d.finish_reason = seq.finish_reason
        seq.pending = None
        return d if d.token_ids or d.text or d.finish_reason else None
