"""The Philox Gaussian stream, bit for bit: a pure-Python Philox4x32-10 against Random123's
known answers and the torch reference, Box-Muller against the float64 formula of kernel.c, the
stream layout, the native kernel against the reference for several builds, and the chunked fill."""

import hashlib
import math
import platform
import random
import shutil
import struct

import numpy as np
import pytest
import torch

from opacus_dp.optim.philox import draws, native, reference

M32 = 0xFFFFFFFF
X86 = platform.machine().lower() in ("x86_64", "amd64")
FLAGS = ["-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd"]
WORDS = (0x01234567, 0x89ABCDEF, 0xDEADBEEF, 0x0BADF00D)
STD = float(np.float32(0.37))


def philox_python(counter, key):
    """Philox4x32-10 (Salmon et al., SC'11) with Python integers."""
    x0, x1, x2, x3 = counter
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * x0, 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (p1 >> 32) ^ x1 ^ k0, p1 & M32, (p0 >> 32) ^ x3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return x0, x1, x2, x3


def box_muller_float64(w0, w1):
    """kernel.c's formula in float64 (numpy arrays of uint32 values held in int64)."""
    u = (np.floor(w0 / 2) + 0.5) * 2.0 ** -31
    r = np.sqrt(-2 * np.log(u))
    q, f = w1 >> 30, ((w1 >> 6) & 0xFFFFFF) * 2.0 ** -24
    angle = q * np.pi / 2 + np.pi / 4 + (f - 0.5) * np.pi / 2
    return r, r * np.cos(angle), r * np.sin(angle)


def run_kernel(kernel, n, start, words=WORDS, std=STD, base=None, alias=False, divisor=1.0):
    out = base.clone() if alias else torch.full((n,), float("nan"))
    source = out if alias else base
    kernel(out.data_ptr(), None if source is None else source.data_ptr(), start, n, *words, std, divisor)
    return out


def run_reference(n, start, words=WORDS, std=STD, base=None):
    out = torch.empty(n)
    reference.fill(out, base, start, words, std)
    return out


def native_kernel():
    kernel = native.kernel()
    if kernel is None:
        pytest.skip(f"native Philox kernel unavailable: {native.unavailable_reason()}")
    return kernel


def test_pure_python_philox_reproduces_random123_known_answers():
    assert philox_python((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox_python((M32,) * 4, (M32, M32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox_python((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def test_torch_philox_equals_pure_python_on_random_and_extreme_inputs():
    rng = random.Random(1)
    pick = lambda: rng.choice([rng.getrandbits(32), M32 - rng.getrandbits(4), rng.getrandbits(4), 1 << 31])
    cases = [([pick() for _ in range(4)], (pick(), pick())) for _ in range(300)]
    cases += [((M32,) * 4, (M32, M32)), ((0,) * 4, (0, 0))]
    for key in {tuple(k) for _, k in cases}:
        counters = [c for c, k in cases if tuple(k) == key]
        x = tuple(torch.tensor([c[i] for c in counters], dtype=torch.int64) for i in range(4))
        got = torch.stack(reference.philox4x32_10(x, *key), dim=1).tolist()
        assert got == [list(philox_python(c, key)) for c in counters], key


def test_box_muller_follows_the_float64_formula():
    """|z - z_exact| <= 2e-6 r + 1e-6 + 2^-23 / (r + r'): u is a float32 (relative rounding 2^-24),
    so r^2 = -2 ln u is known to 2^-23 only, which matters where r is small (u near 1)."""
    rng = np.random.default_rng(5)
    w0, w1 = rng.integers(0, 2 ** 32, size=(2, 200_000), dtype=np.int64)
    extremes = [0, 1, 2, 3, M32, M32 - 1, 1 << 31, (1 << 31) - 1]
    angles = [q << 30 | low for q in range(4) for low in (0, 1 << 29, (1 << 30) - 1)]
    w0 = np.concatenate([w0, np.repeat(extremes, len(angles))])
    w1 = np.concatenate([w1, np.tile(angles, len(extremes))])
    zc, zs = (z.double().numpy() for z in reference.box_muller(torch.from_numpy(w0), torch.from_numpy(w1)))
    r, c, s = box_muller_float64(w0, w1)
    tolerance = 2e-6 * r + 1e-6 + 2.0 ** -23 / (r + np.hypot(zc, zs))
    assert np.all(np.abs(zc - c) <= tolerance) and np.all(np.abs(zs - s) <= tolerance)
    quadrant = w1 >> 30
    for q, (sign_c, sign_s) in enumerate([(1, 1), (-1, 1), (-1, -1), (1, -1)]):
        inside = (quadrant == q) & (np.abs(c) > tolerance) & (np.abs(s) > tolerance)
        assert inside.sum() > 40_000, q
        assert np.all(np.sign(zc[inside]) == sign_c) and np.all(np.sign(zs[inside]) == sign_s), q


def test_radius_bound_is_attained_at_the_smallest_uniform():
    zc, zs = reference.box_muller(torch.tensor([0, M32]), torch.tensor([0, 0]))
    radius = torch.hypot(zc.double(), zs.double())
    assert 6.66 < float(radius[0]) <= 6.67 and math.isclose(float(radius[0]), math.sqrt(64 * math.log(2)),
                                                            rel_tol=1e-6)
    assert float(radius[1]) < 1e-3


def test_reference_layout_matches_the_documented_stream():
    """Element i: tile i // 256, plane (i % 256) // 64, lane i % 64; block 64 T + b of the counter
    (block mod 2^32, block >> 32, c2, c3); planes 0, 1 from (w0, w1), planes 2, 3 from (w2, w3)."""
    k0, k1, c2, c3 = WORDS
    first_tile = 2 ** 33 // 64 + 3
    stream = reference.normal_tiles(first_tile, 2, WORDS, 1.0).double().numpy()
    for i in [0, 1, 63, 64, 130, 200, 255, 256, 300, 511]:
        tile, plane, lane = i // 256, (i % 256) // 64, i % 64
        block = 64 * (first_tile + tile) + lane
        w = philox_python((block & M32, block >> 32, c2, c3), (k0, k1))
        pair = np.array([w[2 * (plane // 2)]]), np.array([w[2 * (plane // 2) + 1]])
        r, c, s = box_muller_float64(*pair)
        exact = float((c if plane % 2 == 0 else s)[0])
        assert abs(stream[i] - exact) <= 2e-6 * float(r[0]) + 1e-6 + 2.0 ** -23 / float(r[0]), i


CASES = [(1000, 0), (256, 256), (777, 256 * 2 ** 33), (3 * 256 + 1, 256 * (2 ** 32 - 1)), (5, 2 ** 40)]


@pytest.mark.parametrize("n, start", CASES)
@pytest.mark.parametrize("std", [1.0, STD, float(np.float32(1e-3))])
def test_native_kernel_equals_reference_bit_for_bit(n, start, std):
    kernel = native_kernel()
    words = (0xFFFFFFFF, 0x7, 0x80000000, 0x12345678)
    base = torch.randn(n, generator=torch.Generator().manual_seed(n))
    expected = run_reference(n, start, words, std)
    assert torch.equal(run_kernel(kernel, n, start, words, std), expected)
    expected_sum = run_reference(n, start, words, std, base)
    assert torch.equal(run_kernel(kernel, n, start, words, std, base), expected_sum)
    assert torch.equal(run_kernel(kernel, n, start, words, std, base, alias=True), expected_sum)
    assert not torch.equal(expected, run_reference(n, start + 256, words, std))


def build_flag_sets():
    sets = {"O0": ["-O0"] + FLAGS, "O3": ["-O3"] + FLAGS}
    if X86:
        sets["x86-64"] = ["-O3", "-march=x86-64"] + FLAGS
        capability = torch.backends.cpu.get_cpu_capability()
        if capability in ("AVX2", "AVX512"):
            sets["x86-64-v3"] = ["-O3", "-march=x86-64-v3"] + FLAGS
        if capability == "AVX512":
            sets["x86-64-v4"] = ["-O3", "-march=x86-64-v4"] + FLAGS
    return sets


COMPILERS = [None, pytest.param("clang", marks=pytest.mark.skipif(
    shutil.which("clang") is None, reason="clang is not installed"))]  # None: $CC, else cc


@pytest.mark.parametrize("compiler", COMPILERS)
def test_every_build_gives_the_same_bits(tmp_path, compiler):
    """Each instruction level's build (the vector Philox rounds of AVX2 and AVX-512 and the portable
    code), by the default compiler and by clang where installed, against the reference."""
    native_kernel()
    n, start = 64 * 256 + 77, 256 * 2 ** 33
    base = torch.randn(n, generator=torch.Generator().manual_seed(3))
    expected = (run_reference(n, start), run_reference(n, 0, std=1.0, base=base))
    built = build_flag_sets()
    for name, flags in built.items():
        kernel = native.load(native.build(compiler, flags=flags, directory=tmp_path))
        assert torch.equal(run_kernel(kernel, n, start), expected[0]), name
        assert torch.equal(run_kernel(kernel, n, 0, std=1.0, base=base), expected[1]), name
    assert len(list(tmp_path.glob("philox_v*.so"))) == len(built)
    assert native.build(compiler, flags=built["O0"], directory=tmp_path) in tmp_path.glob("*.so")  # cached


def unaligned(values: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``values`` that starts ``shift`` floats into its storage (not 64-byte aligned)."""
    storage = torch.full((values.numel() + shift,), float("nan"))
    storage[shift:] = values
    return storage[shift:]


def test_every_build_writes_unaligned_tensors_as_the_reference(tmp_path):
    """Views that start inside a cache line, as a parameter sliced from a flat buffer does: the
    whole tiles drawn straight into the output, the tiles added to a base, and the division."""
    native_kernel()
    n, start = 9 * 256 + 13, 256 * 2 ** 32
    base = torch.randn(n, generator=torch.Generator().manual_seed(5))
    expected = {"plain": run_reference(n, start), "added": run_reference(n, start, base=base)}
    divided = torch.empty(n)
    reference.fill(divided, base, start, WORDS, STD, 3.0)
    for name, flags in build_flag_sets().items():
        kernel = native.load(native.build(flags=flags, directory=tmp_path))
        for shift in (1, 3):
            out, source = unaligned(torch.zeros(n), shift), unaligned(base, shift + 1)
            kernel(out.data_ptr(), None, start, n, *WORDS, STD, 1.0)
            assert torch.equal(out, expected["plain"]), (name, shift)
            kernel(out.data_ptr(), source.data_ptr(), start, n, *WORDS, STD, 1.0)
            assert torch.equal(out, expected["added"]), (name, shift)
            kernel(out.data_ptr(), source.data_ptr(), start, n, *WORDS, STD, 3.0)
            assert torch.equal(out, divided), (name, shift)
            in_place = unaligned(base, shift)
            kernel(in_place.data_ptr(), in_place.data_ptr(), start, n, *WORDS, STD, 1.0)
            assert torch.equal(in_place, expected["added"]), (name, shift)


def test_build_reports_a_failing_compiler(tmp_path):
    with pytest.raises(RuntimeError, match="compiler"):
        native.build(flags=FLAGS + ["-no-such-flag-xyz"], directory=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("chunk", [None, 3 * 256, 256])
def test_fill_is_the_same_for_any_threads_and_chunks(workers, chunk, monkeypatch):
    native_kernel()
    if chunk is not None:
        monkeypatch.setattr(draws, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(draws, "CHUNKS_PER_WORKER", 1000)  # chunks of exactly CHUNK_ELEMENTS
    n = 20 * 256 + 9
    base = torch.randn(n, generator=torch.Generator().manual_seed(4))
    out = torch.empty(n)
    draws.fill(out, None, WORDS, STD, workers)
    assert torch.equal(out, run_reference(n, 0))
    summed = base.clone()
    draws.fill(summed, summed, WORDS, STD, workers)
    assert torch.equal(summed, run_reference(n, 0, base=base))


def test_chunks_are_whole_tiles_a_few_per_worker():
    assert draws.chunk_elements(1 << 24, 2) == (1 << 24) // 8
    assert draws.chunk_elements(1 << 24, 1) == (1 << 24) // 4
    assert draws.chunk_elements(100, 8) == draws.CHUNK_ELEMENTS  # never below the smallest chunk
    size = draws.chunk_elements(3 * (1 << 20) + 7, 3)
    assert size % 256 == 0 and size * 12 >= 3 * (1 << 20) + 7 > size * 11


def test_chunks_are_whole_tiles_whatever_the_smallest_chunk(monkeypatch):
    monkeypatch.setattr(draws, "CHUNK_ELEMENTS", 1000)  # not a multiple of the tile
    assert draws.chunk_elements(10_000, 8) == 1024
    n = 5000
    out = torch.empty(n)
    draws.fill(out, None, WORDS, STD, 2)
    assert torch.equal(out, run_reference(n, 0))  # no chunk repeats another's draws


def test_stream_words_follow_shake256_and_positions_get_distinct_words():
    key, step, slot, draw = 2 ** 100 + 5, 7, 2, 3
    message = (b"opacus_dp philox noise v1\0" + key.to_bytes(16, "little")
               + struct.pack("<QQQ", step, slot, draw))
    expected = struct.unpack("<4I", hashlib.shake_256(message).digest(16))
    assert draws.stream_words(key, step, slot, draw) == expected
    assert draws.stream_words(key, step, slot, draw) == expected  # deterministic
    positions = [(k, t, s, d) for k in (0, 1, 2 ** 64 - 1, 2 ** 64, 2 ** 128 - 1) for t in (0, 1, 2 ** 40)
                 for s in (0, 1, 5) for d in (0, 1, 3)]
    words = [draws.stream_words(*p) for p in positions]
    assert all(isinstance(w, int) and 0 <= w <= M32 for ws in words for w in ws)
    assert len(set(words)) == len(positions)


def test_an_unknown_instruction_level_falls_back_to_the_baseline_build(monkeypatch, tmp_path):
    """A compiler that rejects the machine's -march flag still yields the kernel (baseline flags),
    which draws the same numbers."""
    monkeypatch.setenv("OPACUS_DP_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compile_flags", lambda: list(native.BASE_FLAGS) + ["-march=no-such-level"])
    native.forget()
    try:
        kernel = native.kernel()
        if kernel is None and "no-such-level" not in (native.unavailable_reason() or ""):
            pytest.skip(f"no C compiler here: {native.unavailable_reason()}")
        assert kernel is not None, native.unavailable_reason()
        out, expected = torch.empty(1000), torch.empty(1000)
        kernel(out.data_ptr(), None, 0, 1000, 1, 2, 3, 4, 1.0, 1.0)
        reference.fill(expected, None, 0, (1, 2, 3, 4), 1.0)
        assert torch.equal(out, expected)
    finally:
        native.forget()


def test_the_kernel_cache_is_private_to_the_user(monkeypatch, tmp_path):
    """The configured directory is used when only its owner can write it; a directory others can
    write (a library planted there would run in this process) is replaced by a new temporary one."""
    monkeypatch.setenv("OPACUS_DP_CACHE", str(tmp_path / "own"))
    own = native.cache_directory()
    assert own == tmp_path / "own" / "native" and not own.stat().st_mode & 0o022
    shared = tmp_path / "shared" / "native"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    monkeypatch.setenv("OPACUS_DP_CACHE", str(tmp_path / "shared"))
    replaced = native.cache_directory()
    assert replaced != shared and replaced.is_dir() and not replaced.stat().st_mode & 0o022
