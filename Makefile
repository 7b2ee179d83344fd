PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo demo-translation test gpu-test bench bench-gpu bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml tools/install_tcmalloc.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	bash tools/install_tcmalloc.sh $(VENV)
	touch $(STAMP)

# dp2 x mp2 x pp2 on 8 CPU processes; one log per rank in runs/demo-<time>/
demo: install
	$(BIN)/paratrain launch --nproc-per-node 8 --name demo-$$(date +%Y%m%d-%H%M%S) -- train --config examples/demo.toml

SAMPLE := runs/data/sample
demo-translation: install
	test -f $(SAMPLE)/train/sample.en_fr.txt || $(BIN)/paratrain preprocess sample --out $(SAMPLE)
	test -f $(SAMPLE)/tokenizer.json || $(BIN)/paratrain tokenizer train \
		--input $(SAMPLE)/train/sample.en_fr.txt --vocab-size 1000 --out $(SAMPLE)/tokenizer.json
	$(BIN)/paratrain train --config examples/translation.toml

# the CPU suite, also on a CUDA machine: the device is forced to the CPU and tests/gpu left out
test: install
	PARATRAIN_DEVICE=cpu $(BIN)/python -m pytest -q tests --ignore=tests/gpu

# the GPU suite (tests/gpu): every test is skipped, with the reason, where CUDA or enough GPUs are missing
gpu-test: install
	PARATRAIN_DEVICE=cuda $(BIN)/python -m pytest -v -rs tests/gpu

bench: install
	mkdir -p runs/bench
	$(BIN)/python bench/step_time.py --json runs/bench/step_time.json
	$(BIN)/python bench/parallel_cost.py --json runs/bench/parallel_cost.json
	$(BIN)/python bench/pipeline_bubble.py --json runs/bench/pipeline_bubble.json
	$(BIN)/python bench/checkpoint_io.py --json runs/bench/checkpoint_io.json
	$(BIN)/python bench/plan_check.py --json runs/bench/plan_check.json

# one GPU, bf16: paratrain's Trainer against a plain PyTorch loop of the same ~1B GPT (exits 0 without CUDA)
bench-gpu: install
	mkdir -p runs/bench
	PARATRAIN_DEVICE=cuda $(BIN)/python bench/gpu_throughput.py --json runs/bench/gpu_throughput.json

# paratrain's ZeRO stages and pipeline vs torch DDP/FSDP2 and DeepSpeed (installed on first use into
# runs/bench/peers-venv); ARGS=--quick for a ~10-minute pass
bench-peers: install
	mkdir -p runs/bench
	$(BIN)/python bench/peers.py --json runs/bench/peers.json $(ARGS)

clean:
	rm -rf runs .pytest_cache
