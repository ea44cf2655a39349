"""The Redis tier's configuration (environment, YAML, the docs page's examples, bad values), import without
redis-py, and connecting with an ACL user or over TLS to a real redis-server."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from kvtier import CacheConfig, ConfigError
from kvtier.net.ports import free_port
from kvtier.tiers import RedisTier, RedisTierConfig
from tests.conformance.tier_suite import tier_context
from harness.redis_server import RedisServer
from tests.tiers.test_redis import make_cache, prompt


# -- configuration ---------------------------------------------------------------------------------------------
def test_config_from_env_and_yaml(tmp_path):
    env = {"KVTIER_TIERS": "memory,redis", "KVTIER_REDIS_URL": "rediss://kv:s3cret@cache.internal:6380/2",
           "KVTIER_REDIS_TTL_S": "3600", "KVTIER_REDIS_MAX_PART_BYTES": "4MiB", "KVTIER_REDIS_CLUSTER": "no",
           "KVTIER_REDIS_TLS_CA_FILE": "/etc/ssl/ca.pem", "KVTIER_REDIS_PASSWORD": "other"}
    config = CacheConfig.from_env(env)
    redis_cfg = config.tiers[1]
    assert isinstance(redis_cfg, RedisTierConfig)
    assert (redis_cfg.ttl_s, redis_cfg.max_part_bytes, redis_cfg.cluster) == (3600.0, 4 << 20, False)
    assert "s3cret" not in repr(redis_cfg) and "other" not in repr(redis_cfg)
    path = tmp_path / "kvtier.yaml"
    path.write_text("chunk_size: 256\ntiers:\n  - kind: memory\n    capacity_bytes: 1GiB\n"
                    "  - kind: redis\n    url: redis://redis.internal:6379/0\n    ttl_s: 86400\n    pool_size: 4\n")
    cfg = CacheConfig.from_yaml(path).tiers[1]
    assert (cfg.url, cfg.ttl_s, cfg.pool_size, cfg.ttl_s) == ("redis://redis.internal:6379/0", 86400.0, 4, 86400.0)


@pytest.mark.parametrize("bad", [
    {"url": "http://example"}, {"key_prefix": "a{b}"}, {"timeout_s": 0}, {"max_part_bytes": 1 << 30},
    {"pool_size": 0}, {"codec": "nope"},
])
def test_bad_config_is_rejected(bad):
    with pytest.raises(ConfigError):
        RedisTierConfig(**bad)


def test_unknown_url_option_is_rejected():
    with pytest.raises(ConfigError):
        RedisTier(RedisTierConfig(url="redis://localhost:6379/0?bogus_option=1"), tier_context("redis"))


def test_import_kvtier_without_redis_py():
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "import kvtier\n"
        "from kvtier import CacheConfig, ConfigError, KVCache, KVSpec\n"
        "from kvtier.tiers import RedisTierConfig\n"
        "cfg = CacheConfig(tiers=({'kind': 'redis', 'url': 'redis://localhost:1/0'},))\n"
        "try:\n"
        "    KVCache(KVSpec(1, 1, 8, 'float16'), 'm', cfg)\n"
        "except ConfigError as exc:\n"
        "    assert 'pip install' in str(exc), exc\n"
        "else:\n"
        "    raise SystemExit('expected ConfigError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


# -- ACL and TLS -----------------------------------------------------------------------------------------------
def test_acl_user_with_password_in_url():
    from tests.tiers.conftest import _require_redis

    _require_redis()
    port = free_port()
    # exactly the ACL docs/tiers/redis.md recommends
    acl = ("--user", "default", "off", "--user", "replica", "on", ">s3cret", "~kvtier:*", "resetchannels", "-@all",
           "+get", "+getex", "+set", "+exists", "+unlink", "+getrange", "+ping", "+info", "+dbsize",
           "+cluster|slots")
    with RedisServer(port=port, args=acl, cli_auth=("--user", "replica", "--pass", "s3cret")):
        tokens, kv = prompt(2)
        url = f"redis://replica:s3cret@127.0.0.1:{port}/0"
        with make_cache(url, max_part_bytes=4096) as cache:
            assert cache.store(tokens, kv) == len(tokens)
            assert cache.retrieve(tokens)[1] == len(tokens)
            assert cache.tiers[0].stats().entries == 4
        with make_cache(f"redis://replica:wrong@127.0.0.1:{port}/0", timeout_s=0.5) as cache:
            assert cache.lookup(tokens) == 0  # refused: a miss, counted, no exception
            assert cache.store(tokens, kv) == 0
            assert cache.metrics.total("kvtier_tier_errors_total") >= 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_tls_with_ca_file(tmp_path):
    from tests.tiers.conftest import _require_redis

    _require_redis()

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=kvtier-test-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out",
        "server.csr")
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
        "-extfile", "ext.cnf", "-out", "server.crt")
    port = free_port()
    tls = ("--tls-port", str(port), "--tls-cert-file", str(tmp_path / "server.crt"), "--tls-key-file",
           str(tmp_path / "server.key"), "--tls-ca-cert-file", str(tmp_path / "ca.crt"), "--tls-auth-clients", "no")
    with RedisServer(args=tls) as server:  # no plain TCP port: unix socket for the fixture, TLS for the tier
        tokens, kv = prompt(3)
        url = f"rediss://127.0.0.1:{port}/0"
        with make_cache(url, tls_ca_file=str(tmp_path / "ca.crt"), max_part_bytes=4096) as cache:
            assert cache.store(tokens, kv) == len(tokens)
            out, n = cache.retrieve(tokens)
            assert n == len(tokens) and torch.equal(out, kv)
        assert int(server.cli("DBSIZE")) == 6
        with make_cache(url, timeout_s=0.5) as cache:  # no CA: the server's certificate is not trusted
            assert cache.store(tokens, kv) == 0


def test_docs_page_examples_parse():
    """The Redis tier page's YAML and environment examples are valid configurations."""
    import re
    from pathlib import Path

    import yaml

    section = (Path(__file__).resolve().parents[2] / "docs" / "tiers" / "redis.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)
    config = CacheConfig.from_dict(yaml.safe_load(block))
    assert [t.kind for t in config.tiers] == ["memory", "redis"] and config.tiers[1].ttl_s == 86400
    env = dict(re.findall(r"export (KVTIER_\w+)=(\S+)", section))
    env["KVTIER_REDIS_PASSWORD"] = "x"
    config = CacheConfig.from_env(env)
    assert config.tiers[1].url.startswith("rediss://") and config.tiers[1].tls_ca_file
