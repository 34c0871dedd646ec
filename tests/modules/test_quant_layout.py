"""One weight layout per quantized layer (rows, or q8tile's tiles read back exactly), and
quantized layers joined along their output features."""

from __future__ import annotations

import pytest
import torch

from attnlab.backends import qmatmul_cpu as qc
from attnlab.backends.qmatmul import use_kernel
from attnlab.modules.quant_concat import concat_quant_linears
from attnlab.modules.quant_linear import Int4Linear, Int8Linear, QuantEmbedding, QuantLinear

tiled_only = pytest.mark.skipif(
    qc.tiled_unavailable() is not None, reason=str(qc.tiled_unavailable())
)


def _layer(kind: str, n: int, k: int = 128, group: int = 32, seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    cls = Int8Linear if kind == "int8" else Int4Linear
    layer = cls.from_float(lin, group_size=group, compute="int8")
    if kind == "int4":  # GGUF's float16 scales and minimums: the tiles keep them as float16
        layer.set_weights(layer.levels(), layer.scales.half().float(), layer.mins.half().float())
    return layer


def _rows(layer: QuantLinear) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in layer.state_dict().items()}


@tiled_only
@pytest.mark.parametrize(
    ("kind", "n", "group"), [("int8", 40, 32), ("int4", 48, 64), ("int4", 40, 32)]
)
def test_the_tiled_layout_replaces_the_rows_and_reads_them_back_exactly(
    kind: str, n: int, group: int
) -> None:
    layer = _layer(kind, n, group=group)
    before, w = _rows(layer), layer.dequantize()
    rows_bytes = layer.weight_nbytes
    with use_kernel("q8tile"):
        y = layer(torch.randn(3, 128))
    assert layer.layout == "tiled" and not list(layer.buffers(recurse=False))
    assert layer.resident_nbytes == layer.weight_nbytes  # one layout, no second copy
    assert layer.weight_nbytes < 1.6 * rows_bytes  # (the tiles' padding and per-block scales)
    after = layer.state_dict()
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype and torch.equal(after[name], t), name
    assert torch.equal(layer.dequantize(), w)
    ids = torch.tensor([[0, n - 1], [17, 5]])
    emb = QuantEmbedding(table=layer)
    assert torch.equal(emb(ids), w[ids])
    # a row kernel, named, builds its own form from the tiles: the same numbers
    with use_kernel("q8dot"):
        assert torch.allclose(layer(torch.ones(1, 128)), w.sum(1)[None], rtol=1e-2, atol=1e-2)
    assert layer.layout == "tiled" and torch.isfinite(y).all()


@tiled_only
def test_loading_setting_and_casting_bring_the_rows_back() -> None:
    layer = _layer("int8", 32)
    saved, x = _rows(layer), torch.randn(2, 128)
    with use_kernel("q8tile"):
        y = layer(x)
    fresh = _layer("int8", 32, seed=1)
    with use_kernel("q8tile"):
        fresh(x)
    fresh.load_state_dict(saved)  # into a tiled layer: rows back, then loaded
    assert fresh.layout == "rows"
    with use_kernel("q8tile"):
        assert torch.equal(fresh(x), y)
    fresh.to("cpu")  # a move that moves nothing keeps the tiles
    assert fresh.layout == "tiled"
    fresh.half()  # a cast is done on the rows (the tiles' float16 scales included)
    assert fresh.layout == "rows" and fresh.scales.dtype == torch.float16
    with use_kernel("q8tile"):
        fresh(x)
    fresh.double()
    assert fresh.layout == "rows" and fresh.scales.dtype == torch.float64
    fresh.set_weights(saved["qweight"], saved["scales"])
    assert torch.equal(fresh.qweight, saved["qweight"])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tile_first", [False, True])
def test_concatenated_layers_compute_each_layers_outputs(kind: str, tile_first: bool) -> None:
    if tile_first and qc.tiled_unavailable() is not None:
        pytest.skip(str(qc.tiled_unavailable()))
    parts = [_layer(kind, n, seed=i) for i, n in enumerate((64, 32, 32))]  # q, k, v
    parts[1].bias = torch.nn.Parameter(torch.randn(32))
    x = torch.randn(5, 128)
    kernel = "q8tile" if tile_first else "q8dequant"
    with use_kernel(kernel):
        want = torch.cat([p(x) for p in parts], dim=-1)
    joined = concat_quant_linears(parts)
    assert joined.out_features == 128 and joined.layout == parts[0].layout
    for name in ("qweight", "scales") + (("mins",) if kind == "int4" else ()):
        assert torch.equal(
            joined.row_tensor(name), torch.cat([p.row_tensor(name) for p in parts])
        ), name
    assert joined.bias is not None and torch.equal(joined.bias[64:96], parts[1].bias.detach())
    assert not joined.bias[:64].any()
    with use_kernel(kernel):
        got = joined(x)
    if tile_first:  # each output feature is one tile's own sum: bit for bit
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_concatenation_refuses_layers_of_different_kinds() -> None:
    with pytest.raises(ValueError, match="at least one"):
        concat_quant_linears([])
    with pytest.raises(ValueError, match="in_features=64"):
        concat_quant_linears([_layer("int8", 16), _layer("int8", 16, k=64)])
    with pytest.raises(ValueError, match="Int4Linear"):
        concat_quant_linears([_layer("int8", 16), _layer("int4", 16)])
    with pytest.raises(TypeError, match="Linear"):
        concat_quant_linears([_layer("int8", 16), torch.nn.Linear(128, 16)])  # type: ignore[list-item]
