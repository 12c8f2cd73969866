"""vLLM's side of `python -m bench.peer`: runs inside the peer's own virtual environment
(.venv-vllm, `make peer-vllm`), so it imports vLLM and the standard library only, never
structspec.

    .venv-vllm/bin/python bench/peer_vllm.py JOB.json OUT.json

JOB.json: {"model": dir, "schemas": [{...} per prompt], "max_tokens": n, "prompts": [[ids], ...],
"modes": ["batched", "one", "ngram"], "repeats": r, "max_model_len": n}. The prompts are token ids
built by structspec's own prompt builder, so both systems read the same input. For each mode,
one engine (LLM) is built and warmed up on the first prompt, outside the timing (vLLM's load
and compile excluded); then each repeat times generate() over every prompt: all at once
(`batched`, `ngram` with its n-gram speculation) or one call per prompt (`one`). Greedy, the
JSON Schema through vLLM's structured outputs. OUT.json: per mode, each repeat's seconds and
each prompt's output text and token count (from the last repeat).
"""

from __future__ import annotations

import gc
import json
import sys
import time


def build(job: dict, mode: str):
    from vllm import LLM

    kw = dict(model=job["model"], tokenizer=job["model"], dtype=job.get("dtype", "bfloat16"),
              max_model_len=job.get("max_model_len", 4096), seed=0, enable_prefix_caching=True)
    if mode == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": job.get("ngram_k", 4),
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    return LLM(**kw)


def params(job: dict, schema: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    return SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                          structured_outputs=StructuredOutputsParams(json=schema))


def run_mode(job: dict, mode: str) -> dict:
    t0 = time.perf_counter()
    llm = build(job, mode)
    sp = [params(job, schema) for schema in job["schemas"]]
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], sp[:1], use_tqdm=False)  # warm-up, outside the timing
    load_s = time.perf_counter() - t0
    seconds, outs = [], []
    for _ in range(job.get("repeats", 1)):
        # a fresh prefix cache each repeat: the prompts' own shared prefix is still reused, as ours is
        llm.reset_prefix_cache()
        t = time.perf_counter()
        if mode == "one":
            outs = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, sp)]
        else:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds.append(time.perf_counter() - t)
    result = {"load_and_warmup_s": round(load_s, 2), "seconds": [round(s, 3) for s in seconds],
              "outputs": [{"text": o.outputs[0].text, "tokens": len(o.outputs[0].token_ids),
                           "finish_reason": o.outputs[0].finish_reason} for o in outs]}
    del llm
    gc.collect()
    return result


def main(argv: list[str]) -> int:
    job = json.loads(open(argv[0], encoding="utf-8").read())
    import vllm

    out = {"vllm": vllm.__version__, "modes": {}}
    for mode in job["modes"]:
        out["modes"][mode] = run_mode(job, mode)
        print(f"vllm {mode}: {out['modes'][mode]['seconds']} s", file=sys.stderr, flush=True)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
