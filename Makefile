# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: run test test-avx512-emulated install kernels models peers clean

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

# forerun's native kernels (forerun/native/src), compiled once per source version into
# FORERUN_HOME/kernels/; a machine without a compiler gets a message and the w8a8 format instead.
kernels: $(STAMP)
	$(VPY) -m forerun.native.build

install: $(STAMP) kernels

models: $(STAMP) kernels
	$(VENV)/bin/forerun models fetch

# The main job: speculative generation on the default pair, with speed and acceptance figures.
# `auto` picks the numeric format for the model and CPU found and says which (for these GGUF files,
# `gguf`: their own blocks through forerun's native kernels, rows bit-identical alone or batched;
# w8a8 where the kernels could not be built); the method is `auto` (suffix drafts on long matches,
# else the draft model over the 32k tokens the target writes most), and each step drafts up to 5
# tokens as this machine's measured costs and the acceptance so far say it pays. The output equals
# the target's own plain greedy output.
run: models
	$(VENV)/bin/forerun generate --chat --max-tokens 128 \
		--prompt "Write a Python function that checks whether a string is a palindrome." \
		--model qwen2.5-coder-1.5b-instruct --quantization auto \
		--speculative-model qwen2.5-coder-0.5b-instruct --speculative-quantization auto --draft-vocab 32768 \
		--num-speculative-tokens 5

# llama.cpp for `forerun bench --peers llama.cpp`, built once under FORERUN_HOME (~10 minutes on 2
# cores). Never needed by `make test`; the bench builds it on first use when this was not run.
peers: $(STAMP)
	$(VPY) -c 'import sys; from forerun.bench.llamacpp.build import main; sys.exit(main())'

test: models
	$(VENV)/bin/ruff check forerun tests
	$(VENV)/bin/ruff format --check forerun tests
	$(VPY) -m pytest -q -rs

# The avx512 path's bit-exactness tests on a CPU without AVX-512 (an AVX2 machine), its intrinsics
# emulated through SIMDe (needs Debian's libsimde-dev; about ten minutes on 2 cores), then the tiny
# models' tests whose forwards go through the kernels, on the widest path (here the emulated one):
# what to run after changing avx512.cpp or layer_impl.h where the CPU cannot run the path itself.
# Not in `make test`.
EMULATED_TESTS := tests/test_native.py tests/test_gguf_format.py tests/test_q4_0_format.py tests/test_qwen3.py \
	tests/test_rope_scaling.py tests/test_heads.py tests/test_logprobs.py tests/test_prefix_cache.py \
	tests/test_quantization.py tests/test_user_models.py tests/test_load.py
test-avx512-emulated: $(STAMP)
	FORERUN_EMULATE_AVX512=1 $(VPY) -m pytest -q -rs -m "not real" $(EMULATED_TESTS)

clean:
	rm -rf $(VENV) *.egg-info
