"""Long documents: chunk boundaries, and the merge rules on crafted results."""

from __future__ import annotations

import pytest

from structspec.services.chunks import Part, merge, split


def conf(mean: float) -> dict[str, float]:
    return {"min": mean, "mean": mean}


def test_a_scalar_takes_the_most_confident_value_and_its_span_moves_into_the_document():
    a = Part({"total": "5.00"}, {"/total": [10, 14]}, {"/total": conf(0.4)}, offset=0)
    b = Part({"total": "7.00"}, {"/total": [3, 7]}, {"/total": conf(0.9)}, offset=1000)
    m = merge([a, b])
    assert m.value == {"total": "7.00"} and m.spans == {"/total": [1003, 1007]}
    assert m.confidence == {"/total": conf(0.9)} and (m.chunks, m.used) == (2, 2)


def test_ties_go_to_the_first_chunk_and_null_or_empty_loses_to_any_value():
    tie = merge([Part({"n": 1}, {}, {"/n": conf(0.5)}), Part({"n": 2}, {}, {"/n": conf(0.5)}, offset=50)])
    assert tie.value == {"n": 1}
    found = merge([Part({"who": None}, {"/who": None}, {"/who": conf(0.99)}),
                   Part({"who": "Ann"}, {"/who": [4, 7]}, {"/who": conf(0.2)}, offset=100)])
    assert found.value == {"who": "Ann"} and found.spans == {"/who": [104, 107]}
    empty = merge([Part({"who": ""}, {"/who": None}, {"/who": conf(0.95)}),
                   Part({"who": "Bo"}, {"/who": [0, 2]}, {"/who": conf(0.3)}, offset=9)])
    assert empty.value == {"who": "Bo"} and empty.spans == {"/who": [9, 11]}


def test_arrays_concatenate_in_chunk_order_without_the_overlap_repeated():
    a = Part({"items": [{"name": "tea", "price": 2}, {"name": "cake", "price": 4}]},
             {"/items/0/name": [0, 3], "/items/1/name": [10, 14]},
             {"/items/0/name": conf(0.9), "/items/1/name": conf(0.8)}, offset=0)
    b = Part({"items": [{"name": "cake", "price": 4}, {"name": "soup", "price": 6}]},
             {"/items/0/name": [2, 6], "/items/1/name": [20, 24]},
             {"/items/0/name": conf(0.7), "/items/1/name": conf(0.6)}, offset=12)
    m = merge([a, b])
    assert m.value == {"items": [{"name": "tea", "price": 2}, {"name": "cake", "price": 4},
                                 {"name": "soup", "price": 6}]}
    # the duplicate keeps the first chunk's span; the new item's span is shifted and re-indexed
    assert m.spans == {"/items/0/name": [0, 3], "/items/1/name": [10, 14], "/items/2/name": [32, 36]}
    assert m.confidence["/items/2/name"] == conf(0.6)


def test_nested_objects_merge_field_by_field_keeping_the_order_keys_first_appear():
    a = Part({"seller": {"name": "Acme", "city": None}, "date": "2024-01-02"},
             {"/seller/name": [0, 4]}, {"/seller/name": conf(0.5), "/seller/city": conf(0.9), "/date": conf(0.3)})
    b = Part({"seller": {"city": "Oslo", "name": "ACME AS"}, "total": 9.5},
             {"/seller/name": [1, 8], "/seller/city": [9, 13]},
             {"/seller/name": conf(0.6), "/seller/city": conf(0.4), "/total": conf(0.8)}, offset=200)
    m = merge([a, b])
    assert m.value == {"seller": {"name": "ACME AS", "city": "Oslo"}, "date": "2024-01-02", "total": 9.5}
    assert list(m.value) == ["seller", "date", "total"] and list(m.value["seller"]) == ["name", "city"]
    assert m.spans == {"/seller/name": [201, 208], "/seller/city": [209, 213]}


def test_failed_chunks_are_left_out_and_keys_with_a_slash_keep_their_pointer():
    m = merge([Part(None), Part({"a/b": "x"}, {"/a~1b": [0, 1]}, {"/a~1b": conf(1.0)}, offset=7)])
    assert m.value == {"a/b": "x"} and m.spans == {"/a~1b": [7, 8]} and (m.chunks, m.used) == (2, 1)
    assert merge([Part(None), Part(None)]).value is None


TEXT = ("Page one opens here. It has two sentences.\n\nA second paragraph on page one.\n"
        "A line after it.\n\nPage two starts. " + "word " * 60 + "\n\nThe end.")


@pytest.mark.parametrize("size, overlap", [(40, 0), (60, 10), (100, 30), (len(TEXT), 0)])
def test_chunks_cover_the_text_within_the_size_and_cut_at_boundaries(size, overlap):
    ranges = split(TEXT, size, overlap)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(TEXT)
    for (s0, e0), (s1, e1) in zip(ranges, ranges[1:]):
        assert s0 < s1 <= e0  # in order, no gap
        assert e0 - s1 <= overlap  # the overlap is at most what was asked
        assert TEXT[e0 - 1] in " \n" or TEXT[e0 - 2:e0] == ". "  # each cut at a boundary
    assert all(0 < e - s <= size for s, e in ranges)
    if size == len(TEXT):
        assert ranges == [(0, len(TEXT))]


def test_paragraph_breaks_are_preferred_over_lines_and_words():
    text = "aaaa aaaa aaaa\n\nbbbb\ncccc dddd eeee"
    assert split(text, 24)[0] == (0, 16)  # after the blank line, not after "bbbb\n" (in the same half)


def test_bad_sizes_are_refused_naming_the_bound():
    with pytest.raises(ValueError, match="at least 2"):
        split("abc", 1)
    with pytest.raises(ValueError, match="half the chunk size"):
        split("abc", 10, 5)


# --- chunking on an engine loop (the worker's path) ----------------------------------------------

LONG = "".join(f"Line {n}: shipment {n * 7} went to depot {n % 13}.\n" for n in range(1800))  # > 8192 tokens
WHO = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}


def _request(chunking: str, document: str = LONG):
    from structspec.engine.sequence import Request
    from structspec.options import RequestOptions

    opts = RequestOptions(strategy="none", draft_len=0, max_tokens=32, verbatim=True, chunking=chunking)
    return Request(WHO, document, opts)


def test_the_loop_extracts_a_too_long_document_in_chunks_when_its_options_ask(tiny_compact_engine):
    """chunking "auto": the document is split, its chunks run in the same loop, and the caller
    gets one merged result whose span points into the whole document; "off": the loop's
    DocumentTooLong, naming the context; a short document runs as one request either way."""
    from structspec.engine.loop import EngineLoop
    from structspec.engine.prompt import DocumentTooLong
    from structspec.services.chunks import ChunkedSubmissions

    loop = EngineLoop(tiny_compact_engine)
    try:
        subs = ChunkedSubmissions(loop)
        with pytest.raises(DocumentTooLong, match="8192 tokens"):
            subs.submit(_request("off")).result(timeout=120)
        res = subs.submit(_request("auto")).result(timeout=600)
        assert res.stats.chunks >= 2 and res.stats.stop_reason == "chunks"
        assert res.status == "succeeded", res.error
        start, end = res.spans["/who"]
        assert LONG[start:end] == res.value["who"]
        short = subs.submit(_request("auto", "Line 1: shipment 7 went to depot 1.")).result(timeout=120)
        assert short.status == "succeeded" and not hasattr(short.stats, "chunks")
        assert subs._chunks == {}  # nothing left behind
    finally:
        loop.stop()


def test_a_chunk_that_fails_fails_its_document_naming_the_chunk(tiny_compact_engine, monkeypatch):
    import structspec.services.chunks as chunks
    from structspec.engine.loop import EngineLoop

    # every chunk as long as the whole document: each is refused again, and the document fails once
    monkeypatch.setattr(chunks, "chunk_ranges", lambda engine, schema, text, max_tokens: [(0, len(text))] * 3)
    loop = EngineLoop(tiny_compact_engine)
    try:
        future = chunks.ChunkedSubmissions(loop).submit(_request("auto"))
        with pytest.raises(ValueError, match=r"chunk \d of 3: .*8192 tokens"):
            future.result(timeout=120)
    finally:
        loop.stop()


def test_a_chunk_stopped_at_the_time_limit_times_the_whole_document_out():
    """No partial merge passes for a document whose time ran out (the others' values are left out)."""
    from structspec.engine.sequence import ExtractResult, RequestStats
    from structspec.options import timeout_error
    from structspec.services.chunks import combined

    def result(status, value=None, error=None):
        return ExtractResult(status, value, "", [1, 2], RequestStats("none", 0), error=error)

    done = combined(WHO, [result("succeeded", {"who": "Ann"}), result("timeout", error=timeout_error(4))], [0, 50])
    assert (done.status, done.value, done.error) == ("timeout", None, timeout_error(4))
    assert done.stats.chunks == 2 and done.tokens == [1, 2, 1, 2]


def test_the_chunks_of_a_document_share_its_deadline(tiny_compact_engine, monkeypatch):
    """The limit is the document's: its chunks carry the deadline set when the whole document
    was first taken, so a clock past it stops every chunk, and the document fails naming it."""
    from structspec.engine.loop import EngineLoop
    from structspec.services.chunks import ChunkedSubmissions

    readings = []

    def clock():  # the first reading sets the document's deadline (1000 + 2); every later one is past it
        readings.append(1000.0 if not readings else 1003.0)
        return readings[-1]

    monkeypatch.setattr(tiny_compact_engine, "clock", clock)
    loop = EngineLoop(tiny_compact_engine)
    submitted = []
    real_submit = loop.submit
    monkeypatch.setattr(loop, "submit", lambda request: submitted.append(request) or real_submit(request))
    try:
        req = _request("auto")
        req.options = req.options.replace(timeout_s=2)
        res = ChunkedSubmissions(loop).submit(req).result(timeout=300)
    finally:
        loop.stop()
    assert len(submitted) >= 3 and {r.deadline for r in submitted} == {1002.0}  # the document, then its chunks
    assert res.status == "timeout" and res.stats.chunks == len(submitted) - 1
    assert res.error.startswith("the job ran longer than its limit of 2 s")
