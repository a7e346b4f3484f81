# The two commands of the README. Each sets itself up on a fresh machine (python3 + PyPI).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
CLI := $(VENV)/bin/mha-onnx
OUT := out
PRESET ?= base
# make test runs the suite in this many processes (pytest-xdist; the machines have 2 cores).
TEST_WORKERS ?= 2
# ONNX Runtime GenAI's generator, in an environment of its own (see genai-env below)
GENAI_RT := .venv-genai-rt

.PHONY: run test test-fast lint clean fixtures genai-fixtures bench-envs genai-env test-exports

# Byte-code: pip would compile all 2.2 GB it installs (40 s of the set-up here, 29 s on both
# cores with compileall), most of it never imported (transformers' hundreds of model
# families). Instead Python writes the .pyc of what is imported, when it is first imported:
# PYTHONDONTWRITEBYTECODE, set on some machines, would have every process (the test
# workers, their child processes, each CLI run) compile torch's and transformers' modules again.
unexport PYTHONDONTWRITEBYTECODE

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	@mkdir -p $(OUT)
	$(CLI) export --preset $(PRESET) --mask key-padding -o $(OUT)/$(PRESET).onnx --force
	$(CLI) inspect $(OUT)/$(PRESET).onnx
	$(CLI) fuse $(OUT)/$(PRESET).onnx -o $(OUT)/$(PRESET).fused.onnx --force
	$(CLI) validate $(OUT)/$(PRESET).fused.onnx --reference $(OUT)/$(PRESET).onnx
	$(CLI) profile $(OUT)/$(PRESET).onnx $(OUT)/$(PRESET).fused.onnx --seq-lens 128,512,2048 \
		--pad-fraction 0.25 --csv $(OUT)/profile.csv --plot $(OUT)/profile.png --force \
		--json > $(OUT)/profile.json
	$(CLI) report $(OUT)/profile.json -o $(OUT)/report.md --force
	$(CLI) package $(OUT)/$(PRESET).fused.onnx -o $(OUT)/repo --name $(PRESET) \
		--from-profile $(OUT)/profile.json --force

test: $(VENV)/.installed $(GENAI_RT)/.installed
	$(VENV)/bin/ruff check mha_onnx tests tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=25

# ONNX Runtime GenAI's generator alone (it pulls onnxruntime 1.32; ours is pinned at 1.31), so
# that the tests run it on the folders export and fuse write (tests/genai.py); a few seconds.
$(GENAI_RT)/.installed:
	test -x $(GENAI_RT)/bin/python || $(PYTHON) -m venv $(GENAI_RT)
	$(GENAI_RT)/bin/python -m pip install -q onnxruntime-genai==0.18.0
	touch $@

genai-env: $(GENAI_RT)/.installed

# Optimum exports committed under tests/fixtures/optimum (optimum-onnx 0.1.0 needs
# transformers < 4.58, so it gets an environment of its own; not part of make test).
OPT_VENV := .venv-optimum
$(OPT_VENV)/.installed:
	test -x $(OPT_VENV)/bin/python || $(PYTHON) -m venv $(OPT_VENV)
	$(OPT_VENV)/bin/python -m pip install -q torch==2.13.0 optimum-onnx==0.1.0 \
		'transformers<4.58' onnx==1.23.2 onnxruntime==1.31.1 sentencepiece
	touch $@

fixtures: $(OPT_VENV)/.installed
	$(OPT_VENV)/bin/python tools/optimum_fixtures.py --out tests/fixtures/optimum

# ORT GenAI's model builder (needs transformers >= 5, onnx-ir) for tools/bench_optimum and
# the builder's graphs under tests/fixtures/genai (committed; `make genai-fixtures` remakes them).
GENAI_VENV := .venv-genai
$(GENAI_VENV)/.installed:
	test -x $(GENAI_VENV)/bin/python || $(PYTHON) -m venv $(GENAI_VENV)
	$(GENAI_VENV)/bin/python -m pip install -q torch==2.13.0 transformers==5.24.0 \
		onnxruntime-genai==0.18.0 onnx-ir onnx==1.23.2 tokenizers
	touch $@

# llama.cpp's OpenAI server (llama-cpp-python, built from its sdist on this CPU: 10-20 min), the
# anchor of tools/bench_serve.py; never a dependency of the package. On a CPU with AMX, a native
# build (0.3.36) repacks Q4_0 weights for its AMX kernels and dies in the first inference
# (SIGSEGV in ggml_backend_amx_mul_mat: ggml-org/llama.cpp#20824, here on an Intel Xeon with
# AMX, 2026-12-07); there it is built for every other extension the CPU has, AMX left out (its
# AVX-512 repacking kept).
LLAMA_VENV := .venv-llama
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
$(LLAMA_VENV)/.installed:
	test -x $(LLAMA_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_VENV)
	if grep -qw amx_int8 /proc/cpuinfo; then export CMAKE_ARGS='$(LLAMA_CMAKE)'; fi; \
		$(LLAMA_VENV)/bin/python -m pip install -q --no-cache-dir 'llama-cpp-python[server]'
	touch $@

bench-envs: $(OPT_VENV)/.installed $(GENAI_VENV)/.installed $(GENAI_RT)/.installed \
	$(LLAMA_VENV)/.installed

genai-fixtures: $(GENAI_VENV)/.installed
	$(GENAI_VENV)/bin/python tools/genai_fixtures.py --out tests/fixtures/genai

# The exports the suite remembers (tests/export_memo.py), made again: the suite run once with
# every torch.export it makes written into tests/fixtures/exports (the old ones dropped).
test-exports: $(VENV)/.installed $(GENAI_RT)/.installed
	rm -rf tests/fixtures/exports
	MHA_ONNX_RECORD_EXPORTS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

# The loop of change-and-check: the unit tests (40 s on 2 cores; slow is set by what a test
# runs, and one not marked slow that reaches torch.export fails here: tests/conftest.py).
test-fast: $(VENV)/.installed
	MHA_ONNX_FORBID_TORCH_EXPORT=1 $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) \
		--dist worksteal

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mha_onnx tests tools

clean:
	rm -rf $(OUT) .pytest_cache
