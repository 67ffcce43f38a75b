"""forerun's native products over GGUF blocks: every path against the scalar reference bit for bit,
rows independent of their batch, the product against gguf-py's dequantized weights, and what happens
where the library cannot be built.

Bit equality, never closeness, wherever the design promises it: greedy speculation equals plain
decoding only if every row comes out exactly as it would alone, on whatever path the CPU takes.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forerun import native
from forerun.base.errors import ForerunError

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.problem()}")

SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TYPES = list(native.TYPES)  # every type the kernels read
K_QUANTS = [t for t in TYPES if t.endswith("_K")]


def random_blocks(kind: str, n: int, k: int, seed: int, magnitude: float = 0.01, zero_every: int = 0) -> np.ndarray:
    """n rows of k inputs of GGUF blocks with random quants and scales (f16 factors kept finite);
    `zero_every`: every that-many-th block all zero, scales included."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    count = raw.shape[0]

    def f16(signed: bool) -> np.ndarray:
        values = rng.standard_normal(count) * magnitude * np.exp(rng.uniform(-3, 3, count))
        return (
            np.clip(values if signed else np.abs(values), -6e4, 6e4).astype(np.float16).view(np.uint8).reshape(count, 2)
        )

    if kind in ("Q4_K", "Q5_K"):
        raw[:, 0:2], raw[:, 2:4] = f16(False), f16(False)
    elif kind == "Q6_K":
        raw[:, 208:210] = f16(True)
    else:  # legacy blocks: d first, m (Q4_1, Q5_1) next
        raw[:, 0:2] = f16(True)
        if kind in ("Q4_1", "Q5_1"):
            raw[:, 2:4] = f16(True)
    if zero_every:
        raw[::zero_every] = 0
    return raw.reshape(n, -1)


def dequantized(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k).astype(np.float64)


def packed_of(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    return native.repack(native.TYPES[kind], torch.from_numpy(np.ascontiguousarray(raw)).view(-1), n, k)


def product(
    kind: str, packed: torch.Tensor, n: int, k: int, x: torch.Tensor, path: str, threads: int = 1
) -> torch.Tensor:
    type_id = native.TYPES[kind]
    act = native.quantize(x, native.block_inputs(type_id), kernel_path=path)
    y = torch.full((x.shape[0], n), float("nan"))
    return native.matmul(type_id, packed, n, k, act, x.shape[0], y, kernel_path=path, threads=threads)


def rows_of(seed: int, m: int, k: int) -> torch.Tensor:
    """Rows with the awkward cases: magnitudes over twelve decades, an outlier column, a zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-6, 6, m)[torch.randperm(m, generator=gen)][:, None]
    x[:, int(torch.randint(k, (1,), generator=gen))] *= 50
    if m > 2:
        x[1] = 0.0
    return x


@SLOW
@given(
    kind=st.sampled_from(TYPES),
    m=st.integers(1, 20),
    n=st.integers(1, 70),
    blocks=st.integers(1, 3),
    seed=st.integers(0, 10_000),
    magnitude=st.sampled_from([1e-6, 0.01, 30.0]),
    zero_every=st.sampled_from([0, 2, 3]),
)
def test_every_path_gives_the_scalar_references_bits(kind, m, n, blocks, seed, magnitude, zero_every) -> None:
    k = blocks * native.block_inputs(native.TYPES[kind])
    raw = random_blocks(kind, n, k, seed, magnitude, zero_every)
    packed = packed_of(kind, raw, n, k)
    x = rows_of(seed, m, k)
    reference = product(kind, packed, n, k, x, "scalar")
    assert torch.isfinite(reference).all()
    for path in native.paths()[1:]:
        for threads in (1, 2):
            assert torch.equal(product(kind, packed, n, k, x, path, threads), reference), (path, threads)


def extreme_blocks(kind: str, n: int, k: int, fill: int, scale: int) -> np.ndarray:
    """Blocks whose quants are all `fill` (0x00: every weight at its format's lowest level, 0xFF:
    its highest), the integer sub-scales packed from the byte `scale`, float factors 1.0."""
    qtype = gguf.GGMLQuantizationType[kind]
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.full((n * k // size, nbytes), fill, dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        raw[:, 4:16] = scale
        raw[:, 0:2], raw[:, 2:4] = one, one
    elif kind == "Q6_K":
        raw[:, 192:208] = scale
        raw[:, 208:210] = one
    else:
        raw[:, 0:2] = one
        if kind in ("Q4_1", "Q5_1"):
            raw[:, 2:4] = one
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", TYPES)
def test_the_largest_integer_sums_give_the_scalar_references_bits(kind) -> None:
    # The vector paths add a few dot products in 16-bit halves of a lane before a scale multiplies
    # them (Q4_K's half units, Q6_K's pairs of k-groups): the extremes of weights, scales and
    # inputs (every input quantized to +127 or -127) must still fit them.
    n, k, m = 16, 2 * native.block_inputs(native.TYPES[kind]), 4
    signs = torch.ones(m, k)
    signs[1] = -1.0
    signs[2, ::2] = -1.0
    signs[3, 1::2] = -1.0
    for fill in (0x00, 0xFF):
        for scale in (0x00, 0x7F, 0x80, 0xFF):
            packed = packed_of(kind, extreme_blocks(kind, n, k, fill, scale), n, k)
            reference = product(kind, packed, n, k, signs, "scalar")
            for path in native.paths()[1:]:
                assert torch.equal(product(kind, packed, n, k, signs, path), reference), (path, fill, scale)


@SLOW
@given(kind=st.sampled_from(TYPES), m=st.integers(2, 17), seed=st.integers(0, 10_000))
def test_a_rows_result_is_the_same_alone_or_in_any_batch(kind, m, seed) -> None:
    n, k = 37, 2 * native.block_inputs(native.TYPES[kind])
    packed = packed_of(kind, random_blocks(kind, n, k, seed), n, k)
    x = rows_of(seed, m, k)
    for path in native.paths():
        batch = product(kind, packed, n, k, x, path)
        for i in range(m):
            assert torch.equal(batch[i], product(kind, packed, n, k, x[i : i + 1], path)[0]), (path, i, m)


@pytest.mark.parametrize("kind", TYPES)
def test_the_product_is_the_dequantized_weights_times_the_quantized_rows(kind) -> None:
    # The integer sums are exact and each block's float factors round once each: against float64
    # over the same (dequantized) numbers the product is within float32 rounding.
    n, k, m = 40, 3 * native.block_inputs(native.TYPES[kind]), 5
    raw = random_blocks(kind, n, k, seed=1)
    x = rows_of(2, m, k)
    got = product(kind, packed_of(kind, raw, n, k), n, k, x, native.path()).double().numpy()
    block = native.block_inputs(native.TYPES[kind])
    xq = np.zeros((m, k))
    for r in range(m):
        for b in range(k // block):
            v = x[r, b * block : (b + 1) * block].numpy()
            peak = np.float32(np.abs(v).max())
            inv = np.float32(127.0) / peak if peak > 0 else np.float32(0.0)
            levels = np.clip(np.rint(v * inv), -128, 127)
            xq[r, b * block : (b + 1) * block] = levels * np.float64(np.float32(peak / np.float32(127.0)))
    want = xq @ dequantized(kind, raw, n, k).T
    scale = np.abs(xq).max(1, keepdims=True) * np.abs(dequantized(kind, raw, n, k)).sum(1)[None] + 1e-30
    assert np.abs(got - want).max() / scale.max() < 1e-6


@pytest.mark.parametrize("kind", TYPES)
def test_the_product_is_close_to_the_float_product(kind) -> None:
    # Activations quantized per block to int8 cost about a percent against float rows here (random
    # blocks' large mins make every weight of a sub-block share an offset, which adds the rows'
    # rounding up coherently; a model's weights, centred on zero, fare better).
    n, k = 64, 2 * native.block_inputs(native.TYPES[kind])
    raw = random_blocks(kind, n, k, seed=3, magnitude=0.05)
    for seed in range(5):
        x = torch.randn(6, k, generator=torch.Generator().manual_seed(seed))
        got = product(kind, packed_of(kind, raw, n, k), n, k, x, native.path()).double().numpy()
        want = x.double().numpy() @ dequantized(kind, raw, n, k).T
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.02


@pytest.mark.parametrize("kind", TYPES)
def test_looked_up_rows_are_gguf_pys_dequantized_rows_exactly(kind) -> None:
    n, k = 9, 2 * native.block_inputs(native.TYPES[kind])
    raw = random_blocks(kind, n, k, seed=4)
    rows = torch.tensor([3, 0, 8, 3])
    got = native.dequantize_rows(native.TYPES[kind], torch.from_numpy(raw).view(-1), k, rows)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(n, k)[rows.numpy()]
    assert np.array_equal(got.numpy(), want.astype(np.float32))


def test_a_row_the_tensor_lacks_is_an_index_error_naming_it() -> None:
    from forerun.models.gguf_format import GGUFEmbedding

    n, k = 9, 256
    raw = torch.from_numpy(random_blocks("Q4_K", n, k, seed=4)).view(-1)
    for bad in (9, -1):
        with pytest.raises(IndexError, match=f"row {bad} out of range \\[0, 9\\)"):
            native.dequantize_rows(native.TYPES["Q4_K"], raw, k, torch.tensor([0, bad, 2]))
    embedding = GGUFEmbedding(native.TYPES["Q4_K"], raw.view(n, -1), n, k)
    first = native.dequantize_rows(native.TYPES["Q4_K"], raw, k, torch.tensor([0]))[0]
    assert torch.equal(embedding(torch.tensor([[8, 0]]))[0, 1], first)
    with pytest.raises(IndexError, match="token id 10 out of range"):
        embedding(torch.tensor([[1, 10]]))


def test_a_float16_cache_entry_is_rounded_as_torch_rounds() -> None:
    # Nearest, ties to even, over a sweep of float32 bit patterns: subnormal halves, the overflow to
    # infinity at 65520, signed zeros, infinities and NaNs (quieted, the payload's top bits kept).
    bits = torch.arange(-(2**31), 2**31, 4099, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14, -0.0, 1 + 2.0**-11])
    x = torch.cat([bits.view(torch.float32), edges, -edges])
    assert torch.equal(native.to_half(x).view(torch.int16), x.half().view(torch.int16))


@SLOW
@given(
    n=st.integers(1, 200),
    seed=st.integers(0, 10_000),
    ties=st.booleans(),
    specials=st.lists(st.sampled_from([float("nan"), float("inf"), float("-inf"), -0.0, 0.0]), max_size=3),
)
def test_every_path_picks_torchs_argmax(n, seed, ties, specials) -> None:
    # torch's: the first of several largest values, a NaN the largest (the first NaN), rows of any
    # length (the vector paths' tails), rows that are not contiguous with each other.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, n + 5, generator=gen)[:, :n]
    if ties:
        x = x.round()  # many equal values, the largest among them
    for i, value in enumerate(specials):
        x[i % 3, int(torch.randint(n, (1,), generator=gen))] = value
    expected = x.argmax(-1)
    for path in native.paths():
        assert torch.equal(native.argmax(x, kernel_path=path), expected), path
        assert torch.equal(native.argmax(x[1], kernel_path=path), expected[1]), path


def test_argmax_of_a_vocabulary_row_and_of_what_the_kernels_do_not_read() -> None:
    x = torch.full((2, 151_936), -1.0)
    x[0, 151_935], x[1, 77_777], x[1, 100_000] = 5.0, 3.0, 3.0  # last place; the first of two
    for path in native.paths():
        assert native.argmax(x, kernel_path=path).tolist() == [151_935, 77_777]
    assert torch.equal(native.argmax(x.double()), x.argmax(-1))  # other dtypes: torch's own
    assert native.argmax(torch.tensor([[0.5, 2.0], [3.0, 1.0]]).t()).tolist() == [1, 0]  # columns: torch's own


@SLOW
@given(n=st.integers(2, 300), seed=st.integers(0, 10_000), ties=st.booleans(), scale=st.sampled_from([0.1, 3.0, 40.0]))
def test_softmax_top2_is_the_softmax_two_likeliest_the_same_bits_on_every_path(n, seed, ties, scale) -> None:
    # The likeliest is torch's argmax, the second the first largest of the others; their
    # probabilities torch's softmax's within float rounding, and every path's bits the scalar's.
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * scale
    if ties:
        x = x.round()  # the largest shared, or the second
    probs = x.softmax(-1)
    first = int(x.argmax())
    rest = x.clone()
    rest[first] = -float("inf")
    second = int(rest.argmax())
    tops = {native.softmax_top2(x, kernel_path=path) for path in native.paths()}
    assert len(tops) == 1, tops
    top = tops.pop()
    assert (top.first, top.second) == (first, second)
    assert top.p_first == pytest.approx(float(probs[first]), rel=1e-5, abs=1e-30)
    assert top.p_second == pytest.approx(float(probs[second]), rel=1e-5, abs=1e-30)


def test_softmax_top2_of_a_vocabulary_row_and_where_torch_computes_it() -> None:
    x = torch.full((151_936,), -30.0)
    x[151_935], x[7], x[100_000] = 4.0, 2.0, 2.0  # the likeliest last; the first of two seconds
    for path in native.paths():
        top = native.softmax_top2(x, kernel_path=path)
        assert (top.first, top.second) == (151_935, 7)
        assert top.p_first / top.p_second == pytest.approx(float(torch.tensor(2.0).exp()), rel=1e-5)
    row = torch.tensor([[0.5, 2.0, 1.0], [3.0, 1.0, 0.0]]).t()[1]  # not contiguous: torch's own
    assert native.softmax_top2(row)[:2] == (0, 1)
    assert native.softmax_top2(x.double())[:2] == (151_935, 7)
    with pytest.raises(ValueError, match="at least 2 logits"):
        native.softmax_top2(torch.ones(1))


@pytest.mark.parametrize("n", [16, 896, 1536])
def test_rmsnorm_is_torchs_within_rounding_a_rows_bits_its_own_on_every_path(n) -> None:
    from forerun.models.norm import RMSNorm

    gen = torch.Generator().manual_seed(n)
    x = torch.randn(5, n, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None]
    x[3] = 0.0  # all zeros: eps alone keeps it finite
    norm = RMSNorm(n, 1e-6)
    norm.weight.copy_(torch.randn(n, generator=gen))
    outs = {path: native.rmsnorm(x, norm.weight, norm.eps, kernel_path=path) for path in native.paths()}
    for path, out in outs.items():
        assert torch.equal(out, outs["scalar"]), path
        assert torch.equal(native.rmsnorm(x[2:3], norm.weight, norm.eps, kernel_path=path), out[2:3]), path
    torch.testing.assert_close(outs["scalar"], norm(x), rtol=2e-6, atol=1e-6)
    assert torch.equal(native.rmsnorm(x.t().contiguous().t(), norm.weight, norm.eps), outs[native.path()])
    with pytest.raises(ValueError, match="multiple of 16"):
        native.rmsnorm(torch.ones(2, 20), torch.ones(20), 1e-6)


def test_bias_is_added_once_per_output() -> None:
    n, k = 20, 256
    raw = random_blocks("Q4_K", n, k, seed=5)
    packed, x, bias = packed_of("Q4_K", raw, n, k), torch.randn(3, k), torch.randn(n)
    act = native.quantize(x, 256)
    plain = native.matmul(12, packed, n, k, act, 3, torch.empty(3, n))
    with_bias = native.matmul(12, packed, n, k, act, 3, torch.empty(3, n), bias)
    assert torch.equal(with_bias, plain + bias)


def test_a_short_buffer_or_a_width_no_block_fits_is_refused() -> None:
    raw = torch.zeros(10, dtype=torch.uint8)
    with pytest.raises(ValueError, match="expected"):
        native.repack(native.TYPES["Q8_0"], raw, 4, 64)
    with pytest.raises(ValueError, match="cannot be read"):
        native.repack(native.TYPES["Q4_K"], torch.zeros(144, dtype=torch.uint8), 1, 100)


def test_the_path_is_the_widest_the_cpu_runs_unless_one_is_asked_for(monkeypatch) -> None:
    runs = native.paths()
    assert runs[0] == "scalar"
    native.path.cache_clear()
    try:
        monkeypatch.delenv(native.PATH_ENV, raising=False)
        assert native.path() == runs[-1]
        native.path.cache_clear()
        monkeypatch.setenv(native.PATH_ENV, "scalar")
        assert native.path() == "scalar"
        native.path.cache_clear()
        monkeypatch.setenv(native.PATH_ENV, "neon")
        with pytest.raises(ForerunError, match="this CPU runs scalar"):
            native.path()
    finally:
        native.path.cache_clear()


def test_without_a_compiler_the_gguf_format_says_so_and_falls_back_to_w8a8(tmp_path, capsys) -> None:
    from forerun.models import formats
    from forerun.native import build

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FORERUN_HOME", str(tmp_path))  # no library built here yet
        patch.setattr(build, "compiler", lambda: None)
        patch.setattr(formats, "_said", set())
        native._load.cache_clear()
        try:
            assert "no C++ compiler found" in native.problem()
            assert formats.resolve("gguf", "cpu") == "w8a8"
            assert "using w8a8 instead" in capsys.readouterr().err
            with pytest.raises(ForerunError, match="use --quantization w8a8"):
                native.library()
        finally:
            native._load.cache_clear()
    assert native.available()  # the real library again


def test_a_failed_build_shows_what_the_compiler_said(monkeypatch, tmp_path) -> None:
    from forerun.native import build

    monkeypatch.setenv("FORERUN_HOME", str(tmp_path))
    monkeypatch.setattr(build, "COMMON", [*build.COMMON, "-fno-such-flag"])
    with pytest.raises(build.BuildError, match="no-such-flag"):
        build.build()
    assert not list(tmp_path.rglob(build.LIBRARY))  # nothing half-built left behind


def test_the_emulated_avx512_library_is_asked_for_by_name_and_needs_simde(monkeypatch) -> None:
    """FORERUN_EMULATE_AVX512=1 compiles the avx512 path without AVX-512 instructions (its own key, so
    never the real library); without SIMDe's headers it says what to install."""
    import platform

    from forerun.native import build

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the emulated path is x86-64's")
    monkeypatch.delenv(build.EMULATE_ENV, raising=False)  # the real library's plan, even under the emulated run
    real = build.plan()
    monkeypatch.setenv(build.EMULATE_ENV, "1")
    monkeypatch.setattr(build, "_has_header", lambda cxx, header: header == build.SIMDE)
    emulated = build.plan()
    assert emulated.units["avx512.cpp"] == ["-mavx2", "-mfma", "-mf16c", "-DFORERUN_EMULATED"]
    assert "-DFORERUN_EMULATED" in emulated.units["api.cpp"] and "-DFORERUN_EMULATED" not in real.units["api.cpp"]
    assert emulated.key("v") != real.key("v")
    monkeypatch.setattr(build, "_has_header", lambda cxx, header: False)
    with pytest.raises(build.BuildError, match="apt-get install libsimde-dev"):
        build.plan()
    monkeypatch.setenv(build.EMULATE_ENV, "0")
    assert build.plan() == real
