"""Operations the API, the CLI and the worker share, below all three.

schemas.py   the schema registry: check, store, deduplicate and version schemas per tenant
schemacheck.py  a schema's registration check in a child process, killed at its time limit
strategy.py  a job's `strategy: auto` made concrete from its schema's statistics (pin, else selector)
local.py     the same statistics for `structspec extract` without a server or worker
keys.py      API keys: create, list, revoke (`structspec keys`), and a key's tenant (the API's auth)
batches.py   a batch as clients see it (counts, status, webhook): the API's answer and the webhook's body
webhooks.py  which URLs a batch webhook may call (checked by the API, again by the worker)

They compose db/ (storage), grammar/ (what a schema may contain) and stats/ (pure statistics),
and never import the HTTP layer, the CLI or the worker (tests/unit/test_layering.py). Bad
input raises a `RegistryError`, which names the problem; the API turns it into a 404, 413 or
422 (structspec/api/errors.py) and the CLI prints it.
"""
