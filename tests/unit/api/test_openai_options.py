"""Job options on the OpenAI-compatible surface (structspec/api/services/openai.py job_options):
OpenAI's parameters, and structspec's own in the extension field `structspec`."""

from __future__ import annotations

import pytest

from structspec.api.errors import ApiError
from structspec.api.services.openai import check_request, job_options


def test_the_structspec_extension_field_carries_timeout_s():
    body = check_request({"model": "m", "messages": [], "structspec": {"timeout_s": 30}, "max_tokens": 64})
    opts = job_options(body)
    assert (opts.timeout_s, opts.max_tokens) == (30, 64)
    assert job_options({}).timeout_s is None  # the server's default
    assert job_options({"structspec": {}}).timeout_s is None


@pytest.mark.parametrize("extension, message, param", [
    (5, "structspec must be an object holding only timeout_s", "structspec"),
    ({"timeout": 5}, "structspec must be an object holding only timeout_s", "structspec"),
    ({"timeout_s": "5"}, "structspec.timeout_s must be a number", "structspec.timeout_s"),
    ({"timeout_s": True}, "structspec.timeout_s must be a number", "structspec.timeout_s"),
])
def test_a_bad_extension_field_is_400_naming_it(extension, message, param):
    with pytest.raises(ApiError) as e:
        job_options({"structspec": extension})
    assert (e.value.status_code, e.value.detail, e.value.errors[0].path) == (400, message, param)
