"""The admin API of a real server over HTTP (uvicorn on a loopback port, a tiny Llama): who may call what,
lookup after a request, a tenant's clear leaves the others, pins and their budget, bad input changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvtier.tiers.control import MAX_TTL_S
from tests.apps.serve.conftest import LiveServer

ADMIN, ALICE, BOB = "admin-secret", "alice-key", "bob-key"
PROMPT = "the cache keeps a prefix of every prompt so the server answers faster " * 4


def start(model_dir, *, admin_key: str | None = ADMIN, pin_budget: str = "1MiB") -> LiveServer:
    from kvtier.api.tenants import tenant_salt
    from kvtier.apps.serve.backend import Backend, ServerConfig
    from kvtier.core.config import CacheConfig

    cache = CacheConfig.from_dict({"chunk_size": 16, "tenants": {"bob": tenant_salt(BOB).hex()}, "tiers": [
        {"kind": "memory", "capacity_bytes": "32MiB", "prefault": False, "pin_budget_bytes": pin_budget}]})
    config = ServerConfig(model_path=model_dir, served_name="tiny", cache=cache, default_max_tokens=4,
                          admin_key=admin_key)
    return LiveServer(Backend.from_config(config))


@pytest.fixture(scope="module")
def live(tiny_model_dir) -> Iterator[LiveServer]:
    with start(tiny_model_dir) as server:
        yield server


@pytest.fixture
def client(live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60) as c:
        yield c


def as_(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def complete(client: httpx.Client, key: str, prompt: str = PROMPT) -> None:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, headers=as_(key))
    assert r.status_code == 200, r.text


def lookup(client: httpx.Client, key: str, prompt: str = PROMPT, **extra) -> httpx.Response:
    return client.post("/admin/v1/lookup", json={"text": prompt, **extra}, headers=as_(key))


def cached(client: httpx.Client, key: str, prompt: str = PROMPT, **extra) -> int:
    r = lookup(client, key, prompt, **extra)
    assert r.status_code == 200, r.text
    return r.json()["cached_tokens"]


CALLS = [("post", "/admin/v1/lookup", {"text": PROMPT}), ("post", "/admin/v1/pin", {"text": PROMPT}),
         ("post", "/admin/v1/unpin", {"text": PROMPT}), ("post", "/admin/v1/clear", {"scope": "all"}),
         ("get", "/admin/v1/stats", None)]
#: what a tenant key gets from each call of CALLS
TENANT_STATUS = {"/admin/v1/lookup": 200, "/admin/v1/pin": 403, "/admin/v1/unpin": 403, "/admin/v1/clear": 403,
                 "/admin/v1/stats": 403}


@pytest.mark.parametrize("method,path,body", CALLS)
def test_auth_matrix(client, method, path, body):
    def call(headers: dict[str, str]) -> httpx.Response:
        return client.request(method, path, json=body, headers=headers)

    assert call({}).status_code == 401
    assert call({"Authorization": "Basic xyz"}).status_code == 401
    assert call(as_(ALICE)).status_code == TENANT_STATUS[path]
    assert call(as_(ADMIN)).status_code == 200


def lookups_counted(client: httpx.Client) -> str:
    return "\n".join(line for line in client.get("/metrics").text.splitlines()
                     if line.startswith(("kvtier_lookups_total", "kvtier_lookup_tokens_total")))


def test_lookup_after_a_request_is_per_tenant_and_per_tier(client):
    complete(client, ALICE)
    before = lookups_counted(client)
    answer = lookup(client, ALICE).json()
    assert lookups_counted(client) == before  # an operator's look is no request: no lookup metrics
    assert answer["cached_tokens"] > 0 and answer["tiers"]["memory"] == answer["cached_tokens"]
    assert answer["prompt_tokens"] >= answer["cached_tokens"] and answer["model"] == "tiny"
    assert cached(client, BOB) == 0  # bob's salt names other keys
    ids = client.post("/admin/v1/lookup", json={"tokens": [1, 2, 3]}, headers=as_(ALICE))
    assert ids.status_code == 200 and ids.json()["cached_tokens"] == 0
    assert cached(client, ADMIN) == 0  # the admin looks at the default tenant unless it names one


def test_a_tenants_clear_leaves_the_other_tenants_entries(client):
    complete(client, ALICE)
    complete(client, BOB)
    assert cached(client, ALICE) > 0 and cached(client, BOB) > 0
    r = client.post("/admin/v1/clear", json={}, headers=as_(ALICE))  # scope tenant: alice's own
    assert r.status_code == 200 and r.json()["removed"]["memory"] > 0
    assert cached(client, ALICE) == 0
    assert cached(client, BOB) > 0
    assert cached(client, ADMIN, tenant="bob") > 0  # the admin names bob by his configured name
    r = client.post("/admin/v1/clear", json={"tenant": "bob"}, headers=as_(ADMIN))
    assert r.status_code == 200 and cached(client, BOB) == 0


def test_a_tenant_key_cannot_reach_other_tenants(client):
    complete(client, BOB)
    for body in ({"tenant": "bob"}, {"scope": "model"}, {"scope": "all"}):
        assert client.post("/admin/v1/clear", json=body, headers=as_(ALICE)).status_code == 403
    assert lookup(client, ALICE, tenant="bob").status_code == 403
    assert cached(client, BOB) > 0


def test_pin_unpin_and_stats(client, live):
    complete(client, ALICE)
    pinned = client.post("/admin/v1/pin", json={"text": PROMPT}, headers=as_(ADMIN))
    assert pinned.status_code == 200 and pinned.json()["tiers"] == {"memory": 0}  # the default tenant holds none
    complete(client, "")  # no key: the default tenant
    pinned = client.post("/admin/v1/pin", json={"text": PROMPT}, headers=as_(ADMIN)).json()["tiers"]
    assert pinned["memory"] == cached(client, ADMIN) > 0
    stats = client.get("/admin/v1/stats", headers=as_(ADMIN)).json()
    assert stats["tiers"]["memory"]["pinned_bytes"] > 0
    assert stats["admission"]["memory"]["policy"] == "always"
    assert "pin" in stats["features"]["memory"]
    released = client.post("/admin/v1/unpin", json={"text": PROMPT}, headers=as_(ADMIN)).json()["tiers"]
    assert released["memory"] > 0
    assert client.get("/admin/v1/stats", headers=as_(ADMIN)).json()["tiers"]["memory"]["pinned_bytes"] == 0


BAD = [("/admin/v1/lookup", b"{not json", 400), ("/admin/v1/lookup", b"[1, 2]", 400),
       ("/admin/v1/lookup", b'{"text": "x", "tokens": [1]}', 400), ("/admin/v1/lookup", b"{}", 400),
       ("/admin/v1/lookup", b'{"text": "x", "colour": "red"}', 400), ("/admin/v1/lookup", b'{"tokens": ["1"]}', 400),
       ("/admin/v1/lookup", b'{"tokens": [-1]}', 400), ("/admin/v1/lookup", b'{"tokens": [99999999]}', 400),
       ("/admin/v1/lookup", b'{"text": "x", "tenant": "mallory"}', 404),
       ("/admin/v1/pin", b'{"text": "x", "tiers": ["tape"]}', 400),
       ("/admin/v1/pin", b'{"text": "x", "tiers": "memory"}', 400),
       ("/admin/v1/clear", b'{"scope": "everything"}', 400), ("/admin/v1/clear", b'{"tenant": "mallory"}', 404),
       ("/admin/v1/clear", b'{"scope": "all", "tenant": "bob"}', 400),
       ("/admin/v1/lookup", b'{"text": "x", "messages": [{"role": "user", "content": "x"}]}', 400),
       ("/admin/v1/lookup", b'{"messages": []}', 400),
       ("/admin/v1/lookup", b'{"messages": [{"role": "robot", "content": "x"}]}', 400),
       ("/admin/v1/lookup", b'{"messages": [{"role": "user", "content": 3}]}', 400),
       ("/admin/v1/pin", b'{"text": "x", "add_generation_prompt": true}', 400),
       ("/admin/v1/pin", b'{"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1}', 400)]


@pytest.mark.parametrize("path,raw,status", BAD)
def test_bad_input_is_a_4xx_and_changes_nothing(client, path, raw, status):
    complete(client, BOB)
    before = client.get("/admin/v1/stats", headers=as_(ADMIN)).json()["tiers"]
    r = client.post(path, content=raw, headers={**as_(ADMIN), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == status
    assert client.get("/admin/v1/stats", headers=as_(ADMIN)).json()["tiers"] == before
    assert cached(client, BOB) > 0


def test_a_pin_past_the_budget_is_a_409_and_pins_nothing(tiny_model_dir):
    with start(tiny_model_dir, pin_budget="1KiB") as server, httpx.Client(base_url=server.url, timeout=60) as c:
        complete(c, "")
        r = c.post("/admin/v1/pin", json={"text": PROMPT}, headers=as_(ADMIN))
        assert r.status_code == 409, r.text
        assert c.get("/admin/v1/stats", headers=as_(ADMIN)).json()["tiers"]["memory"]["pinned_bytes"] == 0


def test_without_an_admin_key_no_key_is_admin(tiny_model_dir):
    with start(tiny_model_dir, admin_key=None) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/admin/v1/stats", headers=as_(ADMIN)).status_code == 403
        assert c.post("/admin/v1/pin", json={"text": PROMPT}, headers=as_(ADMIN)).status_code == 403
        assert lookup(c, ALICE).status_code == 200  # a tenant still looks at its own entries


def test_openapi_describes_every_admin_route(client, live):
    doc = client.get("/admin/v1/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    served = {(m.lower(), r.path) for r in live.server.config.app.routes if r.path.startswith("/admin/v1/")
              for m in getattr(r, "methods", ()) if m != "HEAD"}
    described = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert served == described
    schemas = doc["components"]["schemas"]
    assert {"LookupBody", "PinBody", "ClearBody"} <= set(schemas)
    assert sorted(schemas["ClearBody"]["properties"]["scope"]["enum"]) == ["all", "model", "tenant"]
    pin = doc["paths"]["/admin/v1/pin"]["post"]
    assert pin["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/PinBody")


@pytest.mark.parametrize("ttl", [b"-1", b'"3600"', b"1e999", b"1e308", b"%d" % (MAX_TTL_S + 1), b"null"])
def test_a_bad_cache_ttl_is_a_400_that_stores_nothing(client, ttl):
    prompt = "rivers music weather " + PROMPT
    raw = b'{"model": "tiny", "max_tokens": 2, "prompt": "%s", "cache_ttl_s": %s}' % (prompt.encode(), ttl)
    r = client.post("/v1/completions", content=raw, headers={**as_(ALICE), "Content-Type": "application/json"})
    if ttl == b"null":  # no retention time: allowed
        assert r.status_code == 200, r.text
        assert cached(client, ALICE, prompt) > 0
        client.post("/admin/v1/clear", json={}, headers=as_(ALICE))
        return
    assert r.status_code == 400, r.text
    assert cached(client, ALICE, prompt) == 0


def test_a_cache_ttl_stores_with_a_retention_time(client):
    prompt = "music science cities " + PROMPT
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "cache_ttl_s": 3600},
                    headers=as_(ALICE))
    assert r.status_code == 200, r.text
    assert cached(client, ALICE, prompt) > 0


def test_messages_address_what_the_chat_route_renders(client):
    """A chat's prompt as the chat route tokenizes it: after a chat request, its messages look up its cached
    prefix; the system turn alone (no assistant's cue) is the prefix a later turn shares."""
    system = {"role": "system", "content": "science weather and cities " * 8}
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": [
        system, {"role": "user", "content": "rivers and music"}]})  # no key: the default tenant
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    whole = client.post("/admin/v1/lookup", json={"messages": [system, {"role": "user", "content": "rivers and music"}]},
                        headers=as_(ADMIN)).json()
    assert whole["prompt_tokens"] == prompt_tokens and whole["cached_tokens"] == prompt_tokens // 16 * 16 > 0
    alone = client.post("/admin/v1/lookup", json={"messages": [system]}, headers=as_(ADMIN)).json()
    cued = client.post("/admin/v1/lookup", json={"messages": [system], "add_generation_prompt": True},
                       headers=as_(ADMIN)).json()
    assert cued["prompt_tokens"] > alone["prompt_tokens"]  # the cue "<|im_start|>assistant\n"
    assert 0 < alone["cached_tokens"] == alone["prompt_tokens"] // 16 * 16
    as_text = client.post("/admin/v1/lookup", json={"text": system["content"]}, headers=as_(ADMIN)).json()
    assert as_text["cached_tokens"] == 0  # the chat's tokens start with the template's, not the text's
