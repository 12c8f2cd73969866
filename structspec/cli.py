"""`structspec` command line: extract, and the service commands (serve, worker, migrate, keys, submit,
batch, demo). The benchmarks are beside the product, in the repository's bench/ (`python -m bench.<name>`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import deque
from pathlib import Path

from structspec.config import Settings, SettingsError
from structspec.options import AUTO, OPTION_NAMES, SPECS, OptionError, RequestOptions
from structspec.worker.watchdog import EXIT_ENGINE_HUNG


class CliError(Exception):
    """A problem with the user's input: printed as `structspec: error: ...`, exit 2."""


def read_json_file(path: str, what: str):
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"{what} {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def read_source(path: str):
    """The document in file `path` ('-': stdin) as structspec.ingest reads it: text, or a PDF's
    or an image's text (its text layer, or OCR) with each character's page and box, within the
    `ingest_*` settings' limits (what reading changed to stay within them is printed)."""
    from structspec.ingest import IngestError, Limits, ingest

    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise CliError(f"cannot read document {path}: {e.strerror}") from None
    try:
        doc = ingest(data, name=None if path == "-" else path, limits=Limits.from_settings(Settings.from_env()))
    except IngestError as e:
        raise CliError(f"document {path}: {e}") from None
    for warning in doc.warnings:
        print(f"structspec: warning: document {path}: {warning}", file=sys.stderr)
    return doc


def read_document(path: str) -> str:
    return read_source(path).text


def settings_from(args) -> Settings:
    return Settings.from_env(model=getattr(args, "model", None), device=getattr(args, "device", None),
                             grammar_backend=getattr(args, "grammar_backend", None),
                             kernel_backend=getattr(args, "kernel_backend", None),
                             torch_threads=getattr(args, "threads", None))


def build_engine(settings: Settings):
    from structspec.engine.engine import Engine

    settings.apply_torch_threads()
    print(f"structspec: loading model {settings.model!r} ...", file=sys.stderr, flush=True)
    return Engine.from_settings(settings)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="'default' (SmolLM2-135M-Instruct), a local model dir, a .gguf file "
                                   "or a Hugging Face id available offline [env STRUCTSPEC_MODEL]")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N [env STRUCTSPEC_DEVICE]")
    p.add_argument("--grammar-backend", choices=["llguidance", "outlines"])
    p.add_argument("--kernel-backend", choices=["auto", "triton", "torch"])
    p.add_argument("--threads", type=int, help="torch CPU threads (0 = torch's default)")


def option_help(name: str, note: str = "") -> str:
    """A request option's --help: its help and bounds from structspec.options.SPECS, then `note`
    (this command's default)."""
    spec = SPECS[name]
    shown = [f"{_number(spec.minimum)} to {_number(spec.maximum)}"] if spec.minimum is not None else []
    shown += [note] if note else []
    return f"{spec.help} [{'; '.join(shown)}]" if shown else spec.help


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


FLAGS = {"timeout_s": "--timeout"}  # the options whose flag is not their name with dashes


def flag_error(e: OptionError) -> CliError:
    """`e` naming the command-line flag rather than the option: `--draft-len must be ...`."""
    flag, message = FLAGS.get(e.option, "--" + e.option.replace("_", "-")), str(e)
    return CliError(flag + message[len(e.option):] if message.startswith(e.option + " ") else f"{flag}: {message}")


def add_decode_args(p: argparse.ArgumentParser, defaults: Settings) -> None:
    p.add_argument("--strategy", choices=SPECS["strategy"].choices, default=defaults.job_strategy,
                   help=option_help("strategy", "auto keeps statistics in the local database; "
                                                "env STRUCTSPEC_JOB_STRATEGY, default %(default)s"))
    p.add_argument("--draft-len", type=int, metavar="K",
                   help=option_help("draft_len", f"here {defaults.draft_len} for a fixed strategy, "
                                                 "env STRUCTSPEC_DRAFT_LEN"))
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help=option_help("temperature", "default %(default)s"))
    p.add_argument("--seed", type=int, metavar="S", help=option_help("seed"))
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, metavar="N",
                   help=option_help("max_tokens", "env STRUCTSPEC_MAX_TOKENS, default %(default)s"))
    p.add_argument("--verbatim", action="store_true", help=option_help("verbatim"))
    p.add_argument(FLAGS["timeout_s"], type=int, dest="timeout_s", metavar="S",
                   help=option_help("timeout_s", f"env STRUCTSPEC_JOB_TIMEOUT_S, default {defaults.job_timeout_s}"))


def cmd_extract(args) -> int:
    from structspec.grammar import SchemaError, check_schema
    from structspec.grammar.verbatim import uses_verbatim

    schema = read_json_file(args.schema, "schema")
    try:
        warnings = check_schema(schema)  # fail before the model loads
    except SchemaError as e:
        raise CliError(f"schema {args.schema} cannot be used: {e}") from None
    for w in warnings:
        print(f"structspec: warning: schema {args.schema}: {SchemaError([w])} (results are still validated)",
              file=sys.stderr)
    documents = [read_messages(p) if args.messages else (p, read_source(p), None) for p in args.documents]
    if args.overlay is not None and not args.spans:
        raise CliError("--overlay draws the boxes of --spans: give both")
    settings = settings_from(args)
    try:
        opts = RequestOptions(strategy=args.strategy, draft_len=args.draft_len, temperature=args.temperature,
                              seed=args.seed, max_tokens=args.max_tokens, verbatim=args.verbatim,
                              chunking=args.chunking, timeout_s=args.timeout_s).with_defaults(settings).check()
    except OptionError as e:
        raise flag_error(e) from None
    local = open_local_stats(settings, schema, args.schema) if opts.strategy == AUTO else None
    verbatim = uses_verbatim(schema, opts.verbatim)  # verbatim runs learn from verbatim runs only
    engine = build_engine(settings)
    progress = args.progress if args.progress is not None else len(documents) > 1 and sys.stderr.isatty()
    return run_documents(engine, schema, documents, opts, local, verbatim, args.stats, args.spans, progress,
                         args.overlay, opts.chunking)


def read_messages(path: str) -> tuple[str, str, list[dict[str, str]]]:
    """(path, text, messages) of a chat messages file: a JSON array of {role, content}, or an
    object holding one under "messages" (an OpenAI chat request body)."""
    from structspec.engine.prompt import MessagesError, chat_messages, messages_text

    raw = read_json_file(path, "messages file")
    try:
        messages = chat_messages(raw.get("messages") if isinstance(raw, dict) else raw)
    except MessagesError as e:
        raise CliError(f"messages file {path}: {e}") from None
    from structspec.ingest import Document

    return path, Document(messages_text(messages), "text/plain"), messages


def run_documents(engine, schema: dict, documents: list[tuple[str, object, list | None]], opts, local, verbatim: bool,
                  show_stats: bool, show_spans: bool = False, progress: bool = False,
                  overlay: Path | None = None, chunking: str = "off") -> int:
    """Decode `documents` (path, ingest.Document, chat messages or None) together, keeping the engine full:
    each document is submitted when a place frees up, so with `auto` its (strategy, k) is drawn
    from statistics that include the documents finished before it. Results are printed in input
    order as they become available; `progress`: a bar on stderr counts finished documents."""
    from tqdm import tqdm

    from structspec.engine.model import short_name

    if show_stats:  # what every document's line below ran on
        print(json.dumps({"engine": {"model": engine.loaded.name, "device": str(engine.device),
                                     "dtype": short_name(engine.loaded.dtype),
                                     "dtype_note": engine.loaded.dtype_note, "batched": engine.batched,
                                     "max_seqs": engine.scheduler.max_seqs,
                                     "forward": engine.forward_name, "attention": engine.runner.attention,
                                     "layer_steps": engine.layer_steps, "layer_loop": engine.layer_loop,
                                     "verification": engine.verification,
                                     "packed_linears": engine.packed_linears, "linear": engine.linear}}), file=sys.stderr, flush=True)
    with tqdm(total=len(documents), desc="extract", unit="doc", file=sys.stderr, disable=not progress) as bar:
        return _run_documents(engine, schema, documents, opts, local, verbatim, show_stats, show_spans, bar, overlay,
                              chunking)


def _run_documents(engine, schema, documents, opts, local, verbatim, show_stats, show_spans, bar, overlay,
                   chunking: str = "off") -> int:
    from tqdm import tqdm

    from structspec.engine.engine import Request
    from structspec.engine.prompt import DocumentTooLong
    from structspec.grammar import schema_hash

    # (input index, path, text, chat messages, chunk number or None)
    pending = deque((i, path, doc.text, messages, None) for i, (path, doc, messages) in enumerate(documents))
    ready: dict[int, tuple[str, object, str | None]] = {}  # input index -> (path, result or error, selected_by)
    index_of: dict[str, tuple[int, str, str | None, int | None]] = {}  # request id -> (index, path, selected_by, chunk)
    chunked: dict[int, dict] = {}  # input index -> {"offsets": [...], "results": {number: result}, "deadline": t}
    printed = failed = 0
    history = f"cli/{schema_hash(schema)}"
    while pending or engine.has_work():
        while pending and engine.running + engine.waiting < engine.scheduler.max_seqs:
            i, path, text, messages, chunk = pending.popleft()
            run, why = opts, None
            if local is not None:
                choice, why = local.choose(opts.draft_len, verbatim)
                run = opts.replace(strategy=choice.strategy, draft_len=choice.draft_len)
            acceptance = (local.acceptance(run.strategy, run.draft_len, verbatim)
                          if local is not None and run.strategy != "none" and run.draft_len else None)
            # a chunk runs within its document's time, which began when the document was first submitted
            deadline = chunked[i]["deadline"] if chunk is not None else None
            # one user's run: each document drafts from the outputs of the schema's documents before it
            request = Request(schema, text, run, acceptance=acceptance, messages=messages, deadline=deadline,
                              history=history)
            try:
                engine.submit(request)
            except ValueError as e:  # too long for the context or the KV budget: this document only
                if isinstance(e, DocumentTooLong) and chunking == "auto" and messages is None and chunk is None:
                    ranges = _chunks_of(engine, schema, text, run.max_tokens, path)
                    if isinstance(ranges, list):
                        chunked[i] = {"offsets": [s for s, _ in ranges], "results": {}, "deadline": request.deadline}
                        pending.extendleft(reversed([(i, path, text[s:t], None, k)
                                                     for k, (s, t) in enumerate(ranges)]))
                        continue
                    e = ranges
                if chunk is not None:  # a chunk that still does not fit fails its whole document
                    e = ValueError(f"chunk {chunk + 1} of {len(chunked[i]['offsets'])}: {e}")
                    chunked.pop(i)
                    pending = deque(p for p in pending if p[0] != i)
                ready[i] = (path, e, why)
                bar.update(1)
                continue
            index_of[request.id] = (i, path, why, chunk)
        for res in engine.step() if engine.has_work() else []:
            i, path, why, chunk = index_of.pop(res.request_id)
            if local is not None and res.status not in ("error", "cancelled"):
                local.record(res.stats.as_dict(), res.stats.wall_s)
            if chunk is not None:
                if i not in chunked:  # another chunk of it failed to start: already reported
                    continue
                parts = chunked[i]
                parts["results"][chunk] = res
                if len(parts["results"]) < len(parts["offsets"]):
                    continue
                from structspec.services.chunks import combined

                res = combined(schema, [parts["results"][k] for k in range(len(parts["offsets"]))], parts["offsets"])
            ready[i] = (path, res, why)
            bar.update(1)
        while printed in ready:
            with tqdm.external_write_mode(file=sys.stderr):  # the bar steps aside for stderr lines
                path, res, why = ready.pop(printed)
                failed += not print_result(path, res, why, show_stats, show_spans, documents[printed][1], overlay)
            printed += 1
    return 1 if failed else 0


def _chunks_of(engine, schema: dict, text: str, max_tokens: int, path: str) -> list[tuple[int, int]] | CliError:
    """The chunk ranges of a document too long for the context (services/chunks.py), or the
    error that says why it cannot be chunked."""
    from structspec.services.chunks import chunk_ranges

    try:
        ranges = chunk_ranges(engine, schema, text, max_tokens)
    except ValueError as e:
        return CliError(f"too long for the model's context, and cannot be chunked: {e}")
    print(f"structspec: {path}: longer than the model's context: extracting it in {len(ranges)} chunks",
          file=sys.stderr, flush=True)
    return ranges


def print_result(path: str, res, why: str | None, show_stats: bool, show_spans: bool = False, doc=None,
                 overlay: Path | None = None) -> bool:
    """A result on stdout (or why not, on stderr); True when it succeeded. `show_spans`: the
    line is {"result", "spans", "confidence"}, and "boxes" (each span's page and box) when the
    document has pages; `overlay`: those boxes drawn on the pages, PNGs in that directory."""
    if isinstance(res, Exception):
        print(f"structspec: {path}: {res}", file=sys.stderr)
        return False
    if res.status == "succeeded":
        out = {"result": res.value, "spans": res.spans, "confidence": res.confidence} if show_spans else res.value
        if show_spans and getattr(res.stats, "chunks", 0):  # extracted in chunks (--chunking auto)
            out["chunks"] = res.stats.chunks
        if show_spans and doc is not None and doc.has_layout:
            out["boxes"] = doc.locate_spans(res.spans)
            if overlay is not None:
                from structspec.ingest.overlay import draw_boxes

                for png in draw_boxes(doc, out["boxes"], overlay, Path(path).stem):
                    print(f"structspec: {path}: overlay {png}", file=sys.stderr)
        print(json.dumps(out, ensure_ascii=False), flush=True)
    else:
        print(f"structspec: {path}: {res.status}: {res.error}", file=sys.stderr)
    if show_stats:
        st = {k: v for k, v in res.stats.as_dict().items() if not k.endswith("_by_position")}
        picked = {"selected_by": why} if why is not None else {}
        print(json.dumps({"document": path, "status": res.status, **st, **picked}), file=sys.stderr, flush=True)
    return res.status == "succeeded"


def open_local_stats(settings: Settings, schema: dict, path: str):
    """The local database's statistics for `schema`; a CliError naming the database if it fails."""
    from sqlalchemy.engine import make_url

    from structspec.client import schema_name
    from structspec.db.session import normalize_database_url
    from structspec.services.local import LocalStats
    from structspec.services.schemas import RegistryError

    try:  # registered as `cli.` + the name the client commands give the same file
        local = LocalStats(settings, schema, ("cli." + schema_name(path))[:200])
    except RegistryError as e:  # over a configured limit (max_schema_bytes, max_schema_depth, ...)
        problems = "; ".join(f"{p.path or '/'}: {p.message}" for p in e.problems)
        raise CliError(f"schema {path} cannot be registered for --strategy auto: {e.detail}"
                       + (f" ({problems})" if problems else "")) from None
    except Exception as e:  # an unreachable or unwritable database: say which, suggest the way out
        shown = make_url(normalize_database_url(settings.database_url)).render_as_string(hide_password=True)
        raise CliError(f"--strategy auto keeps statistics in {shown}, which failed: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                       f"(set STRUCTSPEC_DATABASE_URL, or pick a fixed --strategy)") from None
    print(f"structspec: strategy auto: statistics of schema {local.name} in the local database",
          file=sys.stderr, flush=True)
    return local


def cmd_migrate(args) -> int:
    from sqlalchemy.engine import make_url

    from structspec.db import migrate
    from structspec.db.session import normalize_database_url

    url = Settings.from_env().database_url
    shown = make_url(normalize_database_url(url)).render_as_string(hide_password=True)
    if args.action == "upgrade":
        migrate.upgrade(url, args.revision or "head")
    elif args.action == "downgrade":
        migrate.downgrade(url, args.revision or "-1")
    print(f"structspec: {shown} is at revision {migrate.current_revision(url) or 'base'} "
          f"(head {migrate.head_revision()})", file=sys.stderr)
    return 0


def cmd_keys(args) -> int:
    """API keys in STRUCTSPEC_DATABASE_URL (migrated to head first, as `serve` does)."""
    from structspec.db import migrate
    from structspec.db.session import make_engine, make_session_factory
    from structspec.services import keys

    settings = Settings.from_env()
    settings.ensure_data_dir()
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)
    try:
        if args.action == "create":
            try:
                record, key = keys.create_key(factory, args.name, args.tenant or args.name)
            except ValueError as e:
                raise CliError(str(e)) from None
            print(f"created key {record.id} ({record.name!r}, tenant {record.tenant!r}); it is shown only "
                  f"once and only its hash is stored. /v1 now needs `Authorization: Bearer <key>`. Key: {key}")
        elif args.action == "list":
            for k in keys.list_keys(factory):
                state = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "active"
                print(f"{k.id}  {k.prefix}...  tenant={k.tenant}  name={k.name!r}  {state}")
        else:
            record = keys.revoke_key(factory, args.key_id)
            if record is None:
                raise CliError(f"no API key with id {args.key_id!r} (see `structspec keys list`)")
            print(f"revoked key {record.id} ({record.name!r}, tenant {record.tenant!r})")
    finally:
        engine.dispose()
    return 0


def log_format(settings: Settings) -> str:
    from structspec.logs import make_formatter

    try:
        make_formatter(settings.log_format)
    except ValueError as e:
        raise CliError(str(e)) from None
    return settings.log_format


def cmd_serve(args) -> int:
    import uvicorn

    from structspec.db import migrate
    from structspec.logs import setup_logging

    settings = Settings.from_env(host=args.host, port=args.port)
    setup_logging(log_format(settings), logging.DEBUG if args.verbose else logging.INFO)
    if not args.no_migrate:
        migrate.upgrade(settings.database_url)  # a fresh clone serves without a manual migrate
    if args.reload:  # dev only: the reloaded process rebuilds Settings from the environment
        uvicorn.run("structspec.api.app:create_app_from_env", factory=True, reload=True,
                    host=settings.host, port=settings.port, log_config=None)
        return 0
    from structspec.api.app import create_app

    # log_config=None: uvicorn's loggers propagate to the root handler set up above (one format)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None)
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_worker(args) -> int:
    """Run a Celery worker on STRUCTSPEC_BROKER_URL. Threads pool (default): one process, one
    engine; task threads claim their message's jobs and hand them to the engine loop, so the
    jobs of `concurrency` messages decode together. Prefork pool: `concurrency` processes, each
    with its own engine fed one message at a time. SIGKILL takes a process and its jobs with
    it, and the lease/reaper machinery brings them back."""
    from celery.signals import setup_logging as celery_setup_logging

    from structspec.logs import setup_logging
    from structspec.worker.app import app
    from structspec.worker.tasks import prepare_model

    settings = app.structspec_settings
    setup_logging(log_format(settings), args.loglevel.upper())  # from the start: Celery's checks warn early

    @celery_setup_logging.connect(weak=False)
    def _logging(loglevel=None, **_):  # a receiver replaces Celery's own logging set-up
        setup_logging(settings.log_format, loglevel or logging.INFO)

    if args.queues == "ingest":
        return _run_readers(app, args, settings)
    if args.pool == "threads":
        # Enough messages in flight to keep the engine full even when each carries one job (single
        # POSTs); a batch's messages carry job_chunk_size jobs, which wait in the engine's queue.
        concurrency, processes = args.concurrency or settings.engine_max_seqs + 1, 0
    else:
        concurrency = processes = args.concurrency or 2
        if settings.device != "cpu" and _cuda_available():
            raise CliError("--pool prefork shares a model loaded before the fork, which CUDA cannot do; use the "
                           "threads pool (one worker per GPU) or STRUCTSPEC_DEVICE=cpu")
    try:  # before connecting to the broker: a worker without a model takes no job
        prepare_model(settings, processes)
    except Exception as e:
        raise CliError(f"worker cannot load model {settings.model!r}: {' '.join(str(e).split())[:1000]}; "
                       "not consuming jobs (they stay queued)") from e
    if args.queues == "all":
        _start_reader_process(args)
    # --quiet: no start-up banner on stdout (it is not a log line, and not JSON)
    quiet = ["--quiet"] if settings.log_format == "json" else []  # a `celery` option, before `worker`
    argv = [*quiet, "worker", f"--pool={args.pool}", f"--concurrency={concurrency}",
            f"--queues={settings.job_queue}", f"--loglevel={args.loglevel}",
            "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if args.hostname:
        argv.append(f"--hostname={args.hostname}")
    app.worker_main(argv)
    return 0


def _run_readers(app, args, settings: Settings) -> int:
    """A worker that only reads files (the ingest queue): no model, `--readers` task threads,
    each read in a child process of its own (structspec.ingest.read_isolated)."""
    from structspec.worker.tasks import PROCESS

    PROCESS.reads_only = True  # its worker_ready hook then builds no engine
    readers = args.readers or os.cpu_count() or 1
    quiet = ["--quiet"] if settings.log_format == "json" else []
    argv = [*quiet, "worker", "--pool=threads", f"--concurrency={readers}", f"--queues={settings.ingest_queue}",
            f"--loglevel={args.loglevel}", "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if args.hostname:
        argv.append(f"--hostname=reader-{args.hostname}")
    app.worker_main(argv)
    return 0


def _start_reader_process(args) -> None:
    """`--queues all`: the files are read by a second worker process, started here with this
    one's arguments and stopped with it (it gets SIGTERM when this process exits, however it
    exits), so OCR never takes the model's task threads."""
    import atexit
    import signal
    import subprocess

    def die_with_parent() -> None:  # Linux: PR_SET_PDEATHSIG
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
        except OSError:
            pass

    command = [sys.executable, "-m", "structspec.cli", "worker", "--queues", "ingest", "--loglevel", args.loglevel]
    if args.readers:
        command += ["--readers", str(args.readers)]
    if args.hostname:
        command += ["--hostname", args.hostname]
    child = subprocess.Popen(command, preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
    atexit.register(lambda: child.poll() is None and child.terminate())


def client_options(args) -> dict:
    """The job options given on the command line (the server's defaults fill the rest)."""
    given = {n: getattr(args, n) for n in OPTION_NAMES if n != "verbatim" and getattr(args, n) is not None}
    return {**given, "verbatim": True} if args.verbatim else given


def open_client(args):
    """The client of `structspec submit` / `batch`, from --server, --api-key and --retries."""
    from structspec.client import Client

    return Client(args.server, api_key=args.api_key or os.environ.get("STRUCTSPEC_API_KEY"), retries=args.retries)


def run_client(args, work) -> int:
    from structspec.client import ClientError

    schema = read_json_file(args.schema, "schema")
    try:
        with open_client(args) as client:
            registered = client.register(args.schema, schema)
            print(f"structspec: schema {registered['name']} v{registered['version']} ({registered['id']})",
                  file=sys.stderr, flush=True)
            return work(client, str(registered["id"]))
    except ClientError as e:
        raise CliError(str(e)) from None


def cmd_submit(args) -> int:
    from structspec.client import submit

    documents = [(p, read_document(p)) for p in args.documents]
    return run_client(args, lambda client, sid: submit(client, sid, documents, client_options(args), args.stats))


def cmd_batch(args) -> int:
    from structspec.client import ClientError, attach, batch

    if args.attach:
        if args.file or args.schema:
            raise CliError("--attach waits for a batch already submitted: give no FILE and no --schema")
        try:
            with open_client(args) as client:
                return 0 if attach(client, args.attach) == "succeeded" else 1
        except ClientError as e:
            raise CliError(str(e)) from None
    if not args.file or not args.schema:
        raise CliError("give --schema and an NDJSON FILE (or --attach BATCH_ID)")
    try:
        ndjson = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as e:
        raise CliError(f"cannot read {args.file}: {e.strerror}") from None
    params = {**client_options(args), **({"webhook_url": args.webhook_url} if args.webhook_url else {})}
    return run_client(args, lambda client, sid: batch(client, sid, ndjson, params))


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def add_client_args(p: argparse.ArgumentParser, defaults: Settings, schema_required: bool = True) -> None:
    p.add_argument("--schema", required=schema_required, help="JSON Schema file (registered under its file name)")
    p.add_argument("--server", default=f"http://{defaults.host}:{defaults.port}",
                   help="base URL of `structspec serve` (default %(default)s)")
    p.add_argument("--api-key", metavar="KEY", help="API key (`structspec keys create`) [env STRUCTSPEC_API_KEY]")
    p.add_argument("--retries", type=_non_negative, default=4, metavar="N",
                   help="send a request again up to N times after a connection error, 429, 502, 503 or 504 "
                        "(submissions carry an Idempotency-Key, so none runs twice; default %(default)s)")
    server = "default: the server's"
    p.add_argument("--strategy", choices=SPECS["strategy"].choices, help=option_help("strategy", server))
    p.add_argument("--draft-len", type=int, metavar="K", help=option_help("draft_len"))
    p.add_argument("--temperature", type=float, metavar="T", help=option_help("temperature", server))
    p.add_argument("--seed", type=int, metavar="S", help=option_help("seed"))
    p.add_argument("--max-tokens", type=int, metavar="N", help=option_help("max_tokens", server))
    p.add_argument("--verbatim", action="store_true", help=option_help("verbatim"))
    p.add_argument("--chunking", choices=SPECS["chunking"].choices, help=option_help("chunking", server))
    p.add_argument(FLAGS["timeout_s"], type=int, dest="timeout_s", metavar="S", help=option_help("timeout_s", server))


def cmd_demo(args) -> int:
    from structspec.demo import run_demo

    return run_demo(args)


def add_extract_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("extract", help="extract JSON from documents with a schema",
                       description="Print one JSON value per document on stdout (results that are not "
                                   "a complete, schema-valid value go to stderr and make the exit status 1). "
                                   "With --stats, a JSON line on the engine (model, dtype and why), then one of decoding statistics per document, go to stderr.")
    p.add_argument("--schema", required=True, help="JSON Schema file")
    p.add_argument("documents", nargs="+", metavar="DOC",
                   help="text files, PDFs or images (PNG, JPEG, TIFF: read by OCR, as are PDF pages without "
                        "a text layer), told apart by their first bytes ('-' for stdin)")
    p.add_argument("--stats", action="store_true", help="print decoding statistics per document to stderr")
    p.add_argument("--spans", action="store_true",
                   help='print {"result", "spans", "confidence"} per document: where each string of the result '
                        "occurs in the document, and the model's token probabilities per value (by JSON Pointer); "
                        'for a PDF or an image also "boxes": each span\'s page and box ([x0, y0, x1, y1] from the '
                        "page's top-left corner, in points for a PDF, pixels for an image; one box per line the "
                        "value covers)")
    p.add_argument("--overlay", type=Path, metavar="DIR",
                   help="with --spans: draw each PDF's or image's boxes on its pages, one PNG per page in DIR")
    p.add_argument("--chunking", choices=SPECS["chunking"].choices, default="off",
                   help="auto: a document longer than the model's context is split into overlapping chunks at "
                        "paragraph and line boundaries, extracted together and merged by the schema (objects field "
                        "by field, arrays without repeats, scalars by confidence); off: it fails naming both token "
                        "counts [default: %(default)s]")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar of finished documents on stderr (default: on when stderr is a terminal "
                        "and there are several documents)")
    p.add_argument("--messages", action="store_true",
                   help="each DOC is a JSON file of chat messages ([{role, content}], or an OpenAI chat request "
                        "body): the prompt is them through the model's chat template, as on the OpenAI-compatible "
                        "surface, not the extraction prompt")
    add_decode_args(p, defaults)
    add_model_args(p)
    p.set_defaults(func=cmd_extract)


def add_serve_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("serve", help="run the HTTP API (migrates the database to head first)",
                       description="Serve the REST API with uvicorn. Applies pending migrations first "
                                   "(`structspec migrate upgrade head`), so a fresh checkout works with the "
                                   "SQLite + embedded-broker defaults in STRUCTSPEC_DATA_DIR.")
    p.add_argument("--host", default=defaults.host, help="[env STRUCTSPEC_HOST]")
    p.add_argument("--port", type=int, default=defaults.port, help="[env STRUCTSPEC_PORT]")
    p.add_argument("--reload", action="store_true", help="restart on code changes (development)")
    p.add_argument("--no-migrate", action="store_true", help="do not apply migrations first")
    p.set_defaults(func=cmd_serve)


def add_keys_command(sub, defaults: Settings) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys",
                          description="API keys for the /v1 routes (structspec/services/keys.py). Once one "
                                      "active key exists every /v1 request needs `Authorization: Bearer "
                                      "<key>` and sees only its tenant's schemas, jobs and batches.")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    p = keys_sub.add_parser("create", help="a new key; prints it once, as the last word of the output")
    p.add_argument("--name", required=True, help="what the key is for (shown by `keys list`)")
    p.add_argument("--tenant", help="the tenant whose data the key sees (default: the name; "
                                    "'default' is the data created while auth was off)")
    p = keys_sub.add_parser("list", help="every key: id, prefix, tenant, name, active or revoked")
    p = keys_sub.add_parser("revoke", help="revoke a key by id (it stops working at once)")
    p.add_argument("key_id", metavar="ID")
    keys.set_defaults(func=cmd_keys)


def add_migrate_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("migrate", help="apply or revert database migrations (Alembic)",
                       description="Migrate the database at STRUCTSPEC_DATABASE_URL (default: SQLite in "
                                   "STRUCTSPEC_DATA_DIR). Default: upgrade head; downgrade defaults to -1.")
    p.add_argument("action", nargs="?", choices=["upgrade", "downgrade", "current"], default="upgrade")
    p.add_argument("revision", nargs="?", metavar="REV", help="target revision: head, base, 0001, -1, +1 ...")
    p.set_defaults(func=cmd_migrate)


def add_worker_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("worker", help="run an extraction worker (Celery) on STRUCTSPEC_BROKER_URL",
                       description="Consume extraction jobs from the broker, load the model once per process, "
                                   "store results in STRUCTSPEC_DATABASE_URL. Also re-queues jobs whose worker "
                                   "died (lease expired), at start and every job_lease_s/2 seconds. Exits with "
                                   f"status {EXIT_ENGINE_HUNG} when its engine makes no progress for STRUCTSPEC_ENGINE_WATCHDOG_S "
                                   "seconds while it holds work (a supervisor restarts it; its jobs run again).")
    p.add_argument("--pool", choices=("threads", "prefork"), default="threads",
                   help="threads: one process whose task threads feed one engine (default); prefork: "
                        "--concurrency processes, each with an engine fed one message at a time (CPU only)")
    p.add_argument("--concurrency", "-c", type=int, default=0,
                   help="threads pool: messages run at once by task threads feeding the one engine (default: "
                        "STRUCTSPEC_ENGINE_MAX_SEQS + 1, enough to keep it full with one job per message); "
                        "prefork pool: processes (default 2)")
    p.add_argument("--queues", choices=("all", "model", "ingest"), default="all",
                   help="model: extraction jobs (STRUCTSPEC_JOB_QUEUE; loads the model); ingest: reading files (PDF "
                        "text layers, rendering, OCR; STRUCTSPEC_INGEST_QUEUE; no model); all (default): both, the "
                        "files read by a second process this one starts and stops")
    p.add_argument("--readers", type=int, default=0,
                   help="files read at once (each in a child process of its own; default: one per CPU core)")
    p.add_argument("--loglevel", default="INFO")
    p.add_argument("--hostname", help="Celery node name (default celery@HOST)")
    p.set_defaults(func=cmd_worker)


def add_submit_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("submit", help="send documents to a running server, one job each, and wait",
                       description="Register --schema on the server, submit one extraction job per document, "
                                   "show progress until all are finished, and print one JSON value per "
                                   "succeeded document (failures on stderr, exit status 1).")
    p.add_argument("documents", nargs="+", metavar="DOC", help="text files ('-' for stdin)")
    p.add_argument("--stats", action="store_true", help="print each job's statistics to stderr")
    add_client_args(p, defaults)
    p.set_defaults(func=cmd_submit)


def add_batch_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("batch", help="send an NDJSON file to a running server as one batch, and wait",
                       description="Register --schema on the server, upload FILE (one {\"id\"?, \"document\"} "
                                   "per line) as a batch, show progress until it is finished, and print the "
                                   "NDJSON results in input order. Rejected lines are reported on stderr.")
    p.add_argument("file", metavar="FILE.ndjson", nargs="?", help="NDJSON documents ('-' for stdin)")
    add_client_args(p, defaults, schema_required=False)
    p.add_argument("--attach", metavar="BATCH_ID",
                   help="wait for a batch submitted earlier (its id is printed at submission) and print its results")
    p.add_argument("--webhook-url", metavar="URL",
                   help="the server's workers POST the batch here once it has finished (the host must be in the "
                        "server's STRUCTSPEC_WEBHOOK_HOSTS)")
    p.set_defaults(func=cmd_batch)


def add_demo_command(sub, defaults: Settings) -> None:
    p = sub.add_parser("demo", help="end to end: API + worker on the embedded defaults, a batch of e-mails",
                       description="Start the API server and one worker as subprocesses (SQLite + embedded "
                                   "broker in a temporary directory unless --data-dir), register "
                                   "schemas/contact.json, submit examples/contact-*.txt as a batch, print "
                                   "the NDJSON results (with source spans and confidence), extract a PDF and "
                                   "a scan, mark each value right or wrong against examples/*.expected.json "
                                   "with a score per document and overall, and shut everything down.")
    p.add_argument("--data-dir", help="keep the database and broker here (default: a temporary directory)")
    p.add_argument("--port", type=int, default=0, help="API port (default: a free one)")
    p.add_argument("--timeout", type=float, default=900, help="give up after this many seconds")
    p.add_argument("--model", help="the model the worker and `structspec extract` load (default: SmolLM2-135M-"
                                   "Instruct, which gets many values wrong) [env STRUCTSPEC_MODEL]")
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings.from_env()
    parser = argparse.ArgumentParser(prog="structspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    add_extract_command(sub, defaults)
    add_serve_command(sub, defaults)
    add_keys_command(sub, defaults)
    add_migrate_command(sub, defaults)
    add_worker_command(sub, defaults)
    add_submit_command(sub, defaults)
    add_batch_command(sub, defaults)
    add_demo_command(sub, defaults)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # reads the environment for its defaults
    except SettingsError as e:
        print(f"structspec: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (CliError, SettingsError) as e:
        parser.exit(2, f"structspec: error: {e}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
