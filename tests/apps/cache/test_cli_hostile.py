"""``kvtier cache`` against hostile or broken servers (real sockets on loopback, the CLI in its own process):
whatever the server does, the command ends by its --timeout, reads at most its byte cap, and says what went wrong
in one line on stderr with a non-zero exit code; never a traceback, never exit 0 on an answer that is not the
admin API's."""

from __future__ import annotations

import json

import pytest

from tests.apps.cache.cli_run import kvtier_cache
from tests.apps.cache.hostile_http import HostileServer, answer, drip, endless, hang

GIB = 1 << 30
DEEP = b"[" * 100_000 + b"]" * 100_000


def stats(server: HostileServer, *extra: str):
    return kvtier_cache("stats", "--url", server.url, *extra)


def one_line_failure(ran, *words: str) -> str:
    assert ran.code == 1, (ran.code, ran.out, ran.err)
    assert "Traceback" not in ran.err and ran.out == "", ran
    assert len(ran.err_lines) == 1, ran.err
    line = ran.err_lines[0]
    assert line.startswith("kvtier cache: ") and all(w in line for w in words), line
    return line


@pytest.mark.parametrize("behaviour", [endless(declared=None), endless(declared=GIB)], ids=["undeclared", "declared"])
def test_a_1_gib_answer_is_cut_at_the_cap_not_buffered(behaviour):
    with HostileServer(behaviour) as server:
        ran = stats(server)
    one_line_failure(ran, "bytes")
    assert ran.max_rss_mib < 300, f"kvtier cache grew to {ran.max_rss_mib:.0f} MiB reading a hostile answer"


@pytest.mark.parametrize("behaviour", [drip(0.2), hang], ids=["dripping", "hung"])
def test_an_answer_that_never_ends_ends_at_the_timeout(behaviour):
    with HostileServer(behaviour) as server:
        ran = stats(server, "--timeout", "3")
    one_line_failure(ran, "no complete answer within 3 s")


def test_the_timeout_may_be_given_before_the_operation():
    with HostileServer(hang) as server:
        ran = kvtier_cache("--url", server.url, "--timeout", "2", "stats")
    one_line_failure(ran, "within 2 s")


@pytest.mark.parametrize("status", ["500 Internal Server Error", "403 Forbidden", "200 OK"])
def test_an_error_answer_is_one_line_with_its_message(status):
    with HostileServer(answer(status, json.dumps({"error": "boom\nsecond line"}).encode())) as server:
        ran = stats(server)
    line = one_line_failure(ran, "boom second line")
    assert line.startswith(f"kvtier cache: {status.split()[0]}: ")


def test_an_openai_error_envelope_gives_its_message():
    body = json.dumps({"error": {"message": "this admin call needs the admin key", "code": 403}}).encode()
    with HostileServer(answer("403 Forbidden", body)) as server:
        one_line_failure(stats(server), "403: this admin call needs the admin key")


@pytest.mark.parametrize("status", ["200 OK", "500 Internal Server Error"])
@pytest.mark.parametrize("body", [DEEP, b'{"error": ' + DEEP + b"}"], ids=["deep", "deep-error"])
def test_deep_nesting_is_not_json_to_the_cli(status, body):
    with HostileServer(answer(status, body)) as server:
        one_line_failure(stats(server), "not JSON")


def test_a_200_html_page_is_a_failure_not_a_success():
    page = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
    with HostileServer(answer("200 OK", page, "text/html; charset=utf-8")) as server:
        one_line_failure(stats(server), "200", "not JSON", "text/html")


@pytest.mark.parametrize("body", [b"[1, 2, 3]", b'"ok"', b"42"])
def test_json_that_is_not_an_object_is_a_failure(body):
    with HostileServer(answer("200 OK", body)) as server:
        one_line_failure(stats(server), "not an object")


def test_a_success_answer_is_printed_and_exits_0():
    with HostileServer(answer("200 OK", b'{"model": "m", "tiers": {}}')) as server:
        ran = stats(server)
    assert ran.code == 0 and ran.err == "" and json.loads(ran.out) == {"model": "m", "tiers": {}}
