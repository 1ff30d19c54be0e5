"""Official tests of lab 15_fine_tune_to_serve: predictions of fine-tuning memory (full, LoRA, QLoRA), prefix-tuning
KV bytes and an unmerged adapter's FLOPs; QLoRA's NF4 (`nf4_levels`, `nf4_quantize`, `nf4_dequantize`,
`qlora_linear`); the fine-tune's guard rails and training loop, with a tiny fine-tune served by the engine;
`pack_examples` (contract only); RAG's extra TTFT.

The seams (grader/seams.py): `engine_core.models.quantization.nf4.nf4_quantize` / `nf4_dequantize`, which the engine
calls for `quantization="nf4"` (load and every GEMM), and `qlora_linear` (graded on its own: no engine path runs a
QLoRA training forward). The learner's `qlora_linear` calls their own `nf4_dequantize`. Expected values come from
the models' config.json written below, from float64 references and the QLoRA paper's NF4 table written here (not
the engine's module: bitsandbytes, the reference implementation, is not installed and its CPU support is partial),
from the contract of `pack_examples` written out (`_spec_pack`), and from reference runs in `functools.cache`
helpers after the plug block. Every graded check is an `expect_*` observation.
"""
import functools
import math
import tempfile

import pytest
import torch

from grader.harness import GPUS, LLM, LoRARequest, SamplingParams, preset_path
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "15_fine_tune_to_serve"

# config.json of meta-llama/Meta-Llama-3-8B and Meta-Llama-3-70B on Hugging Face: layers, hidden, heads, KV heads,
# intermediate, vocab (head_dim = hidden / heads = 128; untied embeddings)
MODELS = {"8B": (32, 4096, 32, 8, 14336, 128256), "70B": (80, 8192, 64, 8, 28672, 128256)}


def _config(name):
    layers, hidden, heads, kv, ffn, vocab = MODELS[name]
    return dict(model_type="llama", num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=False)


def _spec_linear_and_other(name):
    """(projection weights, every other parameter: embedding, LM head, 2 norms a layer and the final norm)."""
    layers, h, heads, kv, ffn, vocab = MODELS[name]
    q, k = h, kv * (h // heads)
    linear = layers * (h * q + 2 * h * k + q * h + 3 * h * ffn)
    return linear, 2 * vocab * h + layers * 2 * h + h


def _spec_lora_qv(name, rank=16):
    layers, h, heads, kv, _, _ = MODELS[name]
    return layers * rank * ((h + h) + (h + kv * (h // heads)))


def _spec_memory(name, method):
    linear, other = _spec_linear_and_other(name)
    if method == "full":
        return 16 * (linear + other)  # bf16 weight + bf16 grad + fp32 master + 2 fp32 moments
    if method == "lora":
        return 2 * (linear + other) + 16 * _spec_lora_qv(name)
    return linear * 4.5 / 8 + 2 * other + 16 * _spec_lora_qv(name)  # NF4 4 bits + fp32 absmax per 64


# ---- task 1: predictions -------------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("training_memory")
def test_predicted_lora_trainable_params(student):
    """r = 16 on q (4096 -> 4096) and v (4096 -> 1024) of Llama-3-8B: 16 x (8192 + 5120) x 32 layers = 6,815,744
    (0.085 % of 8.03 B); 70B: 16 x (16384 + 9216) x 80 = 32,768,000. Rank 8 on all seven projections of the 8B:
    20,971,520. Exact."""
    cases = [("8B", 16, ("q_proj", "v_proj")), ("70B", 16, ("q_proj", "v_proj"))]
    expect_prediction([student.lora_trainable_params(_config(m), r, t) for m, r, t in cases],
                      [_spec_lora_qv("8B"), _spec_lora_qv("70B")],
                      "lora_trainable_params(config, 16, ('q_proj', 'v_proj')) for Llama-3-8B and Llama-3-70B")
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    expect_prediction(student.lora_trainable_params(_config("8B"), 8, everything),
                      8 * 32 * (4096 * 2 + 2 * (4096 + 1024) + 4096 * 2 + 3 * (4096 + 14336)),
                      "lora_trainable_params(Llama-3-8B, 8, all seven projections)")


@pytest.mark.points(2)
@pytest.mark.task("training_memory")
def test_predicted_training_memory(student):
    """Llama-3-8B (8,030,261,248 parameters): full 128.5 GB, LoRA 16.17 GB, QLoRA 6.14 GB; Llama-3-70B
    (70,553,706,496): full 1,128.9 GB, LoRA 141.6 GB, QLoRA 43.2 GB. Within 0.1 %: 12 bytes a parameter (no fp32
    master), a base without its LM head, or NF4 without the absmax are outside."""
    for name in MODELS:
        expect_prediction([student.training_memory_bytes(_config(name), m) for m in ("full", "lora", "qlora")],
                          [_spec_memory(name, m) for m in ("full", "lora", "qlora")],
                          f"[training_memory_bytes(Llama-3-{name}, method) for full, lora, qlora] (r 16 on q, v)",
                          rtol=1e-3)


@pytest.mark.points(1)
@pytest.mark.task("training_memory")
def test_predicted_gpus_needed(student):
    """H100s of 81,559 MiB (85.5 GB): 8B full 2, LoRA 1, QLoRA 1; 70B full 14 (13.2), LoRA 2, QLoRA 1."""
    h100 = GPUS["H100-80GB"]
    got = [student.gpus_needed(_config(n), m, h100) for n in MODELS for m in ("full", "lora", "qlora")]
    expect_prediction(got, [math.ceil(_spec_memory(n, m) / (81559 * 2**20)) for n in MODELS
                            for m in ("full", "lora", "qlora")],
                      "gpus_needed(model, method, H100-80GB) for 8B then 70B, full, lora, qlora")


@pytest.mark.points(1)
@pytest.mark.task("prefix_and_flops")
def test_predicted_prefix_kv_bytes(student):
    """K and V x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 bytes a token for Llama-3-8B: a prefix of 20
    virtual tokens adds 2,621,440 bytes to every request; 70B (80 layers): 327,680 a token, 100 tokens 32,768,000."""
    expect_prediction([student.prefix_kv_bytes(_config("8B"), 20), student.prefix_kv_bytes(_config("70B"), 100),
                       student.prefix_kv_bytes(_config("8B"), 20, dtype_bytes=1)],
                      [2 * 32 * 8 * 128 * 2 * 20, 2 * 80 * 8 * 128 * 2 * 100, 2 * 32 * 8 * 128 * 1 * 20],
                      "[prefix_kv_bytes(8B, 20), prefix_kv_bytes(70B, 100), prefix_kv_bytes(8B, 20, dtype_bytes=1)]")


@pytest.mark.points(2)
@pytest.mark.task("prefix_and_flops")
def test_predicted_unmerged_lora_flops(student):
    """x A^T then (.) B^T: 2 r in + 2 r out FLOPs a token. q_proj of Llama-3-8B (4096 -> 4096) at r 16: 262,144
    extra against 33,554,432 (0.78 %); v_proj (4096 -> 1024) at r 64: 655,360 against 8,388,608 (7.8 %)."""
    for fin, fout, r in ((4096, 4096, 16), (4096, 1024, 64), (14336, 4096, 8)):
        extra, ratio = student.unmerged_lora_flops(fin, fout, r)
        expect_prediction([extra, ratio], [2 * r * (fin + fout), r * (fin + fout) / (fin * fout)],
                          f"unmerged_lora_flops({fin}, {fout}, rank={r}): (extra FLOPs a token, extra / base)",
                          rtol=1e-6)


# ---- task 2: NF4 ----------------------------------------------------------------------------------------

# QLoRA (Dettmers et al. 2023), appendix E: the NF4 data type's 16 values
NF4_PAPER = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
             -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
             0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
             0.7229568362236023, 1.0]


def _spec_quantize(w, block):
    """float64: nearest level per weight of each block's w / absmax; (packed uint8, absmax fp32)."""
    blocks = w.double().reshape(-1, block)
    absmax = blocks.abs().amax(1)
    scaled = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))[:, None]
    idx = (scaled[..., None] - torch.tensor(NF4_PAPER, dtype=torch.float64)).abs().argmin(-1).reshape(-1)
    return (idx[0::2] * 16 + idx[1::2]).to(torch.uint8), absmax.float()


def _spec_dequantize(packed, absmax, shape, block):
    idx = torch.stack([packed.long() // 16, packed.long() % 16], -1).reshape(-1, block)
    return (torch.tensor(NF4_PAPER, dtype=torch.float64)[idx] * absmax.double()[:, None]).reshape(shape)


def _weights(rows, cols, seed, scale=0.02):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.points(2)
@pytest.mark.task("nf4_levels")
def test_nf4_levels(student):
    """16 levels from normal quantiles (offset 0.9677083), sorted, divided by the largest: the paper's table to
    1e-6 (the table holds fp32 values)."""
    expect_close(student.nf4_levels(), torch.tensor(NF4_PAPER, dtype=torch.float64),
                 "nf4_levels(): QLoRA's NF4 table", rtol=0, atol=1e-6)


@pytest.mark.points(2)
@pytest.mark.task("nf4_quantize")
def test_nf4_one_block_by_hand(student):
    """One block of 64 weights w_i = 0.5 x level[i % 16]: absmax 0.5, indices 0, 1, ..., 15 four times, packed two
    a byte with the first in the high nibble: 0x01, 0x23, 0x45, ..., 0xEF (32 bytes)."""
    w = torch.tensor([0.5 * NF4_PAPER[i % 16] for i in range(64)]).reshape(2, 32)
    with plug(student, LAB):
        packed, absmax = student.nf4_quantize(w, 64)
    expect_equal([packed.dtype, packed.tolist(), absmax.tolist()],
                 [torch.uint8, [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF] * 4, [0.5]],
                 "nf4_quantize of a [2, 32] weight holding 0.5 x level[i % 16]: (packed dtype, bytes, absmax)")


@pytest.mark.points(3)
@pytest.mark.task("nf4_quantize")
def test_nf4_round_trip(student):
    """Dequantize bytes and scales made by the reference quantizer (a [32, 128] weight, blocks of 64): level x
    absmax to fp32 rounding (2^-23 relative), in the shape and dtype asked (fp32, and bf16)."""
    w = _weights(32, 128, seed=3)
    packed, absmax = _spec_quantize(w, 64)
    with plug(student, LAB):
        out = student.nf4_dequantize(packed, absmax, (32, 128), 64)
        out16 = student.nf4_dequantize(packed, absmax, (32, 128), 64, torch.bfloat16)
    expect_close(out, _spec_dequantize(packed, absmax, (32, 128), 64), "nf4_dequantize, [32, 128], block 64, fp32",
                 rtol=2**-23, atol=0)
    expect_equal([out16.dtype, list(out16.shape)], [torch.bfloat16, [32, 128]],
                 "nf4_dequantize(..., dtype=torch.bfloat16): dtype and shape")


@pytest.mark.points(1)
@pytest.mark.task("nf4_quantize")
def test_nf4_blocks_and_zero_block(student):
    """A [48, 128] weight with an all-zero block, blocks of 64 and of 32: every byte and scale as the float64
    reference's (the zero block: absmax 0, indices 7, bytes 0x77)."""
    for block in (64, 32):
        w = _weights(48, 128, seed=block)
        w[3, :block] = 0
        with plug(student, LAB):
            packed, absmax = student.nf4_quantize(w, block)
        expect_equal(packed.tolist(), _spec_quantize(w, block)[0].tolist(),
                     f"nf4_quantize([48, 128] with a zero block, block_size={block}): packed bytes")
        expect_close(absmax, _spec_quantize(w, block)[1], f"nf4_quantize(..., block_size={block}): absmax",
                     rtol=0, atol=0)


@pytest.mark.points(1)
@pytest.mark.task("nf4_quantize")
def test_nf4_bad_size(student):
    """100 weights are not a whole number of blocks of 64."""
    with plug(student, LAB):
        expect_raises(ValueError, student.nf4_quantize, torch.zeros(100), 64, match=r"block_size",
                      message="nf4_quantize(100 weights, 64): a ValueError naming block_size")


def _qlora_case(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 128, generator=gen)
    x = torch.randn(5, 128, generator=gen).to(dtype)
    a, b = torch.randn(8, 128, generator=gen) * 0.1, torch.randn(96, 8, generator=gen) * 0.1
    packed, absmax = _spec_quantize(w, 64)
    return x, packed, absmax, a, b


def _spec_qlora(x, packed, absmax, a, b, scaling, dtype):
    """float64 of the same inputs, each first rounded to x's dtype (the weight after dequantization, A and B)."""
    w = _spec_dequantize(packed, absmax, (96, 128), 64).to(dtype).double()
    x64, a64, b64 = x.double(), a.to(dtype).double(), b.to(dtype).double()
    return x64 @ w.T + scaling * (x64 @ a64.T) @ b64.T


@pytest.mark.points(3)
@pytest.mark.task("qlora_linear")
def test_qlora_linear_matches_float64(student):
    """x [5, 128] fp32, W [96, 128] in NF4, r 8, scaling 2.0: within fp32 rounding of 128-term sums of float64."""
    x, packed, absmax, a, b = _qlora_case(torch.float32, seed=5)
    with plug(student, LAB):
        y = student.qlora_linear(x, packed, absmax, (96, 128), a, b, 2.0)
    expect_close(y, _spec_qlora(x, packed, absmax, a, b, 2.0, torch.float32),
                 "qlora_linear(x [5, 128] fp32, NF4 W [96, 128], A [8, 128], B [96, 8], scaling 2.0)",
                 rtol=1e-5, atol=1e-4)


@pytest.mark.points(1)
@pytest.mark.task("qlora_linear")
def test_qlora_linear_bf16(student):
    """bf16 activations: the output is bf16, within bf16 rounding (8 bits: 2^-8 relative a step) of float64 on the
    bf16-rounded inputs; scaling 0.5."""
    x, packed, absmax, a, b = _qlora_case(torch.bfloat16, seed=6)
    with plug(student, LAB):
        y = student.qlora_linear(x, packed, absmax, (96, 128), a, b, 0.5)
    expect_equal(y.dtype, torch.bfloat16, "qlora_linear on bf16 x: the output dtype")
    expect_close(y.double(), _spec_qlora(x, packed, absmax, a, b, 0.5, torch.bfloat16),
                 "qlora_linear(x [5, 128] bf16, ..., scaling 0.5) against float64", rtol=2e-2, atol=0.15)


E2E_PROMPTS = [[1, 5, 9, 44, 7], [1, 300, 2, 17, 17, 17, 80, 3, 90], [1, 64]]


def _nf4_tokens():
    llm = LLM("tiny-llama", quantization="nf4", kv_cache_memory_bytes=2**22)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(E2E_PROMPTS, greedy, use_tqdm=False)]


@functools.cache
def _reference_nf4_tokens():
    return _nf4_tokens()


@pytest.mark.points(3)
@pytest.mark.task("nf4_engine")
@pytest.mark.end_to_end
def test_engine_serves_your_nf4(student):
    """tiny-llama with quantization="nf4": your nf4_quantize at load, your nf4_dequantize at every GEMM; 3 prompts,
    10 greedy tokens each, the reference engine's tokens."""
    with plug(student, LAB, only=["nf4_quantize", "nf4_dequantize"]) as plugged:
        tokens = _nf4_tokens()
    expect_equal(plugged.uncalled(), [], "tiny-llama, quantization='nf4': your functions the engine never called")
    expect_equal(tokens, _reference_nf4_tokens(), "tiny-llama, quantization='nf4', prompts of 5, 9 and 2 tokens: "
                 "10 greedy tokens each (the reference engine's)")


# ---- task 3: the fine-tune -----------------------------------------------------------------------------

MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"}


@pytest.mark.points(2)
@pytest.mark.task("finetune")
def test_lora_settings_refused(student):
    """rank 0, -1, 1.5 and True; alpha 0, -2, nan and inf; no target, a module the model lacks ('qkv_proj'): each a
    ValueError naming the parameter. r 16, alpha 32 on q and v: scaling 2.0; r 8, alpha 8: 1.0."""
    qv = ("q_proj", "v_proj")
    for rank in (0, -1, 1.5, True):
        expect_raises(ValueError, student.check_lora_settings, rank, 32, qv, MODULES, match=r"rank",
                      message=f"check_lora_settings(rank={rank!r}, ...): a ValueError naming rank")
    for alpha in (0, -2, float("nan"), float("inf")):
        expect_raises(ValueError, student.check_lora_settings, 16, alpha, qv, MODULES, match=r"lora_alpha",
                      message=f"check_lora_settings(16, lora_alpha={alpha!r}, ...): a ValueError naming lora_alpha")
    for targets in ((), ("q_proj", "qkv_proj")):
        expect_raises(ValueError, student.check_lora_settings, 16, 32, targets, MODULES, match=r"target_modules",
                      message=f"check_lora_settings(16, 32, {targets!r}, ...): a ValueError naming target_modules")
    expect_close([student.check_lora_settings(16, 32, qv, MODULES), student.check_lora_settings(8, 8, qv, MODULES)],
                 [2.0, 1.0], "check_lora_settings(16, 32, q and v) and (8, 8, q and v): the scaling alpha / rank")


TASK_ANSWER = [7, 8, 9]  # the tiny task: after any 6-token prompt, answer these three tokens


def _tiny_batches(seed=0, num=4, size=16):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        prompts = torch.randint(10, 500, (size, 6), generator=gen)
        ids = torch.cat([prompts, torch.tensor(TASK_ANSWER).expand(size, 3)], 1)
        labels = ids.clone()
        labels[:, :6] = -100  # only the answer is scored
        batches.append({"input_ids": ids, "labels": labels})
    return batches


def _tiny_model():
    """tiny-llama (random weights, fp32) with a fresh rank-8 LoRA on q and v (PEFT's init, seed 0)."""
    import peft
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(preset_path("tiny-llama"), dtype=torch.float32)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))


HELD_OUT = torch.randint(10, 500, (16, 6), generator=torch.Generator().manual_seed(99)).tolist()


def _served_answers(model):
    """Save the PEFT folder, load it in the engine (lab 09's LoRARequest) and answer the 16 held-out prompts."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        llm = LLM("tiny-llama", enable_lora=True, max_lora_rank=8, kv_cache_memory_bytes=2**22)
        greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outs = llm.generate(HELD_OUT, greedy, use_tqdm=False, lora_request=LoRARequest("tiny-task", 1, folder))
    return [o.outputs[0].token_ids for o in outs]


def _reference_train(model, batches, steps, lr):
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@functools.cache
def _reference_tiny_run():
    model = _tiny_model()
    losses = _reference_train(model, _tiny_batches(), 40, 2e-2)
    answers = _served_answers(model)
    return [losses[i] for i in (0, 5, 10)], len(losses), sum(a == TASK_ANSWER for a in answers) / len(answers)


@pytest.mark.points(3)
@pytest.mark.task("finetune")
def test_train_lora_tiny_task_served_by_the_engine(student):
    """tiny-llama + a rank-8 LoRA on q and v, 40 Adam steps at lr 2e-2 over 4 batches of 16 (6 random tokens, then
    always 7, 8, 9): your losses at steps 0, 5 and 10 (within 2 %: the first steps are stable to the order of
    floating-point operations), 40 losses, and the adapter saved as a PEFT folder and served by the engine answers
    the 16 held-out prompts with 7, 8, 9 about as often as the reference run's (within 4 of 16)."""
    model = _tiny_model()
    losses = student.train_lora(model, _tiny_batches(), 40, 2e-2)
    answers = _served_answers(model)
    expect_close([losses[i] for i in (0, 5, 10)], _reference_tiny_run()[0],
                 "train_lora(tiny-llama + LoRA r 8, 4 batches, 40 steps, lr 2e-2): the losses at steps 0, 5, 10",
                 rtol=0.02)
    expect_equal(len(losses), _reference_tiny_run()[1], "train_lora(..., steps=40): how many losses it returns")
    expect_close(sum(a == TASK_ANSWER for a in answers) / len(answers), _reference_tiny_run()[2],
                 "the fine-tune served by the engine: the share of 16 held-out prompts answered 7, 8, 9", atol=0.25)


@pytest.mark.points(2)
@pytest.mark.task("finetune")
def test_train_lora_stops_at_nan(student):
    """Batch 1 has every label -100 (a data bug: nothing to score, the mean loss is 0 / 0 = NaN): a FloatingPointError
    naming step 1 and learning_rate, and the LoRA weights are those after step 0 alone (the NaN step ran no backward
    and no update: Adam would still have moved them by its momentum)."""
    model = _tiny_model()
    batches = _tiny_batches()
    batches[1] = {"input_ids": batches[1]["input_ids"], "labels": torch.full_like(batches[1]["labels"], -100)}
    expect_raises(FloatingPointError, student.train_lora, model, batches, 5, 2e-2,
                  match=r"(?s)(?=.*\bstep 1\b)(?=.*learning_rate)",
                  message="train_lora(..., steps=5) with batch 1 all -100: a FloatingPointError naming step 1 and "
                          "learning_rate")
    expect_close(torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]),
                 _weights_after_step_0(), "after the error: the 8 LoRA tensors, flattened (those after step 0 alone)",
                 rtol=1e-5, atol=1e-7)


@functools.cache
def _weights_after_step_0():
    model = _tiny_model()
    _reference_train(model, _tiny_batches()[:1], 1, 2e-2)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


@pytest.mark.points(2)
@pytest.mark.task("serving_decision")
def test_predicted_unmerged_overhead(student):
    """Llama-3-8B, r 16 on q and v: 2 x 6,815,744 extra FLOPs a token over 2 x (6,979,321,856 projection weights
    + 525,336,576 of LM head) = 0.091 %; r 64 on all seven projections: 2.23 %. Within 0.1 %."""
    layers, h, _, _, _, vocab = MODELS["8B"]
    base = 2 * (_spec_linear_and_other("8B")[0] + vocab * h)
    everything = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    all_seven = 64 * layers * (4096 * 2 + 2 * (4096 + 1024) + 4096 * 2 + 3 * (4096 + 14336))
    expect_prediction([student.unmerged_overhead(_config("8B"), 16, ("q_proj", "v_proj")),
                       student.unmerged_overhead(_config("8B"), 64, everything)],
                      [2 * _spec_lora_qv("8B") / base, 2 * all_seven / base],
                      "[unmerged_overhead(Llama-3-8B, 16, q and v), unmerged_overhead(Llama-3-8B, 64, all seven)]",
                      rtol=1e-3)


@pytest.mark.points(1)
@pytest.mark.task("serving_decision")
def test_serving_decision(student):
    """One tenant: merge (zero extra cost). Many tenants: unmerged and batched over one base. The CPU gap: the extra
    small GEMMs' overheads, not FLOPs (LoRA does not touch the KV cache)."""
    expect_prediction(student.serving_decision(), {"one_tenant": "a", "many_tenants": "b", "cpu_gap": "a"},
                      "serving_decision(): one letter per question")


def _spec_perplexity(model, windows):
    """float64: exp of the mean over every predicted token of -log softmax(logits)[next token]."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(input_ids=w).logits[0, :-1].double(), dim=-1)
            nll -= logp.gather(1, w[0, 1:, None]).sum().item()
            count += w.shape[1] - 1
    return math.exp(nll / count)


@pytest.mark.points(2)
@pytest.mark.task("perplexity")
def test_perplexity_token_weighted(student):
    """tiny-llama (random weights) on windows of 17 and 40 random tokens: exp of the token-weighted mean NLL of the
    55 predicted tokens, within 1e-5 of float64 (the mean of the two windows' perplexities, or of their losses,
    differs by far more on these lengths)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(preset_path("tiny-llama"), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    windows = [torch.randint(3, 500, (1, 17), generator=gen), torch.randint(3, 500, (1, 40), generator=gen)]
    windows[0][0, 1:9] = 5  # a repeated run: its tokens are easier, so the two windows' losses differ
    expect_close(student.perplexity(model, windows), _spec_perplexity(model, windows),
                 "perplexity(tiny-llama, windows of 17 and 40 tokens)", rtol=1e-5)


# ---- task 4: packing (contract only) ------------------------------------------------------------------

def _spec_pack(examples, seq_len, eos_id):
    """The contract: token t of the stream (examples + eos, in order) goes to row t // seq_len, column
    t % seq_len; its position is its index inside its example; rows past the last full one are dropped."""
    tokens = [(tok, pos) for ex in examples for pos, tok in enumerate([*ex, eos_id])]
    rows = len(tokens) // seq_len
    ids = [[tokens[r * seq_len + c][0] for c in range(seq_len)] for r in range(rows)]
    pos = [[tokens[r * seq_len + c][1] for c in range(seq_len)] for r in range(rows)]
    return ids, pos


def _observed(out):
    ids, pos = out
    return [ids.dtype, list(ids.shape), ids.tolist(), pos.dtype, pos.tolist()]


def _expected(examples, seq_len, eos_id):
    ids, pos = _spec_pack(examples, seq_len, eos_id)
    return [torch.long, [len(ids), seq_len], ids, torch.long, pos]


@pytest.mark.points(2)
@pytest.mark.task("pack_examples")
def test_pack_by_hand(student):
    """[5, 6, 7], [8, 9], [10, 11, 12, 13] with eos 2 and rows of 4: the stream 5 6 7 2 | 8 9 2 10 | 11 12 13 2,
    three rows; positions 0 1 2 3 | 0 1 2 0 | 1 2 3 4 (the third example continues across the row boundary)."""
    examples = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    expect_equal(_observed(student.pack_examples(examples, 4, 2)), _expected(examples, 4, 2),
                 "pack_examples([[5, 6, 7], [8, 9], [10, 11, 12, 13]], seq_len=4, eos_id=2): "
                 "[ids dtype, shape, ids, positions dtype, positions]")


@pytest.mark.points(1)
@pytest.mark.task("pack_examples")
def test_pack_contract_cases(student):
    """The tail dropped (11 tokens in rows of 4: 2 rows); one example longer than a row (positions run on); rows of
    1; nothing fits (shape [0, 8]); 20 random examples in rows of 16."""
    gen = torch.Generator().manual_seed(4)
    rand = [torch.randint(3, 50, (int(n),), generator=gen).tolist() for n in torch.randint(1, 20, (20,), generator=gen)]
    cases = [([[5, 6, 7], [8, 9, 10, 11, 12, 13]], 4, 0), ([list(range(3, 14))], 5, 1), ([[4], [5, 6]], 1, 0),
             ([[4, 5]], 8, 0), (rand, 16, 2)]
    for examples, seq_len, eos in cases:
        expect_equal(_observed(student.pack_examples(examples, seq_len, eos)), _expected(examples, seq_len, eos),
                     f"pack_examples({examples if len(examples) < 5 else '20 random examples'}, seq_len={seq_len}, "
                     f"eos_id={eos})")


@pytest.mark.points(1)
@pytest.mark.task("pack_examples")
def test_pack_bad_input(student):
    """seq_len 0 and an empty example: ValueErrors naming them."""
    expect_raises(ValueError, student.pack_examples, [[4, 5]], 0, 2, match=r"seq_len",
                  message="pack_examples([[4, 5]], seq_len=0, 2): a ValueError naming seq_len")
    expect_raises(ValueError, student.pack_examples, [[4, 5], []], 4, 2, match=r"examples\[1\]|empty",
                  message="pack_examples([[4, 5], []], 4, 2): a ValueError naming the empty example")


# ---- task 5: RAG --------------------------------------------------------------------------------------

def _spec_prefill_flops(name, n):
    """2 FLOPs per projection weight per token, the LM head once, 4 x layers x heads x 128 per (query, key) pair."""
    layers, h, heads, _, _, vocab = MODELS[name]
    linear, _ = _spec_linear_and_other(name)
    return 2 * linear * n + 2 * vocab * h + 4 * layers * heads * (h // heads) * n * (n + 1) / 2


@pytest.mark.points(2)
@pytest.mark.task("rag_extra_ttft")
def test_predicted_rag_extra_ttft(student):
    """Llama-3-8B on an H100 (989 TFLOP/s bf16): a 64-token question with 4 x 500 retrieved tokens adds
    2.79e13 FLOPs of projections and 1.1e12 of attention: 29.3 ms; 8,000 retrieved tokens: 125 ms (attention grows
    as n^2). Within 0.1 %."""
    h100 = GPUS["H100-80GB"]
    for retrieved in (2000, 8000):
        expect_prediction(student.rag_extra_ttft(_config("8B"), 64, retrieved, h100),
                          (_spec_prefill_flops("8B", 64 + retrieved) - _spec_prefill_flops("8B", 64)) / 989e12,
                          f"rag_extra_ttft(Llama-3-8B, question 64 tokens, {retrieved} retrieved, H100) in seconds",
                          rtol=1e-3)
