"""CLI input errors are clear, exit 2, and happen before any model loads."""

from __future__ import annotations

import json

import pytest

from structspec.cli import main


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_missing_schema_file(capsys, tmp_path):
    code, err = run_cli(capsys, "extract", "--schema", str(tmp_path / "none.json"), "doc.txt")
    assert code == 2 and "cannot read schema" in err


def test_schema_file_that_is_not_json(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, err = run_cli(capsys, "extract", "--schema", str(bad), "doc.txt")
    assert code == 2 and "is not valid JSON" in err and "line 1" in err


def test_unusable_schema_names_keyword_and_path(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc))
    assert code == 2 and "/uniqueItems [uniqueItems]" in err


def test_missing_document(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read document" in err


def test_bad_option_value(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc), "--draft-len", "999")
    assert code == 2 and "structspec: error: --draft-len must be between 0 and 64, not 999\n" in err


def test_bad_option_value_names_the_flag_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import structspec.cli as cli

    monkeypatch.setattr(cli, "build_engine", lambda settings: pytest.fail("the model was loaded"))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc), "--strategy", "none",
                        "--max-tokens", "0")
    assert code == 2 and "structspec: error: --max-tokens must be between 1 and 65536, not 0\n" in err
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc), "--strategy", "none",
                        "--temperature", "11")
    assert code == 2 and "structspec: error: --temperature must be between 0 and 10, not 11.0\n" in err


def test_auto_strategy_learns_in_the_local_database(capsys, monkeypatch, tmp_path, tiny_engine):
    """`extract` defaults to auto: the schema file is registered once in the local database,
    each document's (strategy, k) is drawn by the selector, and its stats are stored."""
    import structspec.cli as cli
    from structspec.config import Settings
    from structspec.db.repositories import SchemaRepository
    from structspec.db.session import make_engine, make_session_factory
    from structspec.db.stats import StatsRepository

    monkeypatch.setenv("STRUCTSPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("STRUCTSPEC_DATABASE_URL", raising=False)
    monkeypatch.delenv("STRUCTSPEC_JOB_STRATEGY", raising=False)
    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_engine)
    schema = tmp_path / "my receipt.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"paid": {"enum": ["cash", "card"]}},
                                  "required": ["paid"]}))
    doc = tmp_path / "d.txt"
    doc.write_text("Paid by card")
    lines = []
    for _ in range(2):  # a second run finds the same registered schema
        assert main(["extract", "--schema", str(schema), str(doc), str(doc), "--stats", "--max-tokens", "24"]) == 0
        err = capsys.readouterr().err
        assert "statistics of schema cli.my_receipt v1" in err
        found = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
        # the first line says what ran: the engine's model and dtype (and why that dtype)
        assert found[0]["engine"]["dtype"] == "float32" and found[0]["engine"]["dtype_note"]
        assert found[0]["engine"]["attention"] == tiny_engine.runner.attention  # native, torch or triton
        assert found[0]["engine"]["layer_steps"] == tiny_engine.layer_steps  # fused or torch
        lines += found[1:]
    assert [x["selected_by"] for x in lines] == ["selected"] * 4
    # a new schema probes every proposer first, at a draft length of the configured grid
    assert {x["strategy"] for x in lines} == {"schema", "ngram", "suffix", "composite"}

    sessions = make_session_factory(make_engine(Settings.from_env().database_url))
    with sessions() as session:
        record = SchemaRepository(session).get_by_name("cli.my_receipt")
        assert record.version == 1
        arms = StatsRepository(session).arms(record.id)
    assert sum(a.requests for a in arms) == 4
    assert sum(a.output_tokens for a in arms) == sum(x["output_tokens"] for x in lines)
    assert sum(a.target_passes for a in arms) == sum(x["target_passes"] for x in lines)
    assert {(a.strategy, a.draft_len) for a in arms} == {(x["strategy"], x["draft_len"]) for x in lines}


def test_verbatim_extract_copies_spans_and_learns_under_verbatim_arms(capsys, monkeypatch, tmp_path, tiny_engine):
    import structspec.cli as cli
    from structspec.config import Settings
    from structspec.db.repositories import SchemaRepository
    from structspec.db.session import make_engine, make_session_factory
    from structspec.db.stats import StatsRepository

    monkeypatch.setenv("STRUCTSPEC_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("STRUCTSPEC_DATABASE_URL", raising=False)
    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_engine)
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}))
    doc = tmp_path / "d.txt"
    doc.write_text('Sold by "Corner Cafe", Main St.\nThanks!')
    assert main(["extract", "--schema", str(schema), str(doc), str(doc), "--stats", "--verbatim"]) == 0
    out, err = capsys.readouterr()
    assert all(json.loads(line)["who"] in doc.read_text() for line in out.splitlines())
    stats = [json.loads(x) for x in err.splitlines() if x.startswith('{"document"')]
    assert [x["verbatim"] for x in stats] == [True, True] and stats[0]["strategy"] == "schema"
    with make_session_factory(make_engine(Settings.from_env().database_url))() as session:
        arms = StatsRepository(session).arms(SchemaRepository(session).get_by_name("cli.who").id)
    assert {a.strategy for a in arms} == {s["strategy"] + "+verbatim" for s in stats}


def test_auto_strategy_with_an_unusable_database_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("STRUCTSPEC_DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc))
    assert code == 2 and "--strategy auto keeps statistics in postgresql" in err
    assert "pick a fixed --strategy" in err


def test_auto_strategy_with_a_schema_over_a_registry_limit_names_the_limit(capsys, monkeypatch, tmp_path):
    """The registry below the API refuses it for the CLI too, before the model loads."""
    monkeypatch.setenv("STRUCTSPEC_DATABASE_URL", f"sqlite:///{tmp_path / 'local.db'}")
    monkeypatch.setenv("STRUCTSPEC_MAX_SCHEMA_BYTES", "64")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "description": "x" * 100}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc))
    assert code == 2 and f"schema {schema} cannot be registered for --strategy auto" in err
    assert "max_schema_bytes" in err and "/schema:" in err


@pytest.mark.model
def test_extract_prints_schema_valid_json_per_document(capsys, monkeypatch, tmp_path):
    from pathlib import Path

    monkeypatch.setenv("STRUCTSPEC_DATA_DIR", str(tmp_path))  # auto's statistics stay out of $HOME
    monkeypatch.delenv("STRUCTSPEC_DATABASE_URL", raising=False)

    from structspec.grammar import validate_instance

    root = Path(__file__).resolve().parents[2]
    schema = json.loads((root / "schemas" / "event.json").read_text())
    code = main(["extract", "--schema", str(root / "schemas" / "event.json"),
                 str(root / "examples" / "event-jazz-night.txt"), "--stats", "--max-tokens", "200"])
    out, err = capsys.readouterr()
    assert code == 0, err
    value = json.loads(out.strip().splitlines()[0])
    assert validate_instance(schema, value) == []
    stats = json.loads(err.strip().splitlines()[-1])
    for key in ("strategy", "draft_len", "output_tokens", "target_passes", "proposed", "accepted",
                "acceptance_rate", "tokens_per_pass", "prefill_s", "decode_s", "wall_s"):
        assert key in stats


def test_prefork_worker_on_cuda_is_refused_before_loading_anything(capsys, monkeypatch):
    import structspec.cli as cli
    import structspec.worker.tasks

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(structspec.worker.tasks, "prepare_model", lambda *a: pytest.fail("loaded a model"))
    code, err = run_cli(capsys, "worker", "--pool", "prefork")
    assert code == 2 and "--pool prefork" in err and "CUDA" in err and "threads pool" in err


def test_a_bad_setting_is_a_one_line_error_naming_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("STRUCTSPEC_JOB_MAX_ATTEMPTS", "0")
    assert main(["worker"]) == 2
    assert capsys.readouterr().err == "structspec: error: STRUCTSPEC_JOB_MAX_ATTEMPTS must be at least 1, not 0\n"
    monkeypatch.setenv("STRUCTSPEC_JOB_MAX_ATTEMPTS", "three")
    assert main(["worker"]) == 2
    assert "STRUCTSPEC_JOB_MAX_ATTEMPTS='three' is not a valid int" in capsys.readouterr().err


def test_extract_spans_prints_each_value_with_its_span_and_confidence(capsys, monkeypatch, tmp_path, tiny_engine):
    import structspec.cli as cli

    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_engine)
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}))
    doc = tmp_path / "d.txt"
    doc.write_text('Sold by "Corner Cafe", Main St.\nThanks!')
    assert main(["extract", "--schema", str(schema), str(doc), "--verbatim", "--strategy", "none", "--spans"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert set(line) == {"result", "spans", "confidence"}
    start, end = line["spans"]["/who"]
    assert doc.read_text()[start:end] == line["result"]["who"]
    assert 0 <= line["confidence"]["/who"]["min"] <= line["confidence"]["/who"]["mean"] <= 1


def test_building_the_cli_imports_neither_torch_nor_transformers():
    """`structspec --help` and the client commands start without loading the model stack: the
    CLI imports it inside the commands that need it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from structspec.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'celery', 'litestar') if m in sys.modules]; "
            "assert not heavy, heavy")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60,
                   env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_extract_progress_counts_every_document_and_keeps_stdout_clean(capsys, monkeypatch, tmp_path, tiny_engine):
    import structspec.cli as cli

    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_engine)
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"paid": {"enum": ["cash", "card"]}},
                                  "required": ["paid"]}))
    docs = []
    for i in range(3):
        docs.append(tmp_path / f"d{i}.txt")
        docs[-1].write_text(f"Paid by card {i}")
    args = ["extract", "--schema", str(schema), *map(str, docs), "--strategy", "none", "--max-tokens", "24"]
    assert main([*args, "--progress"]) == 0
    out, err = capsys.readouterr()
    assert "extract: 100%" in err and "3/3" in err
    assert [json.loads(line) for line in out.splitlines()] and "extract" not in out
    assert main(args) == 0  # stderr is not a terminal here: no bar by default
    assert "3/3" not in capsys.readouterr().err


def test_a_pdf_and_its_text_give_the_same_result_and_the_pdf_gets_boxes(capsys, monkeypatch, tmp_path,
                                                                        tiny_compact_engine):
    from pathlib import Path

    import structspec.cli as cli
    from structspec.ingest import ingest

    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_compact_engine)
    pdf = Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf"
    text = tmp_path / "azure.txt"
    text.write_text(ingest(pdf.read_bytes()).text, encoding="utf-8")
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}},
                                  "required": ["who"]}))
    common = ["extract", "--schema", str(schema), "--verbatim", "--strategy", "none", "--spans", "--max-tokens", "48"]
    assert main([*common, str(pdf), "--overlay", str(tmp_path / "overlay")]) == 0
    from_pdf = json.loads(capsys.readouterr().out)
    assert main([*common, str(text)]) == 0
    from_text = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in from_pdf.items() if k != "boxes"} == from_text and "boxes" not in from_text
    [where] = from_pdf["boxes"]["/who"]  # the value is a span of one line
    assert where["page"] == 1 and len(where["box"]) == 4
    assert (tmp_path / "overlay" / "AzureInterior-page1.png").stat().st_size > 10_000


def test_an_image_is_read_by_ocr_and_gets_pixel_boxes_drawn_on_itself(capsys, monkeypatch, tmp_path,
                                                                       tiny_compact_engine):
    """Needs the tesseract command (Debian: apt-get install tesseract-ocr); fails without it."""
    from pathlib import Path

    import pypdfium2 as pdfium
    from PIL import Image

    import structspec.cli as cli
    from structspec.ingest import ingest

    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_compact_engine)
    pdf = pdfium.PdfDocument((Path(__file__).resolve().parents[1] / "fixtures" / "invoices" / "AzureInterior.pdf")
                             .read_bytes())
    page = pdf[0].render(scale=3).to_pil()
    png = tmp_path / "scan.png"
    page.crop((0, 0, page.width, page.height * 2 // 5)).save(png, dpi=(216, 216))  # the invoice's top
    text = tmp_path / "scan.txt"
    text.write_text(ingest(png.read_bytes()).text, encoding="utf-8")
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}},
                                  "required": ["who"]}))
    common = ["extract", "--schema", str(schema), "--verbatim", "--strategy", "none", "--spans", "--max-tokens", "48"]
    assert main([*common, str(png), "--overlay", str(tmp_path / "overlay")]) == 0
    from_png = json.loads(capsys.readouterr().out)
    assert main([*common, str(text)]) == 0
    from_text = json.loads(capsys.readouterr().out)
    assert {k: v for k, v in from_png.items() if k != "boxes"} == from_text and "boxes" not in from_text
    [where] = from_png["boxes"]["/who"]  # the value is a span of one line, in the image's pixels
    assert where["page"] == 1 and 0 <= where["box"][0] < where["box"][2] <= page.width
    overlay = Image.open(tmp_path / "overlay" / "scan-page1.png")
    assert overlay.size == Image.open(png).size


def test_an_unreadable_pdf_is_a_clear_error_before_the_model_loads(capsys, tmp_path):
    bad = tmp_path / "scan.pdf"
    bad.write_bytes(b"%PDF-1.7\n% truncated")
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(bad))
    assert code == 2 and f"document {bad}: the PDF cannot be read" in err and "loading model" not in err


def test_a_document_longer_than_the_context_is_chunked_and_merged_on_request(capsys, monkeypatch, tmp_path,
                                                                              tiny_compact_engine):
    import structspec.cli as cli

    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_compact_engine)
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}))
    doc = tmp_path / "long.txt"
    text = "".join(f"Line {n}: shipment {n * 7} went to depot {n % 13}.\n" for n in range(1800))  # > 8192 tokens
    doc.write_text(text)
    common = ["extract", "--schema", str(schema), str(doc), "--verbatim", "--strategy", "none", "--spans",
              "--max-tokens", "32", "--stats"]
    assert main(common) == 1  # off by default: it fails naming both token counts
    assert "the model's context is 8192 tokens" in capsys.readouterr().err
    code = main([*common, "--chunking", "auto"])
    out, err = capsys.readouterr()
    chunks = int(err.split("extracting it in ", 1)[1].split(" chunks", 1)[0])
    stats = json.loads([line for line in err.splitlines() if line.startswith('{"document"')][0])
    assert chunks >= 2 and stats["chunks"] == chunks and stats["stop_reason"] == "chunks"
    assert code == 0, err
    line = json.loads(out)
    assert line["spans"]["/who"] is not None, (line, err[-2000:])
    start, end = line["spans"]["/who"]  # verbatim: a span, shifted into the whole document
    assert text[start:end] == line["result"]["who"] and line["chunks"] == chunks


def test_a_bad_timeout_names_the_flag_before_the_model_loads(capsys, tmp_path, monkeypatch):
    import structspec.cli as cli

    monkeypatch.setattr(cli, "build_engine", lambda settings: pytest.fail("the model was loaded"))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc), "--strategy", "none", "--timeout", "0")
    assert code == 2 and "structspec: error: --timeout must be between 1 and 86400, not 0\n" in err


def test_a_document_past_its_timeout_fails_naming_the_limit_its_chunks_included(capsys, monkeypatch, tmp_path,
                                                                              tiny_compact_engine):
    """--timeout is the document's limit: extracted in chunks, every chunk runs within the time
    the document began with (the engine's clock here reads past it after the first reading)."""
    import structspec.cli as cli

    readings = []
    monkeypatch.setattr(tiny_compact_engine, "clock",
                        lambda: readings.append(1000.0 if not readings else 1003.0) or readings[-1])
    monkeypatch.setattr(cli, "build_engine", lambda settings: tiny_compact_engine)
    schema = tmp_path / "who.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}))
    doc = tmp_path / "long.txt"
    doc.write_text("".join(f"Line {n}: shipment {n * 7} went to depot {n % 13}.\n" for n in range(1800)))
    code = main(["extract", "--schema", str(schema), str(doc), "--strategy", "none", "--max-tokens", "32",
                 "--chunking", "auto", "--timeout", "2"])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert (f"structspec: {doc}: timeout: the job ran longer than its limit of 2 s (options.timeout_s; server "
            "default STRUCTSPEC_JOB_TIMEOUT_S)") in err
