"""`python -m bench.conformance`: what each grammar backend enforces, measured on real schemas.

For every schema: check and compile it exactly as registration and the engine do (meta-schema,
annotations, closed objects, backend compile); a SchemaError is `refused`. For every test
instance of a compiled schema: serialise it compactly (the only whitespace style the grammar
generates), feed its tokens to a fresh matcher, and compare "the grammar accepts it" with the
instance's `valid`:

  correct       agrees
  false accept  the grammar lets an invalid instance through. `warned` when registration gives
                the schema any warning (not matched to the path the instance breaks) that it
                uses a keyword the grammar does not enforce (the engine then
                validates with jsonschema and fails such a job naming the keyword); `silent`
                otherwise: those are the bugs this report exists to find.
  false reject  a valid instance the grammar refuses; `closed` when the instance has a key the
                schema does not declare (structspec closes such objects on purpose, see
                grammar/normalize.py), `other` otherwise.

Sources: the JSON-Schema-Test-Suite (draft 2020-12, one row per keyword file) and
JSONSchemaBench (one row per split, with compile and per-token mask times).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from bench import percentile
from structspec.grammar import SchemaError, check_schema, make_backend
from structspec.grammar.normalize import close_objects
from structspec.grammar.validation import check_meta_schema

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass
class Tally:
    schemas: int = 0
    refused: int = 0
    tests: int = 0
    correct: int = 0
    false_accept_warned: int = 0
    false_accept_silent: int = 0
    false_reject_closed: int = 0
    false_reject_other: int = 0
    schemas_all_correct: int = 0
    check_ms: list[float] = field(default_factory=list)  # registration: meta-schema, annotations, grammar check
    compile_ms: list[float] = field(default_factory=list)  # the worker's grammar compile for its tokenizer
    mask_us: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)  # silent false accepts and other false rejects

    def add(self, other: "Tally") -> None:
        for name in ("schemas", "refused", "tests", "correct", "false_accept_warned", "false_accept_silent",
                     "false_reject_closed", "false_reject_other", "schemas_all_correct"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.check_ms += other.check_ms
        self.compile_ms += other.compile_ms
        self.mask_us += other.mask_us
        self.examples += other.examples


def has_undeclared_key(schema: Any, instance: Any) -> bool:
    """Whether `instance` carries a key that an object of the closed `schema` would refuse
    (an approximation: any object in the instance with a key no `properties` in the schema names)."""
    declared: set[str] = set()
    closes = False  # some object lists `properties` (even none): close_objects may close it

    def names(node: Any) -> None:
        nonlocal closes
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                closes = True
                declared.update(node["properties"])
            for v in node.values():
                names(v)
        elif isinstance(node, list):
            for v in node:
                names(v)

    def keys(node: Any) -> Iterator[str]:
        if isinstance(node, dict):
            yield from node
            for v in node.values():
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    names(schema)
    return closes and any(k not in declared for k in keys(instance))


class Checker:
    def __init__(self, backend_name: str, tokenizer, mask_samples: int = 0):
        import torch

        self.backend = make_backend(backend_name, tokenizer)
        self.tokenizer = tokenizer
        self.mask_samples = mask_samples
        self.bitmask = torch.zeros((1, (self.backend.vocab_size + 31) // 32), dtype=torch.int32)

    def run(self, schema: Any, tests: list[dict], label: str) -> Tally:
        t = Tally(schemas=1, tests=len(tests))
        start = time.perf_counter()
        try:
            if not isinstance(schema, dict):
                schema = {} if schema is True else {"not": {}}
            if self.backend.name == "llguidance":
                warned = bool(check_schema(schema))  # what registration says the grammar does not enforce
            else:
                check_meta_schema(schema)
                warned = False
            t.check_ms.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            grammar = self.backend.compile(close_objects(schema))
        except (SchemaError, RecursionError):
            t.refused, t.tests = 1, 0
            return t
        except Exception as e:  # an engine crash on odd input is a refusal, reported by kind
            t.refused, t.tests = 1, 0
            t.examples.append(f"{label}: compile crashed: {type(e).__name__}")
            return t
        t.compile_ms.append((time.perf_counter() - start) * 1000)
        for test in tests:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            accepted = self.accepts(grammar, text, t.mask_us if test["valid"] else None)
            if accepted == test["valid"]:
                t.correct += 1
            elif accepted:
                if warned:
                    t.false_accept_warned += 1
                else:
                    t.false_accept_silent += 1
                    t.examples.append(f"{label}: accepts invalid {text[:80]}")
            elif has_undeclared_key(schema, test["data"]):
                t.false_reject_closed += 1
            else:
                t.false_reject_other += 1
                t.examples.append(f"{label}: refuses valid {text[:80]}")
        t.schemas_all_correct = int(t.correct == len(tests))
        return t

    def accepts(self, grammar, text: str, mask_us: list[float] | None) -> bool:
        """Whether the grammar accepts `text` whole; the first `mask_samples` masks are timed
        into `mask_us` when given."""
        matcher = grammar.matcher()
        for i, tok in enumerate(self.tokenizer.encode(text, add_special_tokens=False)):
            if mask_us is not None and i < self.mask_samples:
                t0 = time.perf_counter()
                matcher.fill_bitmask(self.bitmask, 0)
                mask_us.append((time.perf_counter() - t0) * 1e6)
            if not matcher.consume([tok]):
                return False
        return matcher.is_accepting()


def test_suite_cases(root: Path) -> Iterator[tuple[str, Any, list[dict]]]:
    for path in sorted((root / "tests" / "draft2020-12").glob("*.json")):
        for case in json.loads(path.read_text()):
            yield path.stem, case["schema"], case["tests"]


def bench_rows(path: Path, limit: int) -> Iterator[dict]:
    with path.open() as f:
        for n, line in enumerate(f):
            if limit and n >= limit:
                return
            yield json.loads(line)


def p50_p99(xs: list[float], spec: str) -> str:
    """"p50 / p99" of `xs` formatted with `spec` ("- / -" for none)."""
    return " / ".join("-" if x is None else format(x, spec) for x in (percentile(xs, 50), percentile(xs, 99)))


def run(args) -> dict:
    from structspec.engine.model import load_tokenizer

    tokenizer = load_tokenizer()
    data = Path(args.data)
    report: dict = {"test_suite": {}, "jsonschemabench": {}}
    for backend in args.backends.split(","):
        checker = Checker(backend, tokenizer, mask_samples=args.mask_samples)
        per_kw: dict[str, Tally] = defaultdict(Tally)
        suite = data / "json-schema-test-suite"
        if suite.exists():
            for kw, schema, tests in test_suite_cases(suite):
                per_kw[kw].add(checker.run(schema, tests, f"{kw}"))
        report["test_suite"][backend] = per_kw
        per_split: dict[str, Tally] = {}
        for path in sorted((data / "jsonschemabench").glob("*.jsonl")) if not args.skip_bench else []:
            tally = Tally()
            for row in bench_rows(path, args.limit):
                tally.add(checker.run(row["schema"], row["tests"], f"{path.stem}/{row['id']}"))
            per_split[path.stem] = tally
            print(f"conformance: {backend} {path.stem}: {tally.schemas} schemas", file=sys.stderr, flush=True)
        report["jsonschemabench"][backend] = per_split
    return report


def markdown(report: dict) -> str:
    out = []
    for backend, per_kw in report["test_suite"].items():
        out += [f"### JSON-Schema-Test-Suite, draft 2020-12 — {backend}", "",
                "| keyword file | cases | refused | tests | correct | false accept (warned) | "
                "false accept (silent) | false reject (closed objects) | false reject (other) |",
                "|---|---|---|---|---|---|---|---|---|"]
        total = Tally()
        for kw in sorted(per_kw):
            t = per_kw[kw]
            total.add(t)
            out.append(_suite_row(kw, t))
        out.append(_suite_row("**all**", total))
        out.append("")
    for backend, per_split in report["jsonschemabench"].items():
        if not per_split:
            continue
        out += [f"### JSONSchemaBench — {backend}", "",
                "| split | schemas | compiled | compiled and every test correct | registration check ms p50 / p99 | "
                "grammar compile ms p50 / p99 | mask µs p50 / p99 | tests | correct | false accept (warned / silent) | "
                "false reject (closed / other) |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        total = Tally()
        for split, t in per_split.items():
            total.add(t)
            out.append(_bench_row(split, t))
        out.append(_bench_row("**all**", total))
        out.append("")
    return "\n".join(out)


def _suite_row(name: str, t: Tally) -> str:
    return (f"| {name} | {t.schemas} | {t.refused} | {t.tests} | {t.correct} | {t.false_accept_warned} | "
            f"{t.false_accept_silent} | {t.false_reject_closed} | {t.false_reject_other} |")


def _bench_row(name: str, t: Tally) -> str:
    compiled = t.schemas - t.refused
    return (f"| {name} | {t.schemas} | {compiled} ({compiled / t.schemas:.1%}) | "
            f"{t.schemas_all_correct} ({t.schemas_all_correct / t.schemas:.1%}) | "
            f"{p50_p99(t.check_ms, '.1f')} | {p50_p99(t.compile_ms, '.1f')} | "
            f"{p50_p99(t.mask_us, '.0f')} | {t.tests} | {t.correct} | "
            f"{t.false_accept_warned} / {t.false_accept_silent} | {t.false_reject_closed} / {t.false_reject_other} |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default=str(DEFAULT_DATA), help="folder with json-schema-test-suite/ and "
                                                              "jsonschemabench/ (default: ../shared/data)")
    p.add_argument("--backends", default="llguidance", help="llguidance, outlines or both")
    p.add_argument("--limit", type=int, default=0, help="schemas per JSONSchemaBench split (0 = all)")
    p.add_argument("--skip-bench", action="store_true", help="only the JSON-Schema-Test-Suite")
    p.add_argument("--mask-samples", type=int, default=8, help="masks timed per valid instance")
    p.add_argument("--examples", type=int, default=20, help="silent false accepts / other false rejects listed")
    p.add_argument("--json", help="also write the report's numbers here")


def conformance(args) -> int:
    """The report for `args` (add_arguments') on stdout; 2 without data."""
    data = Path(args.data)
    if not (data / "json-schema-test-suite").exists() and not (data / "jsonschemabench").exists():
        print(f"bench.conformance: error: no json-schema-test-suite/ or jsonschemabench/ under {data} (--data)",
              file=sys.stderr)
        return 2
    report = run(args)
    print(markdown(report))
    examples = [e for per in report["test_suite"].values() for t in per.values() for e in t.examples]
    examples += [e for per in report["jsonschemabench"].values() for t in per.values() for e in t.examples]
    if examples:
        print(f"\nFirst {min(args.examples, len(examples))} of {len(examples)} silent false accepts, other false "
              f"rejects and crashes:\n")
        print("\n".join(f"- {e}" for e in examples[:args.examples]))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {part: {b: {k: {f: v for f, v in vars(t).items() if f not in ("check_ms", "compile_ms", "mask_us")}
                        for k, t in per.items()} for b, per in report[part].items()} for part in report}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conformance",
                                description="What the grammar backends enforce, on the JSON-Schema-Test-Suite and "
                                            "JSONSchemaBench: compile every schema as registration does and check "
                                            "that the grammar accepts each valid test instance and refuses each "
                                            "invalid one; Markdown tables on stdout (docs/conformance.md holds the "
                                            "latest).")
    add_arguments(p)
    return conformance(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
