"""quant: round-trip error bounds on real K/V, packed bytes, and the packing itself."""

import pytest
import torch

from infinikv import make_policy
from infinikv.errors import InfinikvError
from infinikv.kv.quant import dequantize, pack, quantize, unpack


@pytest.fixture(scope="module")
def real_kv(real, emma_ids):
    """The K and V of layers 0, 10 and 20 of the bundled model after 200 tokens of Emma."""
    model, _ = real
    cache = make_policy("full").make_cache(model)
    with torch.inference_mode():
        model(input_ids=emma_ids, cache=cache, use_cache=True)
    return [
        t[:, :, : layer.slots.n].clone() for layer in cache.layers[::10] for t in (layer.slots.keys, layer.slots.values)
    ]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_round_trip_within_half_a_step_on_real_kv(real_kv, bits):
    """Min-max rounding: each value within scale / 2 of the original (scale = range / (2^bits - 1))."""
    for x in real_kv:
        packed, scale, low = quantize(x, bits, 64)
        assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8 and scale.shape[-1] == 1
        error = (dequantize(packed, scale, low, bits) - x).abs()
        half_step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2**bits - 1) / 2
        assert bool((error <= half_step * (1 + 1e-5) + 1e-6).all())
        # and not trivially: the error uses a good part of that room
        assert float(error.max()) > 0.3 * float(half_step.max())


def test_fewer_bits_lose_more(real_kv):
    errors = []
    for bits in (8, 4, 2):
        x = real_kv[2]
        packed, scale, low = quantize(x, bits, 64)
        errors.append(float((dequantize(packed, scale, low, bits) - x).abs().mean() / x.abs().mean()))
    assert errors[0] < 0.02 and errors[0] < errors[1] < errors[2]


@torch.inference_mode()
def test_bytes_held_at_4_bits_are_an_eighth_plus_scales(real, emma_ids):
    model, _ = real
    full, quant = make_policy("full").make_cache(model), make_policy("quant", bits=4).make_cache(model)
    for cache in (full, quant):
        model(input_ids=emma_ids[:, :100], cache=cache, use_cache=True)
    # per token, layer and KV head: K and V of 64 fp32 values (512 bytes) become 2 x 32 bytes of
    # packed 4-bit values plus 2 x (scale + minimum) in fp32 (16 bytes): 80 / 512 = 1/8 + 1/32
    assert full.held_bytes() == 100 * 30 * 3 * 512
    assert quant.held_bytes() == 100 * 30 * 3 * 80
    assert quant.held_bytes() / full.held_bytes() == pytest.approx(1 / 8 + 1 / 32)
    assert quant.layers[0].slots.keys.dtype == torch.uint8 and quant.layers[0].slots.keys.shape[-1] == 32


def test_pack_unpack_round_trip():
    for bits in (8, 4, 2):
        q = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
        packed = pack(q, bits)
        assert packed.shape == (3, 5, 64 * bits // 8) and torch.equal(unpack(packed, bits).to(torch.uint8), q)


def test_constant_group_round_trips_exactly():
    x = torch.full((2, 64), 3.25)
    packed, scale, low = quantize(x, 4, 64)
    assert torch.equal(dequantize(packed, scale, low, 4), x)


@pytest.mark.parametrize("bits", [0, 3, 16])
def test_bad_bit_width(bits):
    with pytest.raises(InfinikvError, match="bits"):
        make_policy("quant", bits=bits)
