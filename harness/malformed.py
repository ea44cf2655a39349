"""Malformed JSON bodies an OpenAI-compatible server must answer with a 400 that says so (kvtier serve does, and
the router passes them on): huge numbers, deep nesting, lone surrogates, NaN. Each a pytest param ``(path, body)``
with an id; the serve and router tests parametrize over them and the hostile-fleet benchmark sends them."""

from __future__ import annotations

import pytest

MALFORMED_JSON = [
    pytest.param("/v1/completions", b'{"prompt": "the", "max_tokens": ' + b"9" * 5000 + b"}", id="5000-digit-int"),
    pytest.param("/v1/completions", b'{"prompt": [' + b"7" * 5000 + b"]}", id="5000-digit-token-id"),
    pytest.param("/v1/completions", b"[" * 100_000 + b"]" * 100_000, id="nested-100000-deep"),
    pytest.param("/v1/chat/completions", b'{"messages": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
                 id="objects-nested-50000-deep"),
    pytest.param("/v1/completions", b'{"prompt": "the \\ud800 cache"}', id="lone-surrogate-prompt"),
    pytest.param("/v1/completions", b'{"prompt": "the cache \\udc00"}', id="lone-low-surrogate-prompt"),
    pytest.param("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                 id="lone-surrogate-chat"),
    pytest.param("/v1/completions", b'{"prompt": "the", "max_tokens": NaN}', id="nan"),
    pytest.param("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', id="surrogate-as-utf8-bytes"),
]
