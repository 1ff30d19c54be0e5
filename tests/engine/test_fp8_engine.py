"""The fp8 KV cache through the engine: kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2, scales from the
first batch, a calibration file or the checkpoint, per tensor or per KV head; bad input rejected
before anything is built; twice the blocks of bf16 in the same memory; prefix caching, swap and
recompute unchanged."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_core import LLM, LLMEngine, SamplingParams
from engine_core.calibrate import calibrate_kv_amax, main as calibrate_main
from engine_core.presets import preset_path
from engine_core.worker.kv_scales import save_kv_amax

PROMPTS = ["The paged KV cache", "Hi", "Flash-decoding splits a long context"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def amax():
    """tiny-llama's calibration (2 layers, 2 KV heads): one run shared by the tests below."""
    return calibrate_kv_amax("tiny-llama", max_tokens=4)


@pytest.fixture
def scales_file(tmp_path, amax):
    path = tmp_path / "scales.json"
    save_kv_amax(path, amax, "tiny-llama")
    return path


def _scales(llm: LLM) -> tuple[list[list[float]], list[list[float]]]:
    kv = llm.engine.runner.kv_cache
    return [s.reshape(-1).tolist() for s in kv.k_scale], [s.reshape(-1).tolist() for s in kv.v_scale]


def test_dynamic_scales_come_from_the_first_batch_then_stay():
    llm = LLM("tiny-llama", kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks=64)
    kv = llm.engine.runner.kv_cache
    assert kv.key[0].dtype == torch.float8_e4m3fn and kv.observer is not None
    out = _tokens(llm)
    assert all(len(t) == 6 for t in out) and kv.observer is None
    first = _scales(llm)
    assert all(s != 1.0 and s > 0 for layer in first[0] + first[1] for s in layer)
    _tokens(llm, ["something else entirely, and longer than before"])
    assert _scales(llm) == first


@pytest.mark.parametrize("kv_cache_dtype, fmt_max", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)])
@pytest.mark.parametrize("per_head", [False, True])
def test_a_scales_file_sets_scales_for_the_format(scales_file, amax, kv_cache_dtype, fmt_max, per_head):
    llm = LLM("tiny-llama", kv_cache_dtype=kv_cache_dtype, kv_cache_scales=str(scales_file),
              kv_scales_per_head=per_head, num_gpu_blocks=64)
    k, v = _scales(llm)
    want_k = amax.key / fmt_max if per_head else amax.key.amax(1, keepdim=True) / fmt_max
    assert torch.allclose(torch.tensor(k), want_k) and len(v) == 2
    assert all(len(t) == 6 for t in _tokens(llm))


def test_fp8_with_a_scales_file_stays_close_to_the_fp32_cache(scales_file):
    """Calibrated e4m3 KV: the same greedy tokens as the fp32 cache on most of 16 prompts (one
    rounding of K/V to 3 mantissa bits can flip a near-tie; tiny-llama's margins are ~1)."""
    prompts = [[3 + i, 50 + 7 * i, 90, 11 * i % 500 + 3] * (1 + i % 5) for i in range(16)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    exact = _tokens(LLM("tiny-llama", num_gpu_blocks=64), prompts, params)
    fp8 = _tokens(LLM("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(scales_file), num_gpu_blocks=64),
                  prompts, params)
    assert sum(a == b for a, b in zip(exact, fp8)) >= 13, (exact, fp8)


def test_calibrate_command_writes_a_file_the_engine_loads(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one prompt\n\nanother, longer prompt\n")
    out = tmp_path / "s.json"
    assert calibrate_main(["--model", "tiny-llama", "--out", str(out), "--prompts", str(prompts),
                           "--max-tokens", "2"]) == 0
    doc = json.loads(out.read_text())
    assert (doc["num_layers"], doc["num_kv_heads"], doc["num_prompts"]) == (2, 2, 2)
    assert len(doc["k_amax"]) == 2 and len(doc["k_amax"][0]) == 2
    LLM("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(out), num_gpu_blocks=16)


def _checkpoint_with_scales(tmp_path, k_scale, v_scale, layers=(0, 1)):
    folder = tmp_path / "ckpt"
    shutil.copytree(preset_path("tiny-llama"), folder)
    tensors = load_file(folder / "model.safetensors")
    for i in layers:
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_checkpoint_k_scale_v_scale_are_e4m3_scales(tmp_path, scales_file, amax, kv_cache_dtype):
    folder = _checkpoint_with_scales(tmp_path, [0.01, 0.02], 0.03)
    llm = LLM(str(folder), kv_cache_dtype=kv_cache_dtype, kv_scales_per_head=True, num_gpu_blocks=16)
    gain = 448.0 / (448.0 if kv_cache_dtype == "fp8" else 57344.0)  # same max |K|, the format's range
    k, v = _scales(llm)
    assert k[1] == pytest.approx([0.01 * gain, 0.02 * gain]) and v[0] == pytest.approx([0.03 * gain] * 2)
    # a scales file wins over the checkpoint; dynamic scales (1.0 until the first batch) over both
    from_file = _scales(LLM(str(folder), kv_cache_dtype="fp8", kv_cache_scales=str(scales_file), num_gpu_blocks=16))
    assert torch.allclose(torch.tensor(from_file[0]), amax.key.amax(1, keepdim=True) / 448)
    assert _scales(LLM(str(folder), kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks=16))[0][0] == [1.0]


def test_checkpoint_scales_on_some_layers_only_are_an_error(tmp_path):
    folder = _checkpoint_with_scales(tmp_path, 0.01, 0.02, layers=(0,))
    with pytest.raises(ValueError, match="k_scale/v_scale tensors for some attention layers but not "
                                         "'model.layers.1.self_attn.k_scale'"):
        LLMEngine.from_kwargs(str(folder), kv_cache_dtype="fp8", num_gpu_blocks=16)


def test_no_scales_anywhere_means_scale_one():
    assert _scales(LLM("tiny-llama", kv_cache_dtype="fp8", num_gpu_blocks=16)) == ([[1.0]] * 2, [[1.0]] * 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache_dtype="fp8_e4m4"),
     r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\)"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_cache_scales="SCALES"),
     "calculate_kv_scales must be False when kv_cache_scales is given"),
    (dict(kv_cache_scales="SCALES"), "kv_cache_scales must be unset with kv_cache_dtype='auto'"),
    (dict(kv_scales_per_head=True), "kv_scales_per_head must be unset with kv_cache_dtype='auto'"),
    (dict(calculate_kv_scales=True), "calculate_kv_scales must be unset with kv_cache_dtype='auto'"),
    (dict(kv_cache_dtype="fp8", kv_cache_scales="/no/such/file.json"),
     "kv_cache_scales must be None or the path of an existing scales file"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales="yes"), "calculate_kv_scales must be True or False"),
])
def test_bad_fp8_arguments_name_the_parameter(scales_file, kwargs, message):
    kwargs = {k: str(scales_file) if v == "SCALES" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_kwargs("tiny-llama", **kwargs)


def _bad_file(tmp_path, scales_file, edit):
    doc = json.loads(scales_file.read_text())
    edit(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["k_amax"].pop(), r"k_amax must be a list of one entry per layer \(2 for this model\), got 1 rows"),
    (lambda d: d["v_amax"][1].append(1.0), r"v_amax\[1\] must be a number or a list of 2 numbers"),
    (lambda d: d["k_amax"][0].__setitem__(1, math.nan), r"k_amax\[0\] holds nan; every max \|value\| must be finite"),
    (lambda d: d["k_amax"][0].__setitem__(0, -1.0), r"k_amax\[0\] holds -1.0"),
    (lambda d: d.pop("format"), "is not a KV scales file"),
])
def test_a_bad_scales_file_names_the_file_and_the_entry(tmp_path, scales_file, edit, message):
    path = _bad_file(tmp_path, scales_file, edit)
    with pytest.raises(ValueError, match=f"kv_cache_scales file '{path}'.*{message}"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(path))


def test_per_head_scales_from_a_per_tensor_file_are_an_error(tmp_path, scales_file):
    path = _bad_file(tmp_path, scales_file, lambda d: (d.__setitem__("k_amax", [1.0, 2.0]),
                                                       d.__setitem__("v_amax", [1.0, 2.0])))
    LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(path), num_gpu_blocks=8)
    with pytest.raises(ValueError, match="kv_scales_per_head=True needs one scale per KV head, but kv_cache_scales "
                                         "file .* has one per layer"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(path), kv_scales_per_head=True)


def test_not_json_is_a_clear_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"kv_cache_scales file '{path}' is not readable JSON"):
        LLMEngine.from_kwargs("tiny-llama", kv_cache_dtype="fp8", kv_cache_scales=str(path))


@pytest.mark.parametrize("model_dtype, ratio", [("bfloat16", 2), ("float32", 4)])
def test_same_memory_budget_holds_more_fp8_blocks(model_dtype, ratio):
    """Issue #17's capacity line: fp8 (1 byte) holds 2x the blocks of bf16 (2 bytes), 4x fp32's."""
    budget = 3_000_000

    def blocks(**kw):
        e = LLMEngine.from_kwargs("tiny-llama", dtype=model_dtype, kv_cache_memory_bytes=budget, swap_space=0, **kw)
        assert e.scheduler.kv_cache_manager.num_gpu_blocks == e.runner.kv_cache.num_blocks
        return e.runner.kv_cache.num_blocks, e.runner.kv_cache.key[0].element_size()

    (plain, plain_bytes), (fp8, fp8_bytes) = blocks(), blocks(kv_cache_dtype="fp8")
    assert (plain_bytes, fp8_bytes) == (ratio, 1)
    fp8_block = 2 * 2 * 2 * 16 * 16  # K and V, 2 layers, 2 KV heads, head_dim 16, block_size 16, 1 byte
    assert (fp8, plain) == (budget // fp8_block, budget // (ratio * fp8_block))
    assert fp8 >= ratio * plain


# ---- prefix caching, swap and recompute work unchanged with fp8 --------------------------------------
def _generate_fp8(scales_file, **engine_args):
    from engine_helpers import E2E_PARAMS, E2E_PROMPTS

    llm = LLM(model="tiny-llama", block_size=4, max_model_len=128, max_num_batched_tokens=32, kv_cache_dtype="fp8",
              kv_cache_scales=str(scales_file), **engine_args)
    return [o.outputs[0].token_ids for o in llm.generate(E2E_PROMPTS, E2E_PARAMS, use_tqdm=False)], llm.engine.stats()


@pytest.mark.parametrize("mode, prefix", [("swap", False), ("recompute", False), ("auto", True)])
def test_fp8_outputs_survive_preemption_and_prefix_caching(scales_file, mode, prefix):
    """Static scales, so a block's fp8 codes depend only on its tokens: the outputs under memory
    pressure (swap moves the fp8 bytes, recompute rewrites them) equal those with plenty of blocks."""
    plenty, stats = _generate_fp8(scales_file, num_gpu_blocks=400)
    assert stats["num_preemptions"] == 0
    outs, stats = _generate_fp8(scales_file, num_gpu_blocks=20, preemption_mode=mode, enable_prefix_caching=prefix)
    assert stats["num_preemptions"] > 0, stats
    assert outs == plenty
    assert stats["kv_cache_usage"] == 0.0 and stats["cpu_kv_cache_usage"] == 0.0


# ---- on a GPU: the Triton fp8 paths and CUDA graphs with flash-decoding ------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: the Triton fp8 write path is only exact compiled, and CUDA "
                                       "graphs need a device")


@pytest.mark.parametrize("kv_cache_dtype, per_head", [("fp8", False), ("fp8_e5m2", True)])
def test_triton_fp8_engine_generates_the_reference_ops_tokens(scales_file, kv_cache_dtype, per_head):
    """The Triton cache write stores the reference's bytes, so both backends read the same fp8 cache. On CPU
    (the interpreter) and GPUs before sm_89 through the integer fp8 conversion, on sm_89+ the hardware's."""
    def run(backend):
        llm = LLM("tiny-llama", dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_scales=str(scales_file),
                  kv_scales_per_head=per_head, attention_backend=backend, enforce_eager=True, num_gpu_blocks=64)
        return _tokens(llm)

    assert run("triton") == run("torch")


@pytest.mark.gpu
@needs_cuda
def test_cuda_graphs_with_fp8_and_flash_decoding_match_eager(scales_file):
    """A 1500-token prompt: decode steps choose num_splits > 1 on any GPU with more than 2 SMs, and
    each (batch size, num_splits) pair gets its own graph."""
    prompts = [[3 + i % 400 for i in range(1500)], [5, 6, 7]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(**kw):
        llm = LLM("tiny-llama", dtype="float32", kv_cache_dtype="fp8", kv_cache_scales=str(scales_file),
                  num_gpu_blocks=256, **kw)
        return _tokens(llm, prompts, params), llm.engine.runner.cuda_graphs

    graphs_out, graphs = run()
    eager_out, _ = run(enforce_eager=True)
    assert graphs_out == eager_out
    assert any(splits > 1 for _, splits in graphs.graphs), sorted(graphs.graphs)
