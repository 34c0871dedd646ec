"""``POST /v1/embeddings`` with the official client: equal to ``EncoderModel.encode`` on
all-MiniLM-L6-v2, batched across concurrent requests, beside a decoder or alone."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from attnlab.serving.embeddings import load_embeddings  # noqa: E402
from attnlab.serving.server import BackgroundServer, load_engine  # noqa: E402

TEXTS = ["time flies like an arrow", "fruit flies like a banana", "a b c", "héllo wörld"]


@pytest.fixture(scope="module")
def service(minilm_path: Path) -> Any:
    return load_embeddings(minilm_path, model_name="minilm")


@pytest.fixture(scope="module")
def server(service: Any, model_dir: Path) -> Iterator[BackgroundServer]:
    engine, name = load_engine(model_dir, num_blocks=32, block_size=4)
    with BackgroundServer(engine, model_name=name, embeddings=service, max_seconds=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Any:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def test_embeddings_equal_encode_in_every_input_form(service: Any, client: Any) -> None:
    ref = service.model.encode(TEXTS)  # [4, 384]
    r = client.embeddings.create(model="minilm", input=TEXTS)
    got = torch.tensor([d.embedding for d in r.data])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert [d.index for d in r.data] == [0, 1, 2, 3]
    ids = [service.model.tokenizer.encode(t).ids for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="minilm", input=TEXTS[0])
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), ref[0], atol=1e-6, rtol=0)
    by_ids = client.embeddings.create(model="minilm", input=ids)
    torch.testing.assert_close(
        torch.tensor([d.embedding for d in by_ids.data]), ref, atol=1e-6, rtol=0
    )
    single_ids = client.embeddings.create(model="minilm", input=ids[1])
    torch.testing.assert_close(
        torch.tensor(single_ids.data[0].embedding), ref[1], atol=1e-6, rtol=0
    )


def test_base64_and_dimensions(service: Any, client: Any, server: BackgroundServer) -> None:
    ref = service.model.encode(TEXTS[:2])
    raw = httpx.post(
        f"{server.base_url}/embeddings",
        json={"model": "minilm", "input": TEXTS[:2], "encoding_format": "base64"},
    ).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")
    torch.testing.assert_close(torch.from_numpy(vec.copy()), ref[1], atol=1e-6, rtol=0)
    # (the official client asks for base64 itself when no format is given, and decodes it)
    short = client.embeddings.create(model="minilm", input=TEXTS[:2], dimensions=64)
    want = torch.nn.functional.normalize(ref[:, :64], dim=-1)
    got = torch.tensor([d.embedding for d in short.data])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert got.shape == (2, 64)


def test_concurrent_requests_are_batched_and_equal(service: Any, client: Any) -> None:
    texts = [f"sentence number {i} about flies" for i in range(12)]
    ref = service.model.encode(texts)
    before = service.batches
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(texts))

    def one(i: int) -> None:
        try:
            start.wait(10)
            out[i] = client.embeddings.create(model="minilm", input=texts[i]).data[0].embedding
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    got = torch.tensor([out[i] for i in range(len(texts))])
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    assert service.batches - before < len(texts)  # some requests shared an encode call


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": ""}, "input", 400),
        ({"input": []}, "input", 400),
        ({"input": [[1, 2, 10**6]]}, "input", 400),
        ({"input": "word " * 300}, "input", 400),
        ({"input": "x", "dimensions": 0}, "dimensions", 400),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
        ({"input": "x", "truncate": True}, "truncate", 400),
        ({"input": "x", "model": "nope"}, "model", 404),
    ],
)
def test_bad_embedding_requests(
    server: BackgroundServer, body: dict, param: str, status: int
) -> None:
    r = httpx.post(f"{server.base_url}/embeddings", json={"model": "minilm"} | body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_a_lone_surrogate_is_a_400(server: BackgroundServer) -> None:
    r = httpx.post(
        f"{server.base_url}/embeddings", content=b'{"model": "minilm", "input": "\\ud800"}'
    )
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]


def test_the_decoder_beside_and_an_embeddings_only_server(
    server: BackgroundServer, client: Any, service: Any
) -> None:
    ids = {m.id for m in client.models.list().data}
    assert "minilm" in ids and len(ids) == 2
    name = next(i for i in ids if i != "minilm")
    assert client.completions.create(model=name, prompt="hi", max_tokens=2).choices
    with BackgroundServer(
        None, model_name="minilm", embeddings=load_embeddings_like(service)
    ) as alone:
        c = openai.OpenAI(base_url=alone.base_url, api_key="none", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["minilm"]
        assert len(c.embeddings.create(model="minilm", input="hi").data[0].embedding) == 384
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="minilm", prompt="hi", max_tokens=2)


def load_embeddings_like(service: Any) -> Any:
    from attnlab.serving.embeddings import EmbeddingService

    return EmbeddingService(service.model, model_name="minilm")
