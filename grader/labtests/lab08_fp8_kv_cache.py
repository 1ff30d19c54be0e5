"""Official tests of lab 08_fp8_kv_cache: fp8 scales, quantize / dequantize, per-head and calibrated
scales, the fp8 write path, capacity with fp8 KV and a predicted decode speedup.

The learner's functions are the engine's seams (grader/seams.py): `kernels.fp8.scale_from_amax`,
`quantize_fp8`, `dequantize_fp8`, `engine_core.worker.kv_scales.amax_per_head`, `KVAmax.scales` and
the write path `kernels.reference.reshape_and_cache` (which calls the learner's `quantize_fp8`).
Expected codes come from torch's own float8 casts, which round to nearest even correctly on CPU,
written here as the specification (`_cast`): a correct store agrees with them bit for bit. Set-up
tensors are written directly; the end-to-end tests run tiny-llama with the learner's functions
plugged and compare tokens and scales with the reference engine's run, computed after the plug
ends. Every check is an `expect_*` observation.
"""
import functools

import pytest
import torch

from grader.harness import KVAmax, capacity_planner, memory, run_engine, save_kv_amax
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "08_fp8_kv_cache"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- the specification, written independently of the solution ---------------------------------

def _cast(x, scale, dtype=E4M3):
    """What an fp8 store must hold: x / scale in fp32 (a [H] scale per KV head), clamped to the format's max,
    then torch's own cast (round to nearest even)."""
    if isinstance(scale, torch.Tensor) and scale.dim() == 1:
        scale = scale[:, None]
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def _bits(t):
    """An fp8 tensor as its raw bytes (plain data: equal bits, equal codes)."""
    return t.contiguous().view(torch.uint8).tolist()


def _head_errors(x, back):
    """Relative error ||back - x|| / ||x|| of each KV head of `[tokens, heads, dim]`."""
    return [((back[:, h] - x[:, h]).norm() / x[:, h].norm()).item() for h in range(x.shape[1])]


def _round_trip(x, scale):
    s = scale[:, None] if scale.dim() == 1 else scale
    return _cast(x, scale).float() * s


# ---- task 1: scale_from_amax --------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("scale_from_amax")
def test_scale_maps_amax_onto_the_format(student):
    """scale = amax / 448 for e4m3 and amax / 57344 for e5m2, in fp32, in the input's shape."""
    with plug(student, LAB, only=["scale_from_amax"]):
        got = student.scale_from_amax(torch.tensor([896.0, 448.0, 1.0, 0.5]), E4M3)
        expect_equal((str(got.dtype), list(got.shape)), ("torch.float32", [4]),
                     "scale_from_amax(tensor([896., 448., 1., 0.5]), float8_e4m3fn): (dtype, shape)")
        expect_close(got.tolist(), [2.0, 1.0, 1 / 448, 0.5 / 448],
                     "scale_from_amax([896, 448, 1, 0.5], e4m3): amax / 448, e4m3's largest value", rtol=1e-6)
        got = student.scale_from_amax(torch.tensor([[229376.0, 57344.0], [5.0, 1.0]], dtype=torch.bfloat16), E5M2)
        expect_equal((str(got.dtype), list(got.shape)), ("torch.float32", [2, 2]),
                     "scale_from_amax of a bf16 [2, 2] amax, float8_e5m2: (dtype, shape), the scale is always fp32")
        expect_close(got.tolist(), [[4.0, 1.0], [5.0 / 57344, 1.0 / 57344]],
                     "scale_from_amax([[229376, 57344], [5, 1]], e5m2): amax / 57344, e5m2's largest value", rtol=1e-6)


@pytest.mark.points(1)
@pytest.mark.task("scale_from_amax")
def test_scale_of_an_all_zero_tensor_is_one(student):
    """amax 0 (nothing seen yet, a padded head) gets scale 1, never 0 (the next store would divide by it)."""
    with plug(student, LAB, only=["scale_from_amax"]):
        got = student.scale_from_amax(torch.tensor([0.0, 448.0, 0.0]), E4M3)
        expect_close(got.tolist(), [1.0, 1.0, 1.0], "scale_from_amax([0, 448, 0], e4m3): zeros get scale 1", rtol=0)
        got = student.scale_from_amax(torch.tensor(0.0), E5M2)
        expect_equal((list(got.shape), got.item()), ([], 1.0), "scale_from_amax(tensor(0.), e5m2): (shape, value)")


# ---- task 2: quantize_fp8 / dequantize_fp8 ------------------------------------------------------

HALFWAY = [1.0625, 1.1875, 2.125, 2.375, 0.01025390625, -1.0625, 3.0e-3, 17.0, 19.0, 400.0, 432.0]


@pytest.mark.points(2)
@pytest.mark.task("quantize_fp8")
def test_quantize_agrees_with_torchs_cast(student):
    """Bit for bit torch's cast of x / scale in fp32: random values, ties between two codes (round half to even),
    subnormals, fp32 and bf16 inputs, a 0-dim tensor scale and a float scale, e4m3 and e5m2."""
    gen = torch.Generator().manual_seed(8)
    x = torch.cat([torch.randn(60, generator=gen) * 40, torch.tensor(HALFWAY)]).view(71, 1, 1).expand(71, 2, 2)
    with plug(student, LAB, only=["quantize_fp8"]):
        for scale in (torch.tensor(0.5), 0.25, 1.0):
            for dtype in (E4M3, E5M2):
                got = student.quantize_fp8(x, scale, dtype)
                expect_equal(str(got.dtype), str(dtype), f"quantize_fp8(x, {scale!r}, {dtype}).dtype")
                expect_equal(_bits(got), _bits(_cast(x, scale, dtype)),
                             f"quantize_fp8 of 71 x 2 x 2 values (random, and ties such as 1.0625 -> 1.0, 1.1875 -> "
                             f"1.25), scale {scale!r}, {dtype}: the raw bytes against torch's cast of x / scale")
        xb = x.to(torch.bfloat16) * 3.3
        expect_equal(_bits(student.quantize_fp8(xb, 0.3, E4M3)), _bits(_cast(xb, 0.3, E4M3)),
                     "quantize_fp8 of a bf16 x, scale 0.3, e4m3: divide in fp32 (a bf16 division rounds twice)")


@pytest.mark.points(2)
@pytest.mark.task("quantize_fp8")
def test_quantize_saturates_never_nan(student):
    """Values past the format's max (and +-inf) store +-max; e4m3fn has no infinity, so an unclamped cast is NaN."""
    x = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), 448.0, 460.0, 480.0, -500.0]).view(1, 1, 8)
    with plug(student, LAB, only=["quantize_fp8"]):
        expect_equal(student.quantize_fp8(x, 1.0, E4M3).float().flatten().tolist(),
                     [448.0, -448.0, 448.0, -448.0, 448.0, 448.0, 448.0, -448.0],
                     "quantize_fp8([1e6, -1e6, inf, -inf, 448, 460, 480, -500], scale 1.0, e4m3): saturated at +-448")
        expect_equal(student.quantize_fp8(x * 1000, 2.0, E5M2).float().flatten().tolist(),
                     [57344.0, -57344.0, 57344.0, -57344.0, 57344.0, 57344.0, 57344.0, -57344.0],
                     "quantize_fp8(1000 x [1e6, -1e6, inf, -inf, 448, 460, 480, -500], scale 2.0, e5m2): saturated at "
                     "+-57344 (e5m2 has an infinity, so an unclamped cast stores inf)")


@pytest.mark.points(1)
@pytest.mark.task("quantize_fp8")
def test_quantize_per_head_scales(student):
    """A `[num_kv_heads]` scale divides each KV head by its own scale (broadcast over head_dim)."""
    x = torch.arange(-12.0, 12.0).view(3, 2, 4) * 7.5
    scale = torch.tensor([0.5, 8.0])
    with plug(student, LAB, only=["quantize_fp8"]):
        expect_equal(_bits(student.quantize_fp8(x, scale, E4M3)), _bits(_cast(x, scale, E4M3)),
                     "quantize_fp8(x [3 tokens, 2 heads, 4 dims] = 7.5 * (-12 .. 11), scale tensor([0.5, 8.0]), e4m3): "
                     "head 0 divided by 0.5, head 1 by 8")


def _round_trip_cases():
    """Fixed inputs over seven decades (normal, subnormal, saturating, zero), seeded: the same in every run."""
    gen = torch.Generator().manual_seed(5)
    magnitudes = 10.0 ** (torch.rand(96, generator=gen) * 7 - 4)  # 1e-4 .. 1e3
    signs = torch.where(torch.rand(96, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.cat([magnitudes * signs, torch.tensor([0.0, -0.0, 447.9, 448.0, 2000.0])])
    return [(x, scale) for scale in (0.01, 0.5, 2.0)]


@pytest.mark.points(2)
@pytest.mark.task("quantize_fp8")
def test_round_trip_error_bound(student):
    """dequantize(quantize(x)) is within 2^-4 |x| (half of e4m3's 2^-3 relative step) plus half a subnormal
    step (2^-10 x scale) of x clamped to +-448 x scale: the tolerance is the format's rounding bound, no more."""
    with plug(student, LAB, only=["quantize_fp8", "dequantize_fp8"]):
        for x, scale in _round_trip_cases():
            xs = (x * scale).view(-1, 1, 1)
            back = student.dequantize_fp8(student.quantize_fp8(xs, scale, E4M3), scale, torch.float32)
            expect_close(back.flatten().tolist(), xs.clamp(-448 * scale, 448 * scale).flatten().tolist(),
                         f"dequantize_fp8(quantize_fp8(x, {scale}), {scale}, float32) for 101 values x = scale x "
                         f"(+-1e-4 .. 1e3, 0, 447.9, 448, 2000)", rtol=2 ** -4, atol=2 ** -10 * scale)


@pytest.mark.points(1)
@pytest.mark.task("quantize_fp8")
def test_dequantize_multiplies_the_scale_back(student):
    """code * scale in fp32 (per head for a `[H]` scale), returned in the dtype asked for."""
    codes = torch.tensor([1.0, -2.0, 0.5, 448.0, 3.0, -0.25, 96.0, 0.0]).view(2, 2, 2).to(E4M3)
    with plug(student, LAB, only=["dequantize_fp8"]):
        got = student.dequantize_fp8(codes, torch.tensor([0.5, 3.0]), torch.bfloat16)
        expect_equal((str(got.dtype), got.float().tolist()),
                     ("torch.bfloat16", [[[0.5, -1.0], [1.5, 1344.0]], [[1.5, -0.125], [288.0, 0.0]]]),
                     "dequantize_fp8(codes [[[1, -2], [0.5, 448]], [[3, -0.25], [96, 0]]], scale tensor([0.5, 3.0]), "
                     "bfloat16): (dtype, values), head 0 times 0.5, head 1 times 3")
        got = student.dequantize_fp8(codes, 2.0, torch.float32)
        expect_equal((str(got.dtype), got.flatten().tolist()),
                     ("torch.float32", [2.0, -4.0, 1.0, 896.0, 6.0, -0.5, 192.0, 0.0]),
                     "dequantize_fp8(same codes, scale 2.0, float32): (dtype, values)")


# ---- task 3: amax_per_head, KVAmax.scales, the outlier head ------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("amax_per_head")
def test_amax_per_head(student):
    """max |x| over tokens and head_dim, one per KV head, in fp32 (negative values count by magnitude)."""
    x = torch.tensor([[[1.0, -3.0], [0.5, 2.0]], [[2.5, 0.0], [-7.0, 1.0]], [[0.0, 1.0], [4.0, -4.0]]],
                     dtype=torch.bfloat16)
    with plug(student, LAB, only=["amax_per_head"]):
        got = student.amax_per_head(x)
        expect_equal((str(got.dtype), got.tolist()), ("torch.float32", [3.0, 7.0]),
                     "amax_per_head(bf16 x [3 tokens, 2 heads, 2 dims]: head 0 holds 1, -3, 2.5, 0, 0, 1 and head 1 "
                     "holds 0.5, 2, -7, 1, 4, -4): (dtype, values)")


AMAX = KVAmax(key=torch.tensor([[448.0, 896.0], [44.8, 0.0]]), value=torch.tensor([[4.48, 4.48], [0.0, 0.0]]),
              source="a hand-made calibration")


@pytest.mark.points(2)
@pytest.mark.task("scales")
def test_calibrated_scales_per_tensor_and_per_head(student):
    """Per tensor: one 0-dim scale per layer from the layer's largest amax; per head: the `[H]` row's scales."""
    with plug(student, LAB, only=["scales", "scale_from_amax"]):
        k, v = student.scales(AMAX, E4M3, False)
        expect_equal(([list(s.shape) for s in k + v], len(k), len(v)), ([[], [], [], []], 2, 2),
                     "KVAmax(key [[448, 896], [44.8, 0]], value [[4.48, 4.48], [0, 0]]).scales(e4m3, per_head=False): "
                     "(shapes of k scales + v scales, number of k scales, number of v scales)")
        expect_close([s.item() for s in k + v], [2.0, 0.1, 0.01, 1.0],
                     "the same, per tensor: k scales (layer 0, layer 1) then v scales; an all-zero layer gets 1",
                     rtol=1e-6)
        k, v = student.scales(AMAX, E4M3, True)
        expect_close([s.tolist() for s in k + v], [[1.0, 2.0], [0.1, 1.0], [0.01, 0.01], [1.0, 1.0]],
                     "the same KVAmax, .scales(e4m3, per_head=True): one scale per KV head", rtol=1e-6)
        k, v = student.scales(AMAX, E5M2, True)
        expect_close([s.tolist() for s in k], [[448 / 57344, 896 / 57344], [44.8 / 57344, 1.0]],
                     "the same KVAmax, k scales of .scales(e5m2, per_head=True): amax / 57344", rtol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("scales")
def test_per_head_scales_rescue_the_outlier_head(student):
    """KV head 0 is 2^16 times larger than head 1 (an outlier head). With your amax, scales and round trip: a
    per-tensor scale drowns head 1 in e4m3's subnormals (relative error ~0.5), per-head scales keep it at the
    mantissa's resolution (~0.02). Tolerance 1e-3 relative: your code must round exactly as torch's cast."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 32, generator=gen)
    x[:, 0] *= 2.0 ** 16
    with plug(student, LAB, only=["amax_per_head", "scale_from_amax", "quantize_fp8", "dequantize_fp8"]):
        amax = student.amax_per_head(x)
        per_tensor = student.scale_from_amax(amax.amax(), E4M3)
        per_head_scale = student.scale_from_amax(amax, E4M3)
        back_tensor = student.dequantize_fp8(student.quantize_fp8(x, per_tensor, E4M3), per_tensor, torch.float32)
        back_head = student.dequantize_fp8(student.quantize_fp8(x, per_head_scale, E4M3), per_head_scale, torch.float32)
    x_amax = x.abs().amax(dim=(0, 2))
    expect_close(_head_errors(x, back_tensor), _head_errors(x, _round_trip(x, x_amax.amax() / 448)),
                 "16 tokens x 2 heads x 32 dims of N(0, 1), head 0 times 2^16: relative error of each head after a "
                 "round trip with ONE scale (max |x| / 448)", rtol=1e-3)
    expect_close(_head_errors(x, back_head), _head_errors(x, _round_trip(x, x_amax / 448)),
                 "the same x, one scale PER HEAD (each head's max |x| / 448): relative error of each head", rtol=1e-3)


# ---- task 4: the write path ----------------------------------------------------------------------

def _expected_cache(shape, x, slots, scale, dtype):
    """A zero cache of `dtype` with x's rows stored (quantized when fp8) at `slots` (-1 skipped), as raw bytes."""
    cache = torch.zeros(shape, dtype=dtype)
    flat = cache.view(-1, shape[2], shape[3])
    for row, slot in enumerate(slots):
        if slot >= 0:
            flat[slot] = _cast(x[row:row + 1], scale, dtype)[0] if dtype in (E4M3, E5M2) else x[row].to(dtype)
    return _bits(cache) if dtype in (E4M3, E5M2) else cache.tolist()


SHAPE = (3, 3, 2, 4)  # 3 blocks of 3 slots, 2 KV heads of 4 dims: block size and head count differ, so a swap shows
SLOTS = [5, -1, 0, 2]


@pytest.mark.points(2)
@pytest.mark.task("reshape_and_cache")
def test_write_path_stores_codes_at_slots(student):
    """fp8 caches hold torch's codes of K / k_scale (per head) and V / v_scale at the slots; slot -1 rows are
    skipped; every other slot keeps its zeros."""
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(4, 2, 4, generator=gen) * 10, torch.randn(4, 2, 4, generator=gen)
    for dtype, name in ((E4M3, "fp8"), (E5M2, "fp8_e5m2")):
        key_cache, value_cache = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
        with plug(student, LAB, only=["reshape_and_cache", "quantize_fp8"]):
            student.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(SLOTS), name,
                                      torch.tensor([0.5, 2.0]), 0.25)
        expect_equal(_bits(key_cache), _expected_cache(SHAPE, key, SLOTS, torch.tensor([0.5, 2.0]), dtype),
                     f"reshape_and_cache of 4 tokens (2 heads x 4 dims) at slots {SLOTS} into a {dtype} key cache of 3 "
                     f"blocks x 3 slots, kv_cache_dtype={name!r}, k_scale tensor([0.5, 2.0]): the key cache's bytes")
        expect_equal(_bits(value_cache), _expected_cache(SHAPE, value, SLOTS, 0.25, dtype),
                     f"the same write, v_scale 0.25, {dtype}: the value cache's bytes")


@pytest.mark.points(2)
@pytest.mark.task("reshape_and_cache")
def test_write_path_auto_copies_and_rejects_a_wrong_format(student):
    """`auto` caches get a plain copy (cast to the cache's dtype, no scale); a kv_cache_dtype naming another
    format than the cache's raises ValueError before writing."""
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(4, 2, 4, generator=gen) * 10, torch.randn(4, 2, 4, generator=gen)
    with plug(student, LAB, only=["reshape_and_cache", "quantize_fp8"]):
        for dtype in (torch.float32, torch.bfloat16):
            key_cache, value_cache = torch.zeros(SHAPE, dtype=dtype), torch.zeros(SHAPE, dtype=dtype)
            student.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor(SLOTS), "auto", 0.5, 0.5)
            expect_equal((key_cache.tolist(), value_cache.tolist()),
                         (_expected_cache(SHAPE, key, SLOTS, 1.0, dtype), _expected_cache(SHAPE, value, SLOTS, 1.0, dtype)),
                         f"reshape_and_cache at slots {SLOTS} into {dtype} caches, kv_cache_dtype='auto', scales 0.5 "
                         f"(ignored): (key cache, value cache)")
        wrong = torch.zeros(SHAPE, dtype=E4M3)
        expect_raises(ValueError, student.reshape_and_cache, key, value, wrong, wrong.clone(), torch.tensor(SLOTS),
                      "fp8_e5m2", 1.0, 1.0, match="fp8_e5m2",
                      message="reshape_and_cache into float8_e4m3fn caches with kv_cache_dtype='fp8_e5m2' "
                              "(use cache_format(kv_cache_dtype, key_cache))")


# ---- task 5: the engine on the learner's fp8 code ------------------------------------------------

WAVE = [(f"r{i}", [(7 * i + 3 * k) % 200 + 1 for k in range(12 + i)], 16) for i in range(6)]
ENGINE = dict(num_gpu_blocks=64, swap_space=0)
# the seams the engine calls in each run; your reshape_and_cache calls your quantize_fp8 and your KVAmax.scales
# your scale_from_amax directly (notebook names), so those two are left out of the plug where only they call them
DYNAMIC = ["scale_from_amax", "dequantize_fp8", "amax_per_head", "reshape_and_cache"]
CALIBRATED = ["dequantize_fp8", "scales", "reshape_and_cache"]
CAL_AMAX = KVAmax(key=torch.tensor([[3.0, 4.0], [2.5, 3.5]]), value=torch.tensor([[1.5, 2.0], [2.5, 1.0]]),
                  source="hand-made")


def _agreement(ref, got):
    """Share of tokens equal up to each request's first difference (after it the texts differ)."""
    same = sum(next((i for i, (a, b) in enumerate(zip(ref[r], got[r])) if a != b), len(ref[r])) for r in ref)
    return same / sum(len(t) for t in ref.values())


def _scales(run):
    cache = run.engine.runner.kv_cache
    return [s.tolist() for s in cache.k_scale + cache.v_scale]


@functools.cache
def _reference(kind, path=None):
    """The reference engine's run: tokens and K/V scales per layer."""
    args = dict(calculate_kv_scales=True) if kind == "dynamic" else dict(kv_cache_scales=path, kv_scales_per_head=True)
    run = run_engine([WAVE], kv_cache_dtype="fp8", **args, **ENGINE)
    return run.tokens, _scales(run)


@pytest.mark.points(3)
@pytest.mark.end_to_end
@pytest.mark.task("engine")
def test_engine_fp8_dynamic_scales(student):
    """tiny-llama, fp8 e4m3 KV with scales from the first batch, on your functions: the reference engine's tokens
    and scales, and greedy agreement with the fp32-KV run of at least 90 % (tolerance 0.1 below 1.0: the
    reference reaches 1.0 on this workload; an fp8 store that loses the scale or rounds wrongly does not)."""
    with plug(student, LAB, only=DYNAMIC):
        fp8 = run_engine([WAVE], kv_cache_dtype="fp8", calculate_kv_scales=True, **ENGINE)
        fp32 = run_engine([WAVE], **ENGINE)
    expect_equal(fp8.tokens, _reference("dynamic")[0],
                 "6 prompts of 12-17 tokens, 16 greedy tokens each, kv_cache_dtype='fp8', calculate_kv_scales=True: tokens")
    expect_close(_scales(fp8), _reference("dynamic")[1],
                 "the same run: k_scale of layers 0, 1 then v_scale of layers 0, 1 (from the first batch)", rtol=1e-6)
    expect_close(_agreement(fp32.tokens, fp8.tokens), 1.0,
                 "the same run against kv_cache_dtype='auto' (fp32): share of tokens equal up to each first difference",
                 atol=0.1)


@pytest.mark.points(2)
@pytest.mark.end_to_end
@pytest.mark.task("engine")
def test_engine_fp8_calibrated_per_head(student, tmp_path):
    """A calibration file (per-head maxima) loaded with kv_cache_scales and kv_scales_per_head=True: your
    KVAmax.scales sets one scale per KV head; tokens and scales must be the reference engine's."""
    path = tmp_path / "scales.json"
    save_kv_amax(path, CAL_AMAX, "tiny-llama")
    with plug(student, LAB, only=CALIBRATED):
        run = run_engine([WAVE], kv_cache_dtype="fp8", kv_cache_scales=str(path), kv_scales_per_head=True, **ENGINE)
    expect_close(_scales(run), [[3 / 448, 4 / 448], [2.5 / 448, 3.5 / 448], [1.5 / 448, 2 / 448], [2.5 / 448, 1 / 448]],
                 "calibration file with K maxima [[3, 4], [2.5, 3.5]] and V maxima [[1.5, 2], [2.5, 1]] (layers x KV "
                 "heads), per head, e4m3: k_scale of layers 0, 1 then v_scale of layers 0, 1", rtol=1e-6)
    expect_equal(run.tokens, _reference("calibrated", str(path))[0],
                 "6 prompts, 16 greedy tokens each, fp8 KV with those calibrated per-head scales: tokens")


# ---- task 5b: int8 beside fp8 --------------------------------------------------------------------

def _int8_codes64(x, scale):
    """clamp(round(x / s), -127, 127) in float64 (a [H] scale per KV head): what an int8 store must hold."""
    s = scale.double()[:, None] if isinstance(scale, torch.Tensor) and scale.dim() == 1 else torch.tensor(scale).double()
    return torch.round(x.double() / s).clamp(-127, 127)


@pytest.mark.points(2)
@pytest.mark.task("int8_kv")
def test_int8_round_trip_by_hand(student):
    """scale 0.25: 0.125 -> 0.5 rounds half to even, 0; 0.375 -> 1.5 -> 2; -1.0 -> -4; 40 -> 160 saturates at 127;
    -inf -> -127 (symmetric: -128 is never stored). Read back: code * 0.25."""
    x = torch.tensor([[[0.125, 0.375, -1.0, 40.0, float("-inf")]]])
    with plug(student, LAB, only=["quantize_int8", "dequantize_int8"]):
        codes = student.quantize_int8(x, 0.25)
        back = student.dequantize_int8(codes, 0.25, torch.float32)
    expect_equal((str(codes.dtype), codes.tolist()), ("torch.int8", [[[0, 2, -4, 127, -127]]]),
                 "quantize_int8([[[0.125, 0.375, -1.0, 40.0, -inf]]], 0.25): (dtype, codes)")
    expect_equal((str(back.dtype), back.tolist()), ("torch.float32", [[[0.0, 0.5, -1.0, 31.75, -31.75]]]),
                 "dequantize_int8(those codes, 0.25, torch.float32)")


@pytest.mark.points(2)
@pytest.mark.task("int8_kv")
def test_int8_per_head_scales_equal_float64(student):
    """40 tokens x 3 KV heads x 16, per-head scales [2^-7, 2^-4, 2^-2] (powers of two divide exactly, so fp32
    codes equal float64's) and a 0-dim scale: the codes and the values read back (bf16 too) equal float64's."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(40, 3, 16, generator=gen) * torch.tensor([0.5, 4.0, 30.0])[:, None]
    scale = torch.tensor([2.0**-7, 2.0**-4, 2.0**-2])
    with plug(student, LAB, only=["quantize_int8", "dequantize_int8"]):
        codes = student.quantize_int8(x, scale)
        back = student.dequantize_int8(codes, scale, torch.bfloat16)
        tensor_codes = student.quantize_int8(x, torch.tensor(0.125))
    expect_equal(codes.tolist(), _int8_codes64(x, scale).long().tolist(),
                 "quantize_int8(x [40, 3, 16], per-head scales [2^-7, 2^-4, 2^-2]): the codes (head 2 saturates)")
    expect_equal(back.float().tolist(), (_int8_codes64(x, scale) * scale.double()[:, None]).to(torch.bfloat16)
                 .float().tolist(), "dequantize_int8(those codes, the same scales, torch.bfloat16)")
    expect_equal(tensor_codes.tolist(), _int8_codes64(x, 0.125).long().tolist(),
                 "quantize_int8(x, tensor(0.125)): one scale for every head")


@pytest.mark.points(2)
@pytest.mark.task("int8_kv")
def test_int8_per_token_head(student):
    """9 tokens x 2 heads x 128, token 4 1000x larger, token 7's head 1 all zero: scales [9, 2] fp32 equal to each
    vector's amax / 127 (1 for the zero vector) within 1e-6, the codes round(x / scale); 132 bytes per head vector
    (128 codes + a 4-byte scale)."""
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(9, 2, 128, generator=gen)
    x[4] *= 1000.0
    x[7, 1] = 0.0
    with plug(student, LAB, only=["quantize_int8_per_token_head"]):
        codes, scales = student.quantize_int8_per_token_head(x)
    amax = x.double().abs().amax(dim=-1)
    expect_equal([str(codes.dtype), list(codes.shape), str(scales.dtype), list(scales.shape)],
                 ["torch.int8", [9, 2, 128], "torch.float32", [9, 2]],
                 "quantize_int8_per_token_head(x [9, 2, 128]): codes and scales, dtypes and shapes")
    expect_close(scales.double(), torch.where(amax > 0, amax / 127, torch.ones_like(amax)),
                 "the scales: each head vector's max |x| / 127, 1 for token 7's all-zero head 1", rtol=1e-6, atol=0)
    expect_equal(codes.tolist(), torch.round(x.double() / scales.double()[..., None]).long().tolist(),
                 "the codes: round(x / its vector's scale)")
    expect_equal(codes[0, 0].nbytes + scales[0, 0].nbytes, 132, "bytes of one head vector: codes + its scale")


def _round_trip_errors64(x):
    """The three one-byte stores of K, written here: mean over head vectors of ||x_hat - x|| / ||x|| (float64)."""
    amax = x.abs().amax(dim=(0, 2)).double()
    x64 = x.double()

    def relative(x_hat):
        return ((x_hat - x64).norm(dim=-1) / x64.norm(dim=-1)).mean().item()

    fp8_scale = (amax / 448.0).float()
    int8_scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    token_scale = x64.abs().amax(dim=-1, keepdim=True) / 127
    return {"fp8_e4m3": relative(_cast(x, fp8_scale).double() * fp8_scale.double()[:, None]),
            "int8": relative(_int8_codes64(x, int8_scale.float()) * int8_scale.float().double()[:, None]),
            "int8_per_token_head": relative(torch.round(x64 / token_scale).clamp(-127, 127) * token_scale)}


ROUND_TRIPS = ("fp8_e4m3", "int8", "int8_per_token_head")


def _k_like(outlier):
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(64, 2, 16, generator=gen) * torch.tensor([1.0, 4.0])[:, None]
    if outlier:
        x[10] *= 30.0
    return x


@pytest.mark.points(2)
@pytest.mark.task("round_trip_errors")
def test_round_trip_errors_against_fp8(student):
    """K-like values, 64 tokens x 2 heads (scales 1 and 4) x 16, without and with token 10 30x larger. Without:
    int8 per head 0.0086, e4m3 0.026 (int8's even steps are 3x finer); with the outlier the static int8 scale is
    set by it: int8 0.18, e4m3 still 0.026; per token and head int8 0.0047 in both. Each within 1e-4 relative
    of the float64 specification (fp32 quantization against float64 arithmetic)."""
    for outlier in (False, True):
        with plug(student, LAB, only=["quantize_int8", "dequantize_int8", "quantize_int8_per_token_head",
                                      "quantize_fp8", "dequantize_fp8", "scale_from_amax", "amax_per_head"]):
            got = student.round_trip_errors(_k_like(outlier))
        expect_equal(sorted(got), list(ROUND_TRIPS), "round_trip_errors(x): its keys")
        expect_close([got[k] for k in ROUND_TRIPS], [_round_trip_errors64(_k_like(outlier))[k] for k in ROUND_TRIPS],
                     f"round_trip_errors(K-like x [64, 2, 16]{', token 10 x30' if outlier else ''}): mean relative "
                     f"error per head vector of fp8_e4m3, int8, int8_per_token_head", rtol=1e-4, atol=0)


@pytest.mark.points(2)
@pytest.mark.task("predicted_int8_kv_bytes")
def test_predicted_int8_kv_bytes(student):
    """Llama-3-8B: 2 x 32 layers x 8 KV heads = 512 head vectors per token of 128 values: bf16 131,072 bytes, fp8
    65,536 (scales per tensor or head: nothing per token), int8_per_token_head 512 x (128 + 4) = 67,584 (3 % more
    than fp8). Exact: K and V forgotten halves them, a 2-byte scale gives 66,560."""
    got = student.predicted_int8_kv_bytes()
    expect_equal(sorted(got), ["bf16", "fp8", "int8_per_token_head"], "predicted_int8_kv_bytes(): its keys")
    for name, want in (("bf16", 131_072), ("fp8", 65_536), ("int8_per_token_head", 67_584)):
        expect_prediction(got[name], want, f"predicted_int8_kv_bytes()[{name!r}]: KV bytes per token of Llama-3-8B",
                          rtol=0)


@functools.cache
def _reference_int8():
    run = run_engine([WAVE], kv_cache_dtype="int8", calculate_kv_scales=True, kv_scales_per_head=True, **ENGINE)
    return run.tokens, _scales(run)


@pytest.mark.points(2)
@pytest.mark.end_to_end
@pytest.mark.task("int8_kv")
def test_engine_int8_kv(student):
    """tiny-llama with kv_cache_dtype="int8", per-head scales from the first batch: your reshape_and_cache writes
    every token with your quantize_int8 (a notebook name, so quantize_int8 itself is left out of the plug), every
    attention read calls your dequantize_int8, the first batch's maxima come from your amax_per_head; the tokens
    and scales equal the reference engine's."""
    with plug(student, LAB, only=["reshape_and_cache", "dequantize_int8", "amax_per_head"]) as plugged:
        int8 = run_engine([WAVE], kv_cache_dtype="int8", calculate_kv_scales=True, kv_scales_per_head=True, **ENGINE)
    setup = "6 prompts of 12-17 tokens, 16 greedy tokens each, kv_cache_dtype='int8', per-head dynamic scales"
    expect_equal(plugged.uncalled(), [], f"{setup}: your functions the engine never called")
    expect_equal(int8.tokens, _reference_int8()[0], f"{setup}: tokens")
    expect_close(_scales(int8), _reference_int8()[1], f"{setup}: k_scale then v_scale per layer", rtol=1e-6)


# ---- task 6: capacity and the prediction ---------------------------------------------------------

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
                 tie_word_embeddings=False)
H100 = 81559 * 2 ** 20
LLAMA3_8B_PARAMS = 8_030_261_248


@pytest.mark.points(2)
@pytest.mark.task("kv_capacity")
def test_kv_capacity_doubles_with_fp8(student):
    """Llama-3-8B, bf16 weights, on an H100 at 90 %: (0.9 x memory - 2 x 8,030,261,248) // (blocks x 131,072 B/token
    in bf16, 65,536 in fp8): fp8 KV fits twice the requests; weights that do not fit leave 0."""
    got = [student.kv_capacity(H100, 0.9, LLAMA3_8B, n, "bf16", kv, block_size=16)
           for n, kv in ((4096, "bf16"), (4096, torch.float8_e4m3fn), (1000, "bf16"), (1000, torch.float8_e4m3fn))]
    expect_equal(got, [int((0.9 * H100 - 2 * LLAMA3_8B_PARAMS) // (4096 * 131072)),
                       int((0.9 * H100 - 2 * LLAMA3_8B_PARAMS) // (4096 * 65536)),
                       int((0.9 * H100 - 2 * LLAMA3_8B_PARAMS) // (1008 * 131072)),
                       int((0.9 * H100 - 2 * LLAMA3_8B_PARAMS) // (1008 * 65536))],
                 "kv_capacity(H100 81559 MiB, 0.9, Llama-3-8B, context, 'bf16' weights, KV dtype, block_size=16) for "
                 "(4096, bf16), (4096, fp8 e4m3), (1000, bf16), (1000, fp8 e4m3): 1000 tokens take 63 blocks = 1008 slots")
    expect_equal(student.kv_capacity(16e9, 1.0, LLAMA3_8B, 4096, "bf16", torch.float8_e4m3fn), 0,
                 "kv_capacity(16e9 bytes, 1.0, Llama-3-8B, 4096, 'bf16', fp8): 16.06 GB of weights do not fit")


@pytest.mark.points(1)
@pytest.mark.task("kv_capacity")
def test_kv_capacity_matches_lab_01(student):
    """With one dtype for weights and KV it is lab 01's max_concurrent_requests."""
    cases = [(H100, 0.9, 2048, "bf16", 16), (40e9, 0.8, 300, "fp32", 16), (H100, 0.95, 8192, "bf16", 1)]
    got = [student.kv_capacity(g, u, LLAMA3_8B, n, d, d, block_size=b) for g, u, n, d, b in cases]
    expect_equal(got, [capacity_planner.max_concurrent_requests(g, u, LLAMA3_8B, n, d, block_size=b) for g, u, n, d, b in cases],
                 "kv_capacity with weight_dtype == kv_dtype for (H100, 0.9, 2048, bf16, blocks of 16), "
                 "(40e9, 0.8, 300, fp32, 16), (H100, 0.95, 8192, bf16, 1): lab 01's max_concurrent_requests")


@pytest.mark.points(2)
@pytest.mark.task("predicted_decode_speedup")
def test_predicted_decode_speedup(student):
    """(weights + bf16 KV) / (weights + fp8 KV) bytes for Llama-3-8B, batch 16 x 4096 tokens: about 1.21x.
    Tolerance 2 %: rounding 8.03 B parameters or GB vs GiB moves it by under 0.5 %; forgetting K and V's factor 2
    gives 1.12 (-8 %), "fp8 halves the step" gives 2.0."""
    expect_prediction(student.predicted_decode_speedup(),
                 (memory.weight_bytes(LLAMA3_8B, "bf16") + 16 * 4096 * memory.kv_cache_bytes_per_token(LLAMA3_8B, "bf16"))
                 / (memory.weight_bytes(LLAMA3_8B, "bf16") + 16 * 4096 * memory.kv_cache_bytes_per_token(LLAMA3_8B, E4M3)),
                 "predicted_decode_speedup(): modelled decode step with bf16 KV / with fp8 KV, Llama-3-8B bf16 weights, "
                 "batch 16 x 4096 tokens", rtol=0.02)


# ---- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.perf
@pytest.mark.points(2)
@pytest.mark.task("fp8_decode_bytes")
@pytest.mark.triton
def test_fp8_decode_moves_half_the_bytes(student):
    """On CUDA: 64 sequences x 4096 tokens written through your write path into an fp8 (e4m3, per-head scales)
    and a bf16 cache; the engine's Triton decode over the fp8 cache reads half the KV bytes and must run at
    least 1.3x as fast as over the bf16 one (KV is ~94 % of the bytes at this size; 2x is the ceiling)."""
    from grader.perf import assert_throughput
    from kernels.triton.decode_attention import paged_attention_decode

    device = torch.device("cuda")
    num_seqs, num_heads, num_kv_heads, head_dim, block_size, context = 64, 32, 8, 128, 16, 4096
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = num_seqs * context // block_size
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen, device=device)
    value = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen, device=device)
    slots = torch.arange(num_blocks * block_size, device=device)
    k_scale = key.abs().amax(dim=(0, 2)) / 448
    v_scale = value.abs().amax(dim=(0, 2)) / 448
    caches = {}
    with plug(student, LAB, only=["reshape_and_cache", "quantize_fp8"]):
        for dtype, name in ((E4M3, "fp8"), (torch.bfloat16, "auto")):
            kc, vc = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
            student.reshape_and_cache(key, value, kc, vc, slots, name, k_scale, v_scale)
            caches[name] = (kc, vc)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, -1).to(torch.int32)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    fp8_bytes = sum(c.numel() * c.element_size() for c in caches["fp8"])
    expect_equal(fp8_bytes * 2, sum(c.numel() * c.element_size() for c in caches["auto"]),
                 "bytes of the fp8 K + V caches x 2 against the bf16 caches' bytes")

    def close(out, ref):
        # e4m3 rounds each K and V by up to 2^-4; averaged over 4096 keys the outputs (~0.02) differ by ~1e-3
        torch.testing.assert_close(out.float(), ref.float(), atol=5e-3, rtol=0.1)

    assert_throughput(
        lambda: paged_attention_decode(query, *caches["fp8"], tables, seq_lens, head_dim ** -0.5, k_scale, v_scale),
        lambda: paged_attention_decode(query, *caches["auto"], tables, seq_lens, head_dim ** -0.5),
        bytes_moved=fp8_bytes, min_ratio=1.3, check=close)
