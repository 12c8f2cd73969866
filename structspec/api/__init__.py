"""HTTP API: Litestar app (app.create_app), one controller per resource, logic in services/,
msgspec structs in and out (structs.py), one error shape (errors.py)."""
