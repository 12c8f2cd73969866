"""The HTTP layer's logic behind the controllers: plain classes, no Litestar request objects,
so tests can call them. They raise structspec.api.errors.ApiError. What the CLI and the worker
share with them (the schema registry, `auto` resolution) is one layer down, in
structspec/services."""
