"""Documents longer than the model's context: split into overlapping chunks at natural
boundaries, each extracted with the same schema, the results merged back into one.

Merge rules (the result follows the schema's shape, so the rules follow the value's):
  * an object merges field by field, keys in the order they first appear;
  * an array concatenates the chunks' arrays in chunk order and drops items equal to one
    already taken (the overlap between chunks repeats what both saw);
  * a scalar takes the value with the highest confidence (the mean token probability of the
    tokens that wrote it), ties to the first chunk; a null or an empty string loses to any
    other value, since a chunk that does not hold a field writes one of those for it.
Spans and confidences follow the values they belong to, spans shifted into the whole document.
The merged value is validated against the schema by the caller, as any result is.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from structspec.engine.loop import EngineLoopDown
from structspec.engine.prompt import DocumentTooLong, build_prompt
from structspec.engine.sequence import ExtractResult, RequestStats
from structspec.grammar import validate_instance

BOUNDARIES = ("\n\n", "\n", ". ", " ")  # preferred cut points, best first: pages and paragraphs, lines, sentences, words


def split(text: str, size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """[start, end) character ranges of `text`, each at most `size` long, cut at the best
    boundary in the second half of the range, each starting about `overlap` characters before
    the previous one ended (at a boundary there too). One range when the text fits."""
    if size < 2:
        raise ValueError(f"chunk size must be at least 2 characters, not {size}")
    if not 0 <= overlap < size // 2:
        raise ValueError(f"overlap must be between 0 and half the chunk size ({size // 2}), not {overlap}")
    ranges: list[tuple[int, int]] = []
    start = 0
    while True:
        end = min(start + size, len(text))
        if end < len(text):
            end = _cut(text, start + size // 2, end)
        ranges.append((start, end))
        if end >= len(text):
            return ranges
        nxt = end - overlap
        if overlap:  # begin the overlap at a boundary too, never before this chunk's middle
            nxt = _after_boundary(text, nxt, end)
        start = max(nxt, start + 1)


def _cut(text: str, lo: int, hi: int) -> int:
    for sep in BOUNDARIES:
        i = text.rfind(sep, lo, hi)
        if i >= 0:
            return i + len(sep)
    return hi


def _after_boundary(text: str, lo: int, hi: int) -> int:
    for sep in BOUNDARIES:
        i = text.find(sep, lo, hi)
        if i >= 0 and i + len(sep) < hi:
            return i + len(sep)
    return lo


@dataclass
class Part:
    """One chunk's result: its value (None when the chunk failed), spans and confidence by
    JSON Pointer (as engine results carry them), and where the chunk starts in the document."""

    value: Any
    spans: dict[str, list[int] | None] = field(default_factory=dict)
    confidence: dict[str, dict[str, float]] = field(default_factory=dict)
    offset: int = 0


@dataclass
class Merged:
    value: Any
    spans: dict[str, list[int] | None]
    confidence: dict[str, dict[str, float]]
    chunks: int
    used: int  # chunks whose result took part


def merge(parts: list[Part]) -> Merged:
    """The chunks' results merged by the rules above; value None when no chunk had one."""
    live = [(i, p) for i, p in enumerate(parts) if p.value is not None]
    origin: dict[str, tuple[int, str]] = {}  # merged pointer -> (part, pointer there), for leaves
    value = _merge([(p.value, i, "") for i, p in live], "", parts, origin) if live else None
    spans, confidence = {}, {}
    for ptr, (i, src) in origin.items():
        part = parts[i]
        if src in part.spans:
            span = part.spans[src]
            spans[ptr] = None if span is None else [span[0] + part.offset, span[1] + part.offset]
        if src in part.confidence:
            confidence[ptr] = part.confidence[src]
    return Merged(value, spans, confidence, len(parts), len(live))


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _merge(cands: list[tuple[Any, int, str]], ptr: str, parts: list[Part], origin: dict) -> Any:
    values = [v for v, _, _ in cands]
    if all(isinstance(v, dict) for v in values):
        keys: list[str] = []
        for v in values:
            keys += [k for k in v if k not in keys]
        return {k: _merge([(v[k], i, f"{src}/{_escape(k)}") for v, i, src in cands if k in v],
                          f"{ptr}/{_escape(k)}", parts, origin) for k in keys}
    if all(isinstance(v, list) for v in values):
        out, seen = [], set()
        for v, i, src in cands:
            for j, item in enumerate(v):
                if (key := _key(item)) in seen:
                    continue
                seen.add(key)
                _take(item, i, f"{src}/{j}", f"{ptr}/{len(out)}", origin)
                out.append(item)
        return out
    best = max(range(len(cands)), key=lambda n: (cands[n][0] not in (None, ""), _score(cands[n], parts), -n))
    v, i, src = cands[best]
    _take(v, i, src, ptr, origin)
    return v


def _score(cand: tuple[Any, int, str], parts: list[Part]) -> float:
    _, i, src = cand
    conf = parts[i].confidence.get(src)
    return conf["mean"] if conf else -1.0


def _take(value: Any, i: int, src: str, dest: str, origin: dict) -> None:
    """Record that `value` (and every leaf under it) at `dest` comes from part i at `src`."""
    if isinstance(value, (dict, list)) and not value:  # an empty container is a leaf
        origin[dest] = (i, src)
    elif isinstance(value, dict):
        for k, v in value.items():
            _take(v, i, f"{src}/{_escape(k)}", f"{dest}/{_escape(k)}", origin)
    elif isinstance(value, list):
        for j, v in enumerate(value):
            _take(v, i, f"{src}/{j}", f"{dest}/{j}", origin)
    else:
        origin[dest] = (i, src)


# --- a chunked document through the engine -------------------------------------------------------

def chunk_ranges(engine, schema: dict, text: str, max_tokens: int) -> list[tuple[int, int]]:
    """`text` split so that each chunk's prompt leaves `max_tokens` of the model's context for
    the output (sized from the text's own characters per token, with a margin; an overlap of
    about an eighth). Raises ValueError when the schema's prompt alone leaves no room."""
    tokenizer, context = engine.loaded.tokenizer, engine.loaded.context_len
    base = len(build_prompt(tokenizer, schema, "", context))
    room = context - base - max_tokens - 16
    if room < 64:
        raise ValueError(f"the schema's prompt ({base} tokens) and max_tokens ({max_tokens}) leave {max(room, 0)} of "
                         f"the model's {context}-token context for a chunk of the document; lower max_tokens")
    per_token = len(text) / max(len(tokenizer(text, add_special_tokens=False)["input_ids"]), 1)
    size = max(int(room * per_token * 0.85), 2)
    return split(text, size, min(size // 8, 400))


@dataclass
class ChunkStats(RequestStats):
    """A chunked document's stats: its chunks' summed, and how many chunks it had and used."""

    chunks: int = 0
    chunks_used: int = 0


def combined(schema: dict, results: list[ExtractResult], offsets: list[int]) -> ExtractResult:
    """One engine result (sequence.ExtractResult) for a document extracted in chunks: the
    chunks' values merged (merge()), validated against `schema`; their stats summed, with
    `chunks` and `chunks_used` added to what as_dict() reports. A chunk stopped at the time limit
    times the whole document out: no partial merge is passed off as its result."""
    parts = [Part(r.value if r.status == "succeeded" else None, r.spans or {}, r.confidence or {}, off)
             for r, off in zip(results, offsets)]
    m = merge(parts)
    stats = ChunkStats(results[0].stats.strategy, results[0].stats.draft_len, chunks=m.chunks, chunks_used=m.used)
    for name in ("prompt_tokens", "prefill_tokens", "prefix_tokens", "output_tokens", "target_passes", "proposed",
                 "accepted", "prefill_s", "decode_s"):
        setattr(stats, name, sum(getattr(r.stats, name) for r in results))
    stats.verbatim = any(r.stats.verbatim for r in results)
    stats.wall_s = max(r.stats.wall_s for r in results)
    stats.stop_reason = "chunks"
    tokens = [t for r in results for t in r.tokens]
    late = next((r for r in results if r.status == "timeout"), None)
    if late is not None:  # its chunks share the document's deadline: past it, the document fails whole
        return ExtractResult("timeout", None, "", tokens, stats, error=late.error)
    if m.value is None:
        first = results[0]
        return ExtractResult(first.status, None, "", tokens, stats,
                             error=f"none of the {m.chunks} chunks succeeded; the first: {first.error}")
    problems = validate_instance(schema, m.value)
    if problems:
        return ExtractResult("invalid", None, json.dumps(m.value, ensure_ascii=False), tokens, stats,
                             error=f"the {m.chunks} chunks' results merged do not validate: {problems[0]}")
    return ExtractResult("succeeded", m.value, json.dumps(m.value, ensure_ascii=False), tokens, stats,
                         spans=m.spans, confidence=m.confidence)



# --- chunking on an engine loop (the worker) -------------------------------------------------------

class ChunkedSubmissions:
    """Requests to an engine loop (engine/loop.py) with chunking as their options ask: a
    request whose options say `chunking="auto"` and whose document is too long for the model's
    context (the loop answers DocumentTooLong) is extracted in chunks (chunk_ranges), each a
    request of its own in the same loop, so the chunks of one document decode together; the
    caller's future resolves to their combined() result. A chunk that fails to start fails its
    document, naming the chunk. `cancel` reaches every chunk of a request."""

    def __init__(self, loop):
        self.loop = loop
        self._chunks: dict[str, list[str]] = {}  # request id -> its chunks' request ids

    def submit(self, request) -> Future:
        outer: Future = Future()
        first = self.loop.submit(request)
        first.add_done_callback(lambda f: self._first_done(request, f, outer))
        return outer

    def cancel(self, request_id: str) -> None:
        self.loop.cancel(request_id)
        for chunk_id in self._chunks.get(request_id, ()):
            self.loop.cancel(chunk_id)

    def _first_done(self, request, first, outer) -> None:
        error = first.exception()
        if error is None:
            outer.set_result(first.result())
            return
        if not (isinstance(error, DocumentTooLong) and request.options.chunking == "auto"
                and request.messages is None):
            outer.set_exception(error)
            return
        try:
            ranges = chunk_ranges(self.loop.engine, request.schema, request.document, request.options.max_tokens)
        except ValueError as e:
            outer.set_exception(ValueError(f"{error}; it cannot be chunked: {e}"))
            return
        self._chunk(request, ranges, outer)

    def _chunk(self, request, ranges: list[tuple[int, int]], outer) -> None:
        requests = [dataclasses.replace(request, document=request.document[s:t], id=f"{request.id}.chunk{k + 1}",
                                        on_output=None)
                    for k, (s, t) in enumerate(ranges)]
        self._chunks[request.id] = [r.id for r in requests]
        results: list = [None] * len(requests)
        left = [len(requests)]
        lock = threading.Lock()

        def done(k: int, f) -> None:
            with lock:
                if outer.done():
                    return
                e = f.exception()
                if e is not None:
                    self.cancel(request.id)
                    self._chunks.pop(request.id, None)
                    # a loop that went down failed no chunk of its own: the caller sees it as it is
                    outer.set_exception(e if isinstance(e, EngineLoopDown) else
                                        ValueError(f"chunk {k + 1} of {len(requests)}: {e}"))
                    return
                results[k] = f.result()
                left[0] -= 1
                if left[0]:
                    return
                self._chunks.pop(request.id, None)
            try:
                outer.set_result(combined(request.schema, results, [s for s, _ in ranges]))
            except Exception as e:  # noqa: BLE001 - a merge bug must fail the document, not hang it
                outer.set_exception(e)

        for k, r in enumerate(requests):
            self.loop.submit(r).add_done_callback(lambda f, k=k: done(k, f))
