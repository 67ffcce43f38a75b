# Two commands do everything on a fresh machine: `make run` and `make test`.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

.PHONY: run test install models peers clean

$(STAMP): requirements.txt pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

models: $(STAMP)
	$(VENV)/bin/forerun models fetch

# The main job: speculative generation on the default pair, with speed and acceptance figures.
# Both models' weights in int8: the fastest exact set-up on CPUs without native bf16 matrix units
# (see docs/benchmarks.md); the output equals the int8 target's plain output.
run: models
	$(VENV)/bin/forerun generate --chat --max-tokens 128 \
		--prompt "Write a Python function that checks whether a string is a palindrome." \
		--model qwen2.5-coder-1.5b-instruct --quantization int8 \
		--speculative-model qwen2.5-coder-0.5b-instruct --speculative-quantization int8 \
		--num-speculative-tokens 3

# llama.cpp for `forerun bench --peers llama.cpp`, built once under FORERUN_HOME (~10 minutes on 2
# cores). Never needed by `make test`; the bench builds it on first use when this was not run.
peers: $(STAMP)
	$(VPY) -c 'import sys; from forerun.bench.llamacpp import main; sys.exit(main())'

test: models
	$(VPY) -m pytest -q -rs

clean:
	rm -rf $(VENV) *.egg-info
