"""`python -m bench.harness`: structspec against the tools a user would pick instead, in one run.

Systems (all greedy, same model object, same prompt, same output cap; structspec and
hf-prompt-lookup get the same prompt token ids, outlines the decoded prompt text, which it
tokenizes again, so its ids may differ where the text does not round-trip):
  structspec:<strategy>[+verbatim]  the engine; strategy none | schema | ngram | composite | auto
  outlines                          the `outlines` package on transformers, generating the same
                                    (normalised) schema: what most users run for schema-valid JSON
  hf-prompt-lookup                  transformers' generate(prompt_lookup_num_tokens=...): fast,
                                    but not grammar-constrained (its schema-valid rate is reported)

Every document runs every system back to back (interleaved, the machine is noisy), and every
figure that matters is a ratio over the same documents in the same run. End-to-end seconds
cover the whole call, timed around it: prompt, grammar, prefill and decode; structspec reuses
no prefill from earlier calls. `auto` systems pool their statistics over the dataset
(DeepJSONEval gives each document its own schema), unlike the service, which keeps them per
schema; they may warm up on the first `--warmup` documents, which only they run. Like the
worker, `auto` sends its choice's acceptance curve with each request (the engine trims drafts
that do not pay at the batch's size).

`--batch N` (default 1, one document per call) hands each system N documents at once, every
system the same N in turn, and measures throughput instead of one document's latency:
  structspec        one Engine.run of the N requests (decoded together, up to the engine's
                    engine_max_seqs at a time; the others join as sequences leave)
  outlines          Generator.batch per schema: outlines constrains a batch by one output
                    type, so documents of different schemas go in separate batches
  hf-prompt-lookup  one at a time: transformers' prompt lookup takes a batch of one
Each document is then charged an equal share of its group's wall clock (`cost_s`, which the
tok/s and speedup columns use), and its latency (`e2e_s`) is the time from the group's start
to its result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import percentile
from bench.strategies import field_accuracy, load_dataset, write_report
from structspec.cli import add_model_args, build_engine, settings_from
from structspec.engine.engine import Engine, Request
from structspec.engine.prompt import DocumentTooLong, build_prompt
from structspec.grammar import validate_instance
from structspec.grammar.normalize import close_objects
from structspec.options import STRATEGIES, RequestOptions
from structspec.stats.aggregate import InMemoryStats
from structspec.stats.selector import Selector, SelectorConfig

PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Outcome:
    text: str
    value: Any  # parsed JSON or None
    valid_json: bool
    schema_valid: bool
    output_tokens: int
    e2e_s: float  # latency: the call's (or the group's) start to this result
    stats: dict  # structspec's engine stats ({} for the others)
    cost_s: float = 0.0  # this document's share of the group's wall clock (e2e_s when run alone)


class RssPeak:
    """Peak resident memory above the level at start, sampled every 5 ms (MiB); on CUDA the
    peak allocated by torch instead."""

    def __init__(self, device):
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.peak = 0.0

    def __enter__(self) -> "RssPeak":
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        self.base = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        top = self.base
        while not self._stop.wait(0.005):
            top = max(top, _rss())
        self._top = max(top, _rss())

    def __exit__(self, *exc) -> None:
        if self.cuda:
            import torch

            self.peak = (torch.cuda.max_memory_allocated() - self.base) / 2**20
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._top - self.base, 0) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def parse_json_answer(text: str) -> tuple[Any, bool]:
    """The JSON value in `text` (whole, or from the first '{' / '[' to the matching end, since an
    unconstrained model may wrap it in prose or a code fence); (None, False) if there is none."""
    try:
        return json.loads(text), True
    except json.JSONDecodeError:
        pass
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None, False
    try:
        value, _ = json.JSONDecoder().raw_decode(text[min(starts):])
        return value, True
    except json.JSONDecodeError:
        return None, False


class StructspecSystem:
    def __init__(self, name: str, engine: Engine, max_tokens: int, seed: int):
        spec = name.split(":", 1)[1]
        self.name, self.engine, self.max_tokens = name, engine, max_tokens
        self.strategy, _, mode = spec.partition("+")
        self.verbatim = mode == "verbatim"
        if self.strategy not in (*STRATEGIES, "auto") or mode not in ("", "verbatim"):
            raise ValueError(f"unknown system {name!r}")
        self.stats = InMemoryStats(half_life=500) if self.strategy == "auto" else None
        self.selector = Selector(SelectorConfig())
        self.rng = random.Random(seed)

    def request(self, row: dict) -> Request:
        """The row's request: a fixed strategy, or `auto`'s draw from what it has seen so far
        with that choice's acceptance curve (as the worker sends it)."""
        strategy, k, acceptance = self.strategy, 8, None
        if self.stats is not None:
            views = self.stats.views(self.verbatim)
            choice = self.selector.choose(views, self.rng)
            strategy, k = choice.strategy, choice.draft_len
            if strategy != "none":
                acceptance = self.selector.draft_acceptance(views, strategy, k, self.rng)
        options = RequestOptions(strategy=strategy, draft_len=k, max_tokens=self.max_tokens, verbatim=self.verbatim)
        return Request(row["schema"], row["text"], options, acceptance=acceptance)

    def run_group(self, rows: list[dict]) -> list[Outcome]:
        """Every row's request decoded together (one Engine.run); `auto` draws all the group's
        choices before it runs and learns from the results after."""
        requests = [self.request(row) for row in rows]
        self.engine.clear_prefix_cache()  # end-to-end times include every system's own prefill
        arrived: dict[str, float] = {}
        t0 = time.perf_counter()
        results = self.engine.run(requests, on_result=lambda r: arrived.setdefault(r.request_id,
                                                                                   time.perf_counter() - t0))
        wall = time.perf_counter() - t0
        outcomes = []
        for res in results:
            stats = res.stats.as_dict()
            if self.stats is not None:
                self.stats.record(stats)
            succeeded = res.status == "succeeded"
            value, ok = (res.value, True) if succeeded else parse_json_answer(res.text)
            outcomes.append(Outcome(res.text, value, ok, succeeded, res.stats.output_tokens,
                                    arrived[res.request_id], stats, wall / len(rows)))
        return outcomes


class OutlinesSystem:
    name = "outlines"

    def __init__(self, engine: Engine, max_tokens: int):
        import outlines

        self.loaded, self.max_tokens = engine.loaded, max_tokens
        self.model = outlines.from_transformers(self.loaded.model, self.loaded.tokenizer)

    def run_group(self, rows: list[dict]) -> list[Outcome]:
        """One Generator.batch per schema in `rows` (one call per document when alone)."""
        import outlines
        from outlines.types import JsonSchema

        tok = self.loaded.tokenizer
        by_schema: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            by_schema.setdefault(json.dumps(row["schema"], sort_keys=True), []).append(i)
        texts: dict[int, tuple[str, float]] = {}
        t0 = time.perf_counter()
        for idx in by_schema.values():
            prompts = [tok.decode(build_prompt(tok, rows[i]["schema"], rows[i]["text"], self.loaded.context_len))
                       for i in idx]
            generator = outlines.Generator(self.model, JsonSchema(json.dumps(close_objects(rows[idx[0]]["schema"]))))
            if len(idx) == 1:
                out = [generator(prompts[0], max_new_tokens=self.max_tokens, do_sample=False)]
            else:
                out = generator.batch(prompts, max_new_tokens=self.max_tokens, do_sample=False)
            done = time.perf_counter() - t0
            texts.update({i: (text, done) for i, text in zip(idx, out)})
        wall = time.perf_counter() - t0
        return [_judge(texts[i][0], row, len(tok.encode(texts[i][0], add_special_tokens=False)), texts[i][1],
                       wall / len(rows)) for i, row in enumerate(rows)]


class PromptLookupSystem:
    name = "hf-prompt-lookup"

    def __init__(self, engine: Engine, max_tokens: int):
        self.loaded, self.max_tokens = engine.loaded, max_tokens

    def run(self, row: dict) -> Outcome:
        import torch

        tok, model = self.loaded.tokenizer, self.loaded.model
        t0 = time.perf_counter()
        ids = build_prompt(tok, row["schema"], row["text"], self.loaded.context_len)
        input_ids = torch.tensor([ids], device=self.loaded.device)
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=self.max_tokens, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS,
                                 pad_token_id=tok.eos_token_id)
        new = [t for t in out[0, len(ids):].tolist() if t not in self.loaded.eos_token_ids]
        text = tok.decode(new, skip_special_tokens=True)
        e2e = time.perf_counter() - t0
        return _judge(text, row, len(new), e2e, e2e)

    def run_group(self, rows: list[dict]) -> list[Outcome]:
        """One document after another: transformers' prompt lookup takes a batch of one."""
        t0, outcomes = time.perf_counter(), []
        for row in rows:
            res = self.run(row)
            res.e2e_s = time.perf_counter() - t0
            outcomes.append(res)
        for res in outcomes:
            res.cost_s = outcomes[-1].e2e_s / len(rows)
        return outcomes


def _judge(text: str, row: dict, output_tokens: int, e2e: float, cost: float) -> Outcome:
    value, ok = parse_json_answer(text)
    valid = ok and not validate_instance(row["schema"], value)
    return Outcome(text, value, ok, valid, output_tokens, e2e, {}, cost)


def make_systems(names: list[str], engine: Engine, max_tokens: int, seed: int) -> list:
    systems = []
    for name in names:
        if name.startswith("structspec:"):
            systems.append(StructspecSystem(name, engine, max_tokens, seed))
        elif name == "outlines":
            systems.append(OutlinesSystem(engine, max_tokens))
        elif name == "hf-prompt-lookup":
            systems.append(PromptLookupSystem(engine, max_tokens))
        else:
            raise ValueError(f"unknown system {name!r}: use structspec:<none|schema|ngram|composite|auto>"
                             f"[+verbatim], outlines or hf-prompt-lookup")
    return systems


def summarize(records: list[dict], system: str, systems: list[str]) -> dict:
    mine = {r["id"]: r for r in records if r["system"] == system}
    n = len(mine)
    graded = [r for r in mine.values() if r["gold_fields"]]
    e2e = [r["e2e_s"] for r in mine.values()]
    cost = sum(r["cost_s"] for r in mine.values())
    tokens = sum(r["output_tokens"] for r in mine.values())
    st = [r["stats"] for r in mine.values() if r["stats"]]
    passes = sum(s["target_passes"] for s in st)
    decode_s = sum(s["decode_s"] for s in st)

    def ratio(base: str) -> float | None:
        if base not in systems:
            return None
        other = {r["id"]: r for r in records if r["system"] == base}
        common = [i for i in mine if i in other]
        mine_s = sum(mine[i]["cost_s"] for i in common)
        return sum(other[i]["cost_s"] for i in common) / mine_s if mine_s else None

    return {
        "system": system, "documents": n,
        "valid_json": sum(r["valid_json"] for r in mine.values()) / n if n else 0.0,
        "schema_valid": sum(r["schema_valid"] for r in mine.values()) / n if n else 0.0,
        "field_accuracy": (sum(r["gold_matched"] for r in graded) / sum(r["gold_fields"] for r in graded)
                           if graded else None),
        "output_tokens": tokens,
        "target_passes": passes if st else None,
        "tokens_per_pass": tokens / passes if passes else None,
        "decode_tok_s": sum(s["output_tokens"] for s in st) / decode_s if decode_s else None,
        "e2e_tok_s": tokens / cost if cost else 0.0,
        "documents_per_min": 60 * n / cost if cost else 0.0,
        "e2e_s_median": statistics.median(e2e) if e2e else 0.0,
        "e2e_s_p90": percentile(e2e, 90),
        "e2e_s_total": cost,
        "vs_structspec_none": ratio("structspec:none"),
        "vs_outlines": ratio("outlines"),
        "peak_mem_mib": max((r["peak_mem_mib"] for r in mine.values()), default=0.0),
        "hit_max_tokens": sum(r["hit_max_tokens"] for r in mine.values()),
    }


def _fmt(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def markdown_table(summaries: list[dict], batch: int = 1) -> str:
    latency = "latency" if batch > 1 else "e2e"  # from the group's start when documents share a call
    lines = ["| system | docs | valid JSON | schema-valid | field accuracy | hit max_tokens | output tokens | "
             f"target passes | tokens/pass | decode tok/s | e2e tok/s | documents/min | {latency} s median | "
             f"{latency} s p90 | speedup vs structspec:none | speedup vs outlines | peak mem MiB |",
             "|" + "---|" * 17]
    for s in summaries:
        lines.append(
            f"| {s['system']} | {s['documents']} | {s['valid_json']:.0%} | {s['schema_valid']:.0%} | "
            f"{_fmt(s['field_accuracy'], '.1%')} | {s['hit_max_tokens']} | {s['output_tokens']} | "
            f"{_fmt(s['target_passes'], 'd', 'n/a')} | {_fmt(s['tokens_per_pass'], '.2f')} | "
            f"{_fmt(s['decode_tok_s'], '.1f')} | {s['e2e_tok_s']:.1f} | {s['documents_per_min']:.1f} | "
            f"{s['e2e_s_median']:.1f} | {_fmt(s['e2e_s_p90'], '.1f')} | {_fmt(s['vs_structspec_none'], '.2f')}x | "
            f"{_fmt(s['vs_outlines'], '.2f')}x | {s['peak_mem_mib']:.0f} |")
    return "\n".join(lines)


def plot(summaries: list[dict], records: list[dict], out: Path, batch: int = 1) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [s["system"] for s in summaries]
    fig, ax = plt.subplots(figsize=(9, 4))
    for j, key in enumerate(("vs_structspec_none", "vs_outlines")):
        vals = [s[key] or 0.0 for s in summaries]
        ax.bar([i + 0.4 * j for i in range(len(names))], vals, width=0.4, label=key.replace("vs_", "speedup vs "))
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylabel("end-to-end speedup (same documents)" if batch == 1
                  else f"throughput speedup (same documents, groups of {batch})")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    spec = [n for n in names if n.startswith("structspec:")]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.boxplot([[r["stats"]["tokens_per_pass"] for r in records if r["system"] == n and r["stats"]] or [0]
                for n in spec], tick_labels=spec)
    ax.set_ylabel("tokens per target pass (per document)")
    ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    paths.append(out / "tokens_per_pass.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    for n in spec:
        prop, acc = [], []
        for r in records:
            if r["system"] != n or not r["stats"]:
                continue
            p, a = r["stats"]["proposed_by_position"], r["stats"]["accepted_by_position"]
            prop += [0] * (len(p) - len(prop))
            acc += [0] * (len(a) - len(acc))
            prop = [x + (p[i] if i < len(p) else 0) for i, x in enumerate(prop)]
            acc = [x + (a[i] if i < len(a) else 0) for i, x in enumerate(acc)]
        if prop:
            ax.plot(range(len(prop)), [a / p if p else 0 for a, p in zip(acc, prop)], marker="o", label=n)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / proposed")
    ax.set_ylim(0, 1.05)
    ax.legend()
    fig.tight_layout()
    paths.append(out / "acceptance_by_position.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def fits(engine: Engine, row: dict) -> bool:
    """Whether the row's prompt fits the model's context (a document counts for every system or
    for none)."""
    try:
        build_prompt(engine.loaded.tokenizer, row["schema"], row["text"], engine.loaded.context_len)
        return True
    except DocumentTooLong as e:
        print(f"skip {row.get('id')}: {e}", file=sys.stderr)
        return False


def record(row: dict, system: str, res: Outcome, max_tokens: int, peak_mib: float) -> dict:
    matched, fields = field_accuracy(res.value, row["gold"]) if "gold" in row else (0, 0)
    return {"id": row.get("id"), "system": system, "valid_json": res.valid_json, "schema_valid": res.schema_valid,
            "output_tokens": res.output_tokens, "hit_max_tokens": res.output_tokens >= max_tokens,
            "e2e_s": round(res.e2e_s, 4), "cost_s": round(res.cost_s, 4), "gold_matched": matched,
            "gold_fields": fields, "peak_mem_mib": round(peak_mib, 1), "text": res.text, "stats": res.stats}


def run_harness(args, engine: Engine) -> int:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    batch = getattr(args, "batch", 1)
    try:
        if batch < 1:
            raise ValueError(f"--batch must be at least 1, got {batch}")
        systems = make_systems(names, engine, args.max_tokens, args.seed)
        rows = load_dataset(args.dataset, args.warmup + args.limit, args.max_chars)
    except (OSError, ValueError) as e:
        print(f"structspec: error: {e}", file=sys.stderr)
        return 2
    max_seqs = engine.scheduler.max_seqs
    if batch > max_seqs and any(n.startswith("structspec:") for n in names):
        print(f"note: --batch {batch} is more than engine_max_seqs {max_seqs}: structspec decodes {max_seqs} "
              f"of a group at a time and the rest join as they finish (STRUCTSPEC_ENGINE_MAX_SEQS)", file=sys.stderr)
    rows = [row for row in rows if fits(engine, row)]
    warm, measured = rows[:args.warmup], rows[args.warmup:]
    groups = [measured[i:i + batch] for i in range(0, len(measured), batch)]
    learners = [s for s in systems if getattr(s, "stats", None) is not None]
    records: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=len(warm) * len(learners) + len(measured) * len(systems), desc="bench", unit="doc",
              file=sys.stderr) as bar:
        for row in warm:
            for system in learners:
                system.run_group([row])
                bar.update(1)
        for group in groups:
            for system in systems:  # interleaved: noise hits every system alike
                bar.set_postfix_str(f"{group[0].get('id')}{'…' if len(group) > 1 else ''}: {system.name}")
                with RssPeak(engine.loaded.device) as mem:
                    outcomes = system.run_group(group)
                records += [record(row, system.name, res, args.max_tokens, mem.peak)
                            for row, res in zip(group, outcomes)]
                bar.update(len(group))
    summaries = [summarize(records, n, names) for n in names]
    print(f"model={engine.loaded.name} device={engine.loaded.device} max_tokens={args.max_tokens} "
          f"batch={batch} engine_max_seqs={max_seqs} warm-up={len(warm)} "
          f"documents={len({r['id'] for r in records})} wall={time.perf_counter() - t0:.0f}s")
    print(markdown_table(summaries, batch))
    if args.out:
        path = write_report(args.out, "bench.json", {"batch": batch, "engine_max_seqs": max_seqs,
                                                     "summaries": summaries, "records": records})
        paths = plot(summaries, records, path.parent, batch)
        print(f"records written to {path}; plots: {', '.join(str(p) for p in paths)}")
    return 0


SYSTEMS = ("structspec:none,structspec:composite,structspec:auto,structspec:auto+verbatim,"
           "outlines,hf-prompt-lookup")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.harness",
                                description="Run every --systems on the same documents, interleaved, and report "
                                            "validity, accuracy, speed and memory per system (Markdown on stdout; "
                                            "bench.json and PNG plots in --out).")
    p.add_argument("--dataset", required=True, help="JSONL with {id, schema, text, gold?} per line")
    p.add_argument("--systems", default=SYSTEMS,
                   help="comma-separated: structspec:<none|schema|ngram|composite|auto>[+verbatim], outlines, "
                        "hf-prompt-lookup (default %(default)s)")
    p.add_argument("--limit", type=int, default=8, help="measured documents")
    p.add_argument("--warmup", type=int, default=0, help="documents only the auto systems run first")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--max-chars", type=int, default=0, help="skip documents longer than this (0 = no limit)")
    p.add_argument("--seed", type=int, default=0, help="seeds auto's Thompson draws")
    p.add_argument("--batch", type=int, default=1, metavar="N",
                   help="documents handed to each system at once (default %(default)s): structspec decodes them "
                        "together, outlines batches those of one schema, hf-prompt-lookup runs them one by one; "
                        "the speed columns are then throughput over each group's wall clock")
    p.add_argument("--out", help="write bench.json and plots here")
    add_model_args(p)
    args = p.parse_args(argv)
    return run_harness(args, build_engine(settings_from(args)))


if __name__ == "__main__":
    sys.exit(main())
