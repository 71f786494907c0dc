"""infinikv's native CPU kernels against their references (``infinikv.native``), on the shapes the
bundled models use and on the edges: a row count that is not a multiple of the kernel's block,
several splits of the slots, masks, biases, every query head of a group, an empty split."""

import pytest
import torch

from infinikv import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no native kernels on this machine (not x86)")


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(576, 192), (1536, 576), (64, 98)])  # (in, out): SmolLM2's, and an odd one
def test_int4_linear_is_the_dequantized_product(shape, rows):
    torch.manual_seed(0)
    width, out = shape
    packed, scale, minimum = native.pack_int4(torch.randn(out, width))
    x = torch.randn(rows, width)
    expected = native.int4_linear_reference(x, packed, scale, minimum)
    got = torch.ops.infinikv.int4_linear(x, packed, scale, minimum)
    assert (got - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max().item())


def test_int4_layout_holds_the_grid():
    """pack then unpack gives the grid's values: q * scale + minimum, within half a step of the weight."""
    torch.manual_seed(0)
    weight = torch.randn(8, 64)
    q, scale, minimum = native.int4_grid(weight)
    dense = native.unpack_int4(*native.pack_int4(weight))
    assert torch.equal(dense, (q.float() * scale[..., None] + minimum[..., None]).reshape(8, 64))
    assert ((dense - weight).abs() <= (scale / 2 + 1e-6).repeat_interleave(32, dim=1)).all()


@pytest.mark.parametrize("shape", [(3072, 576), (7, 96)])  # SmolLM2's gate and up, an odd row count
def test_int4_dequantize_is_the_reference_unpacking(shape):
    """What a prefill chunk multiplies: the floats of ``unpack_int4`` (q * scale + minimum), up to
    rounding (the compiler may fuse the multiply and the add)."""
    torch.manual_seed(0)
    operands = native.pack_int4(torch.randn(shape) * 3)
    expected = native.unpack_int4(*operands)
    got = torch.ops.infinikv.int4_dequantize(*operands)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got - expected).abs().max() < 1e-6 * expected.abs().max()


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_linear_is_the_dequantized_product(rows):
    torch.manual_seed(0)
    weight = torch.randn(101, 576)
    scale = weight.abs().amax(1) / 127
    q = (weight / scale[:, None]).round().to(torch.int8)
    x = torch.randn(rows, 576)
    expected = native.int8_linear_reference(x, q, scale)
    assert (torch.ops.infinikv.int8_linear(x, q, scale) - expected).abs().max() < 1e-4


@pytest.mark.parametrize("length", [1, 7, 300, 2100])  # one split, several, and a tail of a vector
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (14, 2, 64)])  # SmolLM2, Gemma 3, Qwen2.5
@pytest.mark.parametrize("masked", [False, True])
def test_decode_attention_is_softmax_attention(length, heads, masked):
    torch.manual_seed(0)
    n_heads, n_kv, dim = heads
    storage = torch.randn(2, n_kv, length + 9, dim), torch.randn(2, n_kv, length + 9, dim)
    keys, values = (t[:, :, :length] for t in storage)  # a view of larger storage, as the slots give
    query = torch.randn(2, n_heads, dim)
    visible = bias = None
    if masked:
        visible = torch.rand(2, n_kv, length) > 0.4
        visible[..., 0] = True
        bias = torch.randn(2, n_kv, length)
    out, mass = torch.ops.infinikv.decode_attention(query, keys, values, visible, bias, 0.125, True)
    expected, expected_mass = native.decode_attention_reference(query, keys, values, visible, bias, 0.125, True)
    assert (out - expected).abs().max() < 1e-5
    assert (mass - expected_mass).abs().max() < 1e-5
    assert torch.allclose(mass.sum(-1), torch.full((2, n_kv), float(n_heads // n_kv)), atol=1e-4)


def test_decode_attention_with_one_mask_for_every_head_and_a_split_with_nothing_visible():
    torch.manual_seed(0)
    keys, values = torch.randn(1, 3, 1200, 64), torch.randn(1, 3, 1200, 64)
    query = torch.randn(1, 9, 64)
    visible = torch.zeros(1, 1, 1200, dtype=torch.bool)
    visible[..., :100] = True  # every later split of the slots sees nothing
    out, mass = torch.ops.infinikv.decode_attention(query, keys, values, visible, None, 0.125, True)
    expected, expected_mass = native.decode_attention_reference(query, keys, values, visible, None, 0.125, True)
    assert (out - expected).abs().max() < 1e-5 and (mass - expected_mass).abs().max() < 1e-6
    assert float(mass[..., 100:].abs().max()) == 0.0


def test_lowest_slot_picks_the_lowest_valid_newest_first():
    torch.manual_seed(0)
    scores = torch.randint(0, 4, (2, 3, 300)).float()  # many ties
    scores[0, 0, :50] = float("inf")  # never to be evicted, but before an empty slot
    valid = torch.rand(2, 3, 300) > 0.3
    valid[0, 0] = False
    valid[0, 0, :50] = True
    valid[1, 2] = False  # nothing held
    position = torch.randperm(300).expand(2, 3, 300).contiguous()
    victims, held = torch.ops.infinikv.lowest_slot(scores, valid, position)
    expected, count = native.lowest_slot_reference(scores, valid, position)
    assert torch.equal(held, count) and torch.equal(victims[:, :, 0][valid.any(-1)], expected[:, :, 0][valid.any(-1)])


@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's and Qwen's norm; Gemma's (1 + weight)
def test_rms_norm(offset):
    torch.manual_seed(0)
    x, weight = torch.randn(5, 3, 576), torch.randn(576)
    got = torch.ops.infinikv.rms_norm(x, weight, 1e-6, offset)
    assert (got - native.rms_norm_reference(x, weight, 1e-6, offset)).abs().max() < 1e-5


def test_a_build_is_kept_per_cpu_and_source():
    """The build directory's key changes with the CPU's instruction sets (AVX-512 and AVX2 machines
    each get their own build) and with the source."""
    key = native.build_key()
    assert native.build_dir().name == key
    original = native.cpu_features
    try:
        native.cpu_features = lambda: "fpu sse avx2"
        assert native.build_key() != key
    finally:
        native.cpu_features = original
    assert native.build_key() == key
