PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo demo-translation docs figures test test-torch-2.11 test-mindspore
.PHONY: gpu-test gpu-wheels gpu-check bench bench-gpu bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/install_tcmalloc.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	bash tools/install_tcmalloc.sh $(VENV)
	touch $(STAMP)

# dp2 x mp2 x pp2 on 8 CPU processes; one log per rank and the checkpoints in runs/demo-<time>/, which the link
# runs/demo-latest names
demo: install
	name=demo-$$(date +%Y%m%d-%H%M%S) && \
	$(BIN)/paratrain launch --nproc-per-node 8 --name $$name -- train --config examples/demo.toml && \
	ln -sfn $$name runs/demo-latest && \
	echo "run directory: runs/$$name (also runs/demo-latest)"

# the reference pages generated from the code: docs/configuration.md, docs/cli.md, docs/deepspeed-keys.md
docs: install
	$(BIN)/python tools/gen_docs.py

# the figures of docs/images: the demo's loss (from runs/demo-latest: run make demo first) and the GPU throughput
figures: install
	$(BIN)/python tools/make_figures.py

SAMPLE := runs/data/sample
demo-translation: install
	test -f $(SAMPLE)/train/sample.en_fr.txt || $(BIN)/paratrain preprocess sample --out $(SAMPLE)
	test -f $(SAMPLE)/tokenizer.json || $(BIN)/paratrain tokenizer train \
		--input $(SAMPLE)/train/sample.en_fr.txt --vocab-size 1000 --out $(SAMPLE)/tokenizer.json
	$(BIN)/paratrain train --config examples/translation.toml

# the CPU suite, also on a CUDA machine: the device forced to the CPU; tests/gpu, tests/mindspore_reference left out
test: install
	PARATRAIN_DEVICE=cpu $(BIN)/python -m pytest -q tests --ignore=tests/gpu --ignore=tests/mindspore_reference

# the CPU suite under torch 2.11.0, the GPU machines' release (CI stays on 2.13), in a venv of its own:
# PyPI's CUDA build without most of its CUDA libraries (tools/install_torch_2.11.sh: 2.2 GB, ~1 minute)
VENV_211 := .venv-torch-2.11
$(VENV_211)/.installed: pyproject.toml tools/install_torch_2.11.sh tools/install_tcmalloc.sh
	bash tools/install_torch_2.11.sh $(VENV_211)
	touch $@

test-torch-2.11: $(VENV_211)/.installed
	PARATRAIN_DEVICE=cpu $(VENV_211)/bin/python -m pytest -q tests --ignore=tests/gpu --ignore=tests/mindspore_reference

# the reference suite: the MindSpore face against MindSpore 2.7.0 itself (CPU; the last release with the
# nn.transformer blocks), in a venv of its own with paratrain's dependencies (numpy < 2, as MindSpore needs)
VENV_MS := .venv-mindspore
$(VENV_MS)/.installed: pyproject.toml
	test -x $(VENV_MS)/bin/python || $(PYTHON) -m venv $(VENV_MS)
	$(VENV_MS)/bin/pip install -q --upgrade pip
	$(VENV_MS)/bin/pip install -q torch==2.13.0 mindspore==2.7.0 'numpy<2' -e . 'pytest>=7' 'pytest-timeout>=2'
	touch $@

test-mindspore: $(VENV_MS)/.installed
	PARATRAIN_DEVICE=cpu $(VENV_MS)/bin/python -m pytest -q tests/mindspore_reference

# The GPU targets run without a venv, pip or network (the lent GPU machines have none): on the machine's own
# python when its torch has CUDA (else .venv's; tools/gpu_python.sh says why neither will do and fails),
# with this tree and the committed wheels of the dependencies that python lacks on PYTHONPATH (imported from
# the zip: torchao's float8 training is Python over torch._scaled_mm; its compiled extras are not loaded).
GPU_WHEELS  := tomli_w torchao==0.18.0
GPU_PYTHON   = $$(bash tools/gpu_python.sh)
GPU_ENV      = PYTHONPATH=$(CURDIR)$(foreach w,$(wildcard wheels/*.whl),:$(CURDIR)/$(w)) PARATRAIN_DEVICE=cuda

# the GPU suite (tests/gpu); a test that needs more GPUs than there are runs with its ranks sharing them over
# gloo (test mode PARATRAIN_SHARED_GPU=1, tests/gpu/conftest.py; PARATRAIN_SHARED_GPU=0: skipped, with the reason)
gpu-test:
	@python=$(GPU_PYTHON) && $(GPU_ENV) $$python -m pytest -v -rs tests/gpu

# fill wheels/ from PyPI, on a machine with network: tomli_w's is committed; torchao's (3.3 MB, fp8) is not
# (.gitignore): fetch it before a GPU run and carry it to the GPU machine with the tree
gpu-wheels:
	rm -f wheels/*.whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --dest wheels $(GPU_WHEELS)

# everything a lent GPU machine should run, in under 10 minutes: the GPU suite (two ranks sharing a lone GPU),
# the refusals, the throughput bench, fp8 against bf16 (losses and speed); PARTS="fp8 shared" runs only those
gpu-check:
	bash tools/gpu_check.sh $(PARTS)

bench: install
	mkdir -p runs/bench
	$(BIN)/python bench/step_time.py --json runs/bench/step_time.json
	$(BIN)/python bench/parallel_cost.py --json runs/bench/parallel_cost.json
	$(BIN)/python bench/pipeline_bubble.py --json runs/bench/pipeline_bubble.json
	$(BIN)/python bench/checkpoint_io.py --json runs/bench/checkpoint_io.json
	$(BIN)/python bench/plan_check.py --json runs/bench/plan_check.json
	$(BIN)/python bench/llama_hf.py --json runs/bench/llama_hf.json
	$(BIN)/python bench/lora_memory.py --json runs/bench/lora_memory.json
	$(BIN)/python bench/context_parallel.py --json runs/bench/context_parallel.json

# one GPU, bf16: paratrain's Trainer against a plain PyTorch loop of the same ~1B GPT
bench-gpu:
	@python=$(GPU_PYTHON) && mkdir -p runs/bench && \
		$(GPU_ENV) $$python bench/gpu_throughput.py --json runs/bench/gpu_throughput.json

# paratrain's ZeRO stages and pipeline vs torch DDP/FSDP2 and DeepSpeed (installed on first use into
# runs/bench/peers-venv); ARGS=--quick for a ~10-minute pass
bench-peers: install
	mkdir -p runs/bench
	$(BIN)/python bench/peers.py --json runs/bench/peers.json $(ARGS)

clean:
	rm -rf runs .pytest_cache
