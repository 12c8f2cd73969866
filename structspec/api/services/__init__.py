"""Business logic behind the controllers: plain classes, no Litestar request objects, so they
can be called from tests, the CLI or a worker. They raise structspec.api.errors.ApiError."""
