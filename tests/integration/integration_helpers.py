"""Assertions shared by the integration tests (importable by name: pytest puts this
directory on sys.path)."""

from __future__ import annotations

ERROR_KEYS = {"status_code", "detail", "errors"}
ERROR_ITEM_KEYS = {"path", "keyword", "message", "source"}


def assert_error(response, status: int) -> dict:
    """The response is `status` with exactly the API's error shape; returns the body."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == ERROR_KEYS, body
    assert body["status_code"] == status
    assert isinstance(body["detail"], str) and body["detail"]
    assert isinstance(body["errors"], list)
    for item in body["errors"]:
        assert set(item) == ERROR_ITEM_KEYS, item
        assert isinstance(item["message"], str) and item["message"]
    assert "Traceback" not in response.text and 'File "' not in response.text
    return body
