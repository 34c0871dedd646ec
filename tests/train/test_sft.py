"""SFT data: assistant-only labels from the chat template, packing without leaks, layouts."""

from __future__ import annotations

import json

import pytest
import torch

import attnlab
from attnlab.functional.losses import IGNORE_INDEX
from attnlab.train.chat import assistant_spans, encode_chat, read_chat_jsonl
from attnlab.train.sft import SFTData, choose_layout, pack_examples, packed_batch, padded_batch
from attnlab.train.trainer import model_inputs

CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does textwrap do?"},
        {"role": "assistant", "content": "It wraps and fills text."},
        {"role": "user", "content": "And dedent?"},
        {"role": "assistant", "content": "It removes common leading whitespace."},
    ],
    [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
    [
        {"role": "user", "content": "width?"},
        {"role": "assistant", "content": "The line width, 70 by default."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You are welcome."},
    ],
]


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(chat_model_dir))


@pytest.fixture(scope="module")
def model(chat_model_dir):
    return attnlab.from_hf(chat_model_dir).float()


def test_assistant_tokens_are_exactly_the_replies_and_their_end_of_turn(tok):
    msgs = CONVERSATIONS[0]
    text, spans = assistant_spans(tok, msgs)
    assert [text[a:b] for a, b in spans] == [
        "It wraps and fills text.<|im_end|>\n",
        "It removes common leading whitespace.<|im_end|>\n",
    ]
    ex = encode_chat(tok, msgs)
    marked = [t for t, m in zip(ex.input_ids, ex.assistant) if m]
    assert tok.decode(marked) == "".join(text[a:b] for a, b in spans)
    assert not any(ex.assistant[:5])  # the system turn and the header are not targets


def test_a_template_that_rewrites_earlier_turns_is_refused(tok, chat_model_dir):
    transformers = pytest.importorskip("transformers")
    odd = transformers.AutoTokenizer.from_pretrained(str(chat_model_dir))
    odd.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="does not render conversations incrementally"):
        assistant_spans(odd, CONVERSATIONS[0])
    odd.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        assistant_spans(odd, CONVERSATIONS[0])


def test_assistant_only_loss_equals_float64_reference(tok, model):
    examples = [encode_chat(tok, m) for m in CONVERSATIONS]
    batch = padded_batch(examples, [0, 1, 2], tok.pad_token_id)
    out = model(**model_inputs(batch, "decoder"))
    logits = out.logits.double()[:, :-1]
    targets = batch.labels[:, 1:]
    keep = targets != IGNORE_INDEX
    assert int(keep.sum()) == batch.num_targets
    logp = torch.log_softmax(logits, -1)
    nll = -logp.gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    want = nll[keep].sum() / keep.sum()
    torch.testing.assert_close(out.loss.double(), want, atol=1e-5, rtol=1e-5)
    # and the targets are the assistant's tokens, shifted: nothing else counts
    for r, ex in enumerate(examples):
        n = len(ex)
        assert keep[r, : n - 1].tolist() == ex.assistant[1:n]


def _per_example(model, batch, spans):
    """Sum of token losses of each example in a forward of ``batch`` (float64)."""
    logits = model(**model_inputs(batch, "decoder")).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1)
    t = batch.labels[:, 1:]
    nll = -logp.gather(-1, t.clamp_min(0)[..., None])[..., 0] * (t != IGNORE_INDEX)
    return [nll[r, a : b - 1].sum() for r, a, b in spans]


def test_packed_rows_give_each_example_its_own_loss_and_gradient(tok, model):
    examples = [encode_chat(tok, m) for m in CONVERSATIONS]
    lengths = [len(e) for e in examples]
    max_len = sum(lengths) + 7
    rows = pack_examples(lengths, max_len)
    assert rows == [sorted(range(3), key=lambda i: -lengths[i])]
    batch = packed_batch(examples, rows, max_len, tok.pad_token_id)
    spans, at = [], 0
    for i in rows[0]:
        spans.append((0, at, at + lengths[i]))
        at += lengths[i]
    model.zero_grad()
    packed = _per_example(model, batch, spans)
    sum(packed).backward()
    g_packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    alone = []
    model.zero_grad()
    for i in rows[0]:
        one = padded_batch(examples, [i], tok.pad_token_id)
        loss = _per_example(model, one, [(0, 0, lengths[i])])[0]
        loss.backward()
        alone.append(loss.detach())
    for got, want in zip(packed, alone):
        torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(g_packed[n], p.grad, atol=1e-5, rtol=1e-4, msg=n)
    assert batch.position_ids[0, spans[1][1]] == 0  # positions restart per example


def test_layouts_and_the_cost_models_choice(tok, model):
    examples = [encode_chat(tok, m) for m in CONVERSATIONS] * 4
    lengths = [len(e) for e in examples]
    choice = choose_layout(model, lengths, max_len=128, batch_size=4)
    assert choice.layout in ("packed", "padded") and choice.reason.startswith(choice.layout)
    assert choice.layout == min(choice.flops, key=choice.flops.get)
    assert 0 <= choice.padding_share["packed"] < 1 and 0 <= choice.padding_share["padded"] < 1
    forced = choose_layout(model, lengths, max_len=128, batch_size=4, layout="padded")
    assert forced.layout == "padded" and "was asked for" in forced.reason
    for layout in ("packed", "padded"):
        data = SFTData(
            examples[:9], examples[9:], max_len=128, layout=layout, batch_size=4,
            pad_token_id=tok.pad_token_id, vocab_size=len(tok),
        )  # fmt: skip
        b = data.train_batch(0, 4)
        assert b.num_targets == int((b.labels[:, 1:] != IGNORE_INDEX).sum()) > 0
        assert data.eval_batches(10, 4)
        again = data.train_batch(0, 4)  # the stream is a function of the index
        assert torch.equal(b.input_ids, again.input_ids)
    with pytest.raises(ValueError, match="layout must be one of"):
        choose_layout(model, lengths, max_len=128, batch_size=4, layout="dense")


def test_jsonl_rows_and_errors(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = [{"messages": CONVERSATIONS[1]}, {"prompt": "2+2?", "completion": "4"}]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_chat_jsonl(p)
    assert got[1] == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    p.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_chat_jsonl(p)
    p.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"d.jsonl:1: expected \{'messages'"):
        read_chat_jsonl(p)
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant message"):
        read_chat_jsonl(p)
    with pytest.raises(ValueError, match="does not exist"):
        read_chat_jsonl(tmp_path / "missing.jsonl")


def test_the_stdlib_instruction_set_is_well_formed_and_fixed():
    from attnlab.train.instructions import stdlib_docstring_rows

    rows = stdlib_docstring_rows()
    assert len(rows) > 100 and rows == stdlib_docstring_rows()
    for r in rows[:20]:
        user, assistant = r["messages"]
        assert user["role"] == "user" and "`" in user["content"]
        assert assistant["role"] == "assistant" and 40 <= len(assistant["content"]) <= 400
