"""The compiled decode step is the model's own forward: no graph break, same tokens."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from attnlab.generation import generate
from attnlab.generation import stream as generation_stream
from attnlab.models.decoder import DecoderLM
from attnlab.models.decoder_config import DecoderConfig

TINY: dict[str, Any] = dict(
    vocab_size=40,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=32,
)
MODELS = {
    "llama": lambda: DecoderConfig.llama(**TINY),
    "mistral": lambda: DecoderConfig.mistral(**TINY, sliding_window=4),
    "gpt2": lambda: DecoderConfig.gpt2(**(TINY | {"num_key_value_heads": 4})),
    "bloom": lambda: DecoderConfig.bloom(**(TINY | {"num_key_value_heads": 4})),
}


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
def test_decode_step_has_no_graph_break(name: str, padded: bool, prefix: bool) -> None:
    torch.manual_seed(0)
    model = DecoderLM(MODELS[name]()).eval()
    ids, mask = _prompt()
    cache = model.new_cache(kind="static", max_length=12, batch_size=2)
    full = torch.ones(2, 12, dtype=torch.long)
    full[:, :6] = mask
    with torch.no_grad():
        model(ids, attention_mask=mask if padded else None, past_key_values=cache)
        pos = ((mask.cumsum(-1) - 1)[:, -1:] + 1) if padded else None
        start = torch.tensor(6)
        am = full if padded else None
        slots = torch.arange(7)[None] if prefix else None  # the prefix written so far
        backend = model.decode_backend(
            ids[:, -1:], cache=cache, start=start, attention_mask=am, key_slots=slots
        )
        explained = torch._dynamo.explain(model.decode_step)(
            ids[:, -1:],
            cache=cache,
            start=start,
            position_ids=pos,
            attention_mask=am,
            backend=backend,
            key_slots=slots,
        )
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("name", ["llama", "mistral", "bloom"])
def test_compiled_generation_reads_the_prefix_in_one_graph(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step reads only the static cache's written slots (a dynamic size), through one
    graph for the whole run (no recompile per step), with the eager loop's tokens, padded
    or not, with a sliding window (mistral) and ALiBi (bloom)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()  # dynamo's tracing and guards, the graph run eagerly
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderLM(MODELS[name]()).eval()
    ids, mask = _prompt()
    for m in (mask, None):
        eager = generate(model, ids, 12, attention_mask=m, compile=False)
        assert torch.equal(generate(model, ids, 12, attention_mask=m, compile=True), eager)
    assert counter.frame_count == 2, counter.frame_count  # padded, unpadded: one graph each


def test_compiled_generation_lays_out_the_linears_once_per_row_bucket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled path packs the float linears for its batch's row bucket before
    tracing (``lay_out_linears``), once; the tokens are those of the unpacked eager loop;
    a user's own packing for those rows is kept, and training mode is left alone."""
    from attnlab.generation.compiled import lay_out_linears
    from attnlab.models.inference import packed_linears, unpack_model

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the same step, eagerly
    torch.manual_seed(0)
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, mask = _prompt()
    eager = generate(model, ids, 12, attention_mask=mask, compile=False)
    assert not packed_linears(model)
    assert torch.equal(generate(model, ids, 12, attention_mask=mask, compile=True), eager)
    packed = packed_linears(model)
    assert len(packed) == 2 * 7 + 1 and all(p.rows == (2,) for p in packed.values())
    lay_out_linears(model, 2)  # done for this bucket: the same objects
    assert all(a is b for a, b in zip(packed_linears(model).values(), packed.values()))
    lay_out_linears(model, 1)  # a new bucket: packed again for both
    assert all(p.rows == (1, 2) for p in packed_linears(model).values())
    unpack_model(model)
    model.prepare_inference(rows=(4,))  # the user's packing, for these rows: kept
    mine = packed_linears(model)
    lay_out_linears(model, 3)
    assert packed_linears(model) == mine
    trained = DecoderLM(MODELS["llama"]())
    lay_out_linears(trained, 2)
    assert not packed_linears(trained)


@pytest.mark.parametrize("padded", [False, True])
def test_a_step_given_its_key_slots_reads_only_them(padded: bool) -> None:
    """``key_slots`` (the prefix written so far): the static cache hands over those slots
    only, and the step's logits equal those of the step that reads every slot."""
    from attnlab.cache import StaticKVCache

    torch.manual_seed(0)
    model = DecoderLM(MODELS["mistral"]()).eval()
    ids, mask = _prompt()
    full = torch.ones(2, 12, dtype=torch.long)
    full[:, :6] = mask
    am = full if padded else None
    pos = ((mask.cumsum(-1) - 1)[:, -1:] + 1) if padded else None
    got = {}
    for prefix in (False, True):
        cache = model.new_cache(kind="static", max_length=12, batch_size=2)
        with torch.no_grad():
            model(ids, attention_mask=mask if padded else None, past_key_values=cache)
            got[prefix] = model.decode_step(
                ids[:, -1:], cache=cache, start=torch.tensor(6), position_ids=pos,
                attention_mask=am, key_slots=torch.arange(7)[None] if prefix else None,
            )  # fmt: skip
    layer = cache.layers[0]
    assert isinstance(layer, StaticKVCache) and layer.k is not None
    new = torch.randn(2, 2, 1, layer.k.shape[-1])
    plan = SimpleNamespace(start=7, call=SimpleNamespace(key_shape=(2, 2, 8, 8)), k_positions=None)
    view = layer.view(new, new, plan)  # type: ignore[arg-type]
    assert view.key.shape[2] == 8 and view.key.data_ptr() == layer.k.data_ptr()  # a view
    assert torch.equal(view.key[:, :, 7:], new)
    torch.testing.assert_close(got[True], got[False], atol=1e-6, rtol=0)


def test_compile_refuses_what_it_cannot_compile() -> None:
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, _ = _prompt()
    with pytest.raises(ValueError, match="compile=True needs static caches"):
        generate(model, ids, 2, compile=True, cache=model.new_cache(max_length=8))
    dyn = DecoderLM(
        DecoderConfig.llama(**TINY, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ).eval()
    with pytest.raises(ValueError, match="dynamic NTK"):
        generate(dyn, ids, 2, compile=True)


def test_too_many_compiled_graphs_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """dynamo's recompile limit is shared by every model's decode step: attnlab raises its
    own limit, and reaching that one is a RuntimeError that says what to do."""
    gen = importlib.import_module("attnlab.generation.compiled")
    monkeypatch.setattr(gen, "COMPILED_STEP_GRAPHS", 1)
    torch.manual_seed(0)
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, _ = _prompt()
    with pytest.raises(RuntimeError, match="compile=False"):  # a second batch size: graph 2
        for rows in (2, 1):
            generate(model, ids[:rows], 2, compile=True)


# ----------------------------------------------------------- compile=None: the default path

LONG: dict[str, Any] = TINY | {"max_position_embeddings": 256}


def test_default_compiles_long_runs_only_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnlab.generation.compiled import AUTO_COMPILE_MIN_NEW_TOKENS, compile_decision

    model = DecoderLM(DecoderConfig.llama(**LONG)).eval()
    n = AUTO_COMPILE_MIN_NEW_TOKENS
    assert compile_decision(model, n).compile
    short = compile_decision(model, n - 1)
    assert not short.compile and f"{n - 1} new tokens" in short.reason
    assert not compile_decision(model, n, compile=False).compile
    assert not compile_decision(model, n, kv_dtype="int8").compile
    assert not compile_decision(model, n, cache=model.new_cache(max_length=8)).compile
    assert not compile_decision(model.train(), n).compile
    model.eval()
    early = compile_decision(model, n, eos_token_id=2)  # an answer may end after a token
    assert not early.compile and "eos_token_id" in early.reason
    dyn = DecoderLM(
        DecoderConfig.llama(**LONG, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    ).eval()
    assert "dynamic NTK" in compile_decision(dyn, n).reason
    with pytest.raises(ValueError, match="dynamic NTK"):
        compile_decision(dyn, n, compile=True)
    monkeypatch.setattr("shutil.which", lambda name: None)  # a machine with no C++ compiler
    bare = compile_decision(model, n)
    assert not bare.compile and "C++ compiler" in bare.reason
    with pytest.raises(TypeError, match="compile must be"):
        generate(model, _prompt()[0], 2, compile="yes")  # type: ignore[arg-type]


def test_default_generate_compiles_and_reports_the_compile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long run takes the compiled step without being asked: same tokens, compile timed.

    ``torch.compile`` is replaced by the identity here (inductor's own compile of this
    step is tested above and in the parity tests; a cold one costs a minute on 2 loaded
    cores): what is checked is that the default takes the static-cache step and reports."""
    from attnlab.generation.compiled import (
        AUTO_COMPILE_MIN_NEW_TOKENS,
        compile_decision,
        compile_report,
    )

    compiled: list[Any] = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or fn)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.llama(**LONG)).eval()
    ids, mask = _prompt()
    n = AUTO_COMPILE_MIN_NEW_TOKENS
    got = generate(model, ids, n, attention_mask=mask)
    assert torch.equal(got, generate(model, ids, n, attention_mask=mask, compile=False))
    (record,) = compile_report(model)
    assert (record.batch_size, record.slots) == (2, 256) and record.seconds > 0
    assert compiled == [{"fullgraph": True, "dynamic": False}]
    # once the graph exists (batch 2, 256 slots), a short run with an EOS token reuses it
    again = compile_decision(model, 9, eos_token_id=3, batch_size=2, prompt_length=130)
    assert again.compile and "exists" in again.reason


def test_the_static_cache_is_kept_between_calls_unzeroed_and_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second call of the same shape reuses the first call's static cache without
    zeroing it; after a longer, padded first call (its keys lie in slots the second call
    never writes, and in slots that are padding now) it gives the tokens of a fresh call."""
    from attnlab.generation.compiled import release_static_cache

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the same step, eagerly
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.llama(**LONG)).eval()
    ids, mask = _prompt()
    generate(model, ids, 200, attention_mask=mask, compile=True)  # 206 of 256 slots
    kept = model.__dict__["_static_cache"]
    stale = kept.layers[0].k[:, :, 140:206].clone()
    assert bool(stale.abs().sum() > 0)
    short, short_mask = ids[[1, 0], 1:], mask[[1, 0], 1:]  # the padded row is row 0 now
    got = generate(model, short, 130, attention_mask=short_mask, compile=True)  # 135 slots
    assert model.__dict__["_static_cache"] is kept  # reused, not reallocated
    assert torch.equal(got, generate(model, short, 130, attention_mask=short_mask, compile=False))
    release_static_cache(model)
    assert torch.equal(got, generate(model, short, 130, attention_mask=short_mask, compile=True))
    assert model.__dict__["_static_cache"] is not kept  # a fresh one, zeroed
    # a stream stopped early keeps its cache (it may hold a partial step): none is kept
    release_static_cache(model)
    next(iter(generation_stream(model, ids, 130, attention_mask=mask, compile=True)))
    assert "_static_cache" not in model.__dict__


def test_a_failed_automatic_compile_warns_and_decodes_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """compile=None chose to compile, so a failure is not the user's: a warning, the same
    step run eagerly on the static cache, the same tokens. compile=True raises instead."""
    gen = importlib.import_module("attnlab.generation.generate")

    def broken(model: Any) -> Any:
        def step(*args: Any, **kwargs: Any) -> Any:
            raise torch._dynamo.exc.TorchDynamoException("no graph today")

        return step

    monkeypatch.setattr(gen, "compiled_decode_step", broken)
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.llama(**LONG)).eval()
    ids, mask = _prompt()
    with caplog.at_level("WARNING", logger="attnlab.generation"):
        got = generate(model, ids, 128, attention_mask=mask)
    assert "generate continues eagerly" in caplog.text
    assert torch.equal(got, generate(model, ids, 128, attention_mask=mask, compile=False))
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        generate(model, ids, 128, attention_mask=mask, compile=True)


@pytest.mark.parametrize("spec", ["int8:g32", "int4"])
def test_quantized_decode_step_has_no_graph_break(spec: str) -> None:
    """Quantized layers inside the compiled step: no graph break (kernel choice read from
    what was measured eagerly, never timed or a context variable read inside the graph)."""
    from attnlab.models.quantize import measure_kernels, quantize_model

    torch.manual_seed(0)
    model = quantize_model(DecoderLM(DecoderConfig.llama(**LONG | {"hidden_size": 64})), spec)
    model.eval()
    ids = torch.randint(1, 40, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(kind="static", max_length=16, batch_size=1)
    choices = measure_kernels(model, 1)
    assert {c.how for c in choices.values()} == {"measured"}
    with torch.no_grad():
        model(ids, past_key_values=cache)
        start = torch.tensor(6)
        backend = model.decode_backend(ids[:, -1:], cache=cache, start=start)
        explained = torch._dynamo.explain(model.decode_step)(
            ids[:, -1:], cache=cache, start=start, position_ids=None, attention_mask=None,
            backend=backend,
        )  # fmt: skip
    assert explained.graph_break_count == 0, explained.break_reasons


def test_warm_steps_skip_guards_and_a_real_change_still_recompiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's first compiled step evaluates every guard, its later steps only those that
    tell graphs apart (``warm_stance``); what changes between runs still recompiles (a
    batch size, a swapped module), another model of the same shape gets its own tokens,
    and every run's tokens are the eager loop's."""
    from torch._dynamo.testing import CompileCounter

    from attnlab.generation import compiled as compiled_mod

    gen_mod = importlib.import_module("attnlab.generation.generate")
    counter = CompileCounter()
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    stances: list[bool] = []

    def spy(warm: bool) -> Any:
        stances.append(warm)
        return compiled_mod.warm_stance(warm)

    monkeypatch.setattr(gen_mod, "warm_stance", spy)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DecoderLM(MODELS["llama"]()).eval()
    ids, _ = _prompt()

    def check(m: DecoderLM, x: torch.Tensor, graphs: int) -> None:
        stances.clear()
        got = generate(m, x, 10, compile=True)
        assert torch.equal(got, generate(m, x, 10, compile=False))
        assert stances == [False] + [True] * 8  # 9 steps after the prompt
        assert counter.frame_count == graphs, counter.frame_count

    check(model, ids, 1)
    check(model, ids, 1)  # the same shapes: the graph again
    monkeypatch.setattr(compiled_mod, "SKIP_WARM_GUARDS", False)
    check(model, ids, 1)  # every guard on every step: they pass, no recompile
    monkeypatch.setattr(compiled_mod, "SKIP_WARM_GUARDS", True)
    check(model, ids[:1], 2)  # another batch size: a new graph
    before = generate(model, ids, 10, compile=False)
    model.layers[0].self_attn_norm.eps = 1e3  # a constant the graph holds: a guard
    check(model, ids, 3)  # recompiled at the run's first step: the new eps's tokens
    assert not torch.equal(generate(model, ids, 10, compile=False), before)
    torch.manual_seed(1)
    other = DecoderLM(MODELS["llama"]()).eval()  # same shapes, other weights
    got = generate(other, ids, 10, compile=True)
    assert torch.equal(got, generate(other, ids, 10, compile=False))
    with compiled_mod.warm_stance(True):
        assert torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()
    assert not torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()
    monkeypatch.setattr(compiled_mod, "SKIP_WARM_GUARDS", False)
    with compiled_mod.warm_stance(True):
        assert not torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance()
