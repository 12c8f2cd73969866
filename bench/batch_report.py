"""Pure helpers of `python -m bench.batch`: summaries of one configuration's run, ratios,
verdicts and the Markdown tables (no model, no torch: unit-tested on their own)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

MiB = 1024 * 1024


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{format(x, spec)}{suffix}"


def fmt_ratio(x: float | None) -> str:
    return fmt(x, ".2f", "x")


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    """'met' / 'missed' against a target, 'not measured' without a value."""
    if value is None:
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "met" if ok else "missed"


def summarize_run(name: str, stats: list[dict[str, Any]], statuses: Iterable[str], wall_s: float,
                  metrics: dict[str, float] | None = None, decode_only: dict[str, float] | None = None,
                  **extra) -> dict[str, Any]:
    """One configuration's figures from its requests' stats (RequestStats.as_dict()), the
    wall-clock seconds of the whole run, the engine's metrics over the run and `decode_only`
    ({steps, s, tokens}: the steps that computed no prefill rows and the tokens they emitted).

    Decode tok/s is decode_only's tokens over its seconds when given. The requests' own
    prefill_s/decode_s (kept as share_*) split each step's time by rows, which undercharges
    decode in a step that also prefills: a decoding row costs more than a prefill row (it reads
    its sequence's whole KV), so a batched run's row-share decode rate is too high."""
    tokens = sum(s["output_tokens"] for s in stats)
    passes = sum(s["target_passes"] for s in stats)
    share_decode_s = sum(s["decode_s"] for s in stats)
    share_prefill_s = sum(s["prefill_s"] for s in stats)
    batch = sum(s["batch_size"] * s["target_passes"] for s in stats)
    prefill_step_s = metrics.get("prefill_step_s") if metrics else None
    decode_s = decode_only["s"] if decode_only else share_decode_s
    decode_tokens = decode_only["tokens"] if decode_only else tokens
    out = {
        "config": name, "documents": len(stats), "statuses": dict(Counter(statuses)),
        "output_tokens": tokens, "target_passes": passes,
        "tokens_per_pass": ratio(tokens, passes),
        "mean_batch": ratio(batch, passes),  # sequences decoded together, per pass of a request
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "prefill_tokens": sum(s["prefill_tokens"] for s in stats),
        "prefix_tokens": sum(s["prefix_tokens"] for s in stats),
        "wall_s": wall_s, "e2e_tok_s": ratio(tokens, wall_s),
        "prefill_step_s": prefill_step_s,  # steps with prefill rows (decode rows may ride along)
        "prefill_share": ratio(prefill_step_s if prefill_step_s is not None else share_prefill_s, wall_s),
        "decode_s": decode_s, "decode_tokens": decode_tokens, "decode_tok_s": ratio(decode_tokens, decode_s),
        "decode_only_steps": decode_only["steps"] if decode_only else None,
        "share_prefill_s": share_prefill_s, "share_decode_s": share_decode_s,
        "share_decode_tok_s": ratio(tokens, share_decode_s),
    }
    if metrics is not None:
        out["metrics"] = metrics
        out["overhead"] = overhead(metrics)
    out.update(extra)
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """EngineMetrics.as_dict() of what happened between two snapshots."""
    return {k: after[k] - before.get(k, 0) for k in after}


def overhead(m: dict[str, float]) -> dict[str, float | None]:
    """Share of step time outside the model's forward passes. Only exact for decode-only steps:
    `decode_only` is None when some step of the interval computed prefill rows."""
    outside = m["step_s"] - m["forward_s"]
    share = ratio(outside, m["step_s"])
    return {"outside_forward_s": outside, "share": share,
            "decode_only": share if m.get("prefill_rows", 0) == 0 else None,
            "verify_share": ratio(m["verify_s"], m["step_s"])}


def cost_points(snapshot: dict[int, float], rows: Iterable[int] = (1, 2, 4, 8, 16, 32, 64, 128)) -> list[dict]:
    """Measured pass cost at (or nearest below) each of `rows`: seconds per pass and per row."""
    keys = sorted(snapshot)
    out = []
    for r in rows:
        near = [k for k in keys if k <= r * 1.1]
        if not near:
            continue
        k = near[-1]
        if out and out[-1]["rows"] == k:
            continue
        out.append({"rows": k, "s_per_pass": snapshot[k], "s_per_row": snapshot[k] / k,
                    "vs_one_row": ratio(snapshot[k], snapshot.get(keys[0])) if keys[0] == 1 else None})
    return out


# --- tables --------------------------------------------------------------------------------------

def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def throughput_table(runs: list[dict], baselines: dict[str, str]) -> str:
    """Configurations with e2e and decode tok/s, and both ratios against each named baseline
    (`baselines`: column label -> config name)."""
    by = {r["config"]: r for r in runs}
    head = ["config", "docs", "statuses", "output tokens", "tokens/pass", "mean batch", "wall s", "prefill-step s",
            "prefill share", "e2e tok/s", "decode-only s", "decode tok/s", "decode tok/s (row shares)"]
    for label in baselines:
        head += [f"e2e vs {label}", f"decode vs {label}"]
    rows = []
    for r in runs:
        row = [r["config"], r["documents"], statuses(r["statuses"]), r["output_tokens"], fmt(r["tokens_per_pass"]),
               fmt(r["mean_batch"], ".1f"), fmt(r["wall_s"], ".1f"), fmt(r["prefill_step_s"], ".1f"),
               fmt(r["prefill_share"], ".0%"), fmt(r["e2e_tok_s"], ".1f"), fmt(r["decode_s"], ".1f"),
               fmt(r["decode_tok_s"], ".1f"), fmt(r["share_decode_tok_s"], ".1f")]
        for base in baselines.values():
            b = by.get(base)
            row += [fmt_ratio(ratio(r["e2e_tok_s"], b and b["e2e_tok_s"])),
                    fmt_ratio(ratio(r["decode_tok_s"], b and b["decode_tok_s"]))]
        rows.append(row)
    return table(head, rows)


def statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def pooled(runs: list[dict], name: str) -> dict | None:
    """Repeats of one configuration pooled: totals summed, rates recomputed."""
    mine = [r for r in runs if r["config"] == name]
    if not mine:
        return None
    keys = ("documents", "output_tokens", "target_passes", "prompt_tokens", "prefill_tokens", "prefix_tokens",
            "wall_s", "decode_s", "decode_tokens", "share_prefill_s", "share_decode_s")
    out: dict[str, Any] = {k: sum(r[k] for r in mine) for k in keys}
    steps = [r["prefill_step_s"] for r in mine]
    out["prefill_step_s"] = None if None in steps else sum(steps)
    batch = sum((r["mean_batch"] or 0) * r["target_passes"] for r in mine)
    st: Counter = Counter()
    for r in mine:
        st.update(r["statuses"])
    out.update(config=name, repeats=len(mine), statuses=dict(st),
               tokens_per_pass=ratio(out["output_tokens"], out["target_passes"]),
               mean_batch=ratio(batch, out["target_passes"]),
               prefill_share=ratio(out["prefill_step_s"] if out["prefill_step_s"] is not None
                                   else out["share_prefill_s"], out["wall_s"]),
               e2e_tok_s=ratio(out["output_tokens"], out["wall_s"]),
               decode_tok_s=ratio(out["decode_tokens"], out["decode_s"]),
               share_decode_tok_s=ratio(out["output_tokens"], out["share_decode_s"]))
    return out
