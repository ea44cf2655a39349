"""Router measurements beyond request rate: a process tree's CPU and memory, the oracle share on a multi-turn
trace, and a flood of distinct sessions.

* ``tree_cpu_rss(pid)``: CPU seconds (user + system) and RSS bytes of ``pid`` and its descendants (/proc).
* ``oracle_share(url, trace, n, block_words, ports)``: the first ``n`` requests of a Mooncake-format trace
  (``hash_ids``: one id per 512-token block), each block id expanded into ``block_words`` deterministic words,
  sent in order as text completions through the router at ``url`` to stand-in replicas (which name the port
  that served them); the share of requests whose replica held the longest prefix of blocks among all replicas,
  by an oracle that knows every replica was sent and models each one's cache (unbounded, or the stand-ins'
  bounded LRU of block prefixes: ``blocks_cap``), over the requests some replica held anything for.
* ``session_flood(url, n, concurrency)``: ``n`` short chat requests, each a new session; how many succeeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from pathlib import Path

_WORDS = ("alpha beta gamma delta epsilon zeta theta iota kappa lambda sigma omega river stone cloud field light "
          "north south east west paper glass metal water").split()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            continue
    return out


def tree_cpu_rss(pid: int) -> tuple[float, int]:
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu, rss = 0.0, 0
    for p in _descendants(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            rss += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except OSError:
            continue
    return cpu, rss


def _block_text(block: int, words: int) -> str:
    rng = random.Random(block)
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def oracle_share(url: str, trace: Path, n: int, block_words: int, ports: list[int],
                 blocks_cap: int | None = None) -> float:
    """See the module docstring. ``blocks_cap``: each stand-in holds at most that many block prefixes
    (harness.stub_replica --blocks) and the oracle models every replica's bounded cache alike; a replica's answer
    (``held_blocks``) must agree with the oracle's model of it (RuntimeError otherwise)."""
    import httpx

    from harness.stub_replica import PrefixCache, prompt_blocks

    model = {port: PrefixCache(blocks_cap or 1 << 62) for port in ports}
    hits = counted = 0
    with trace.open() as fh, httpx.Client(timeout=120) as client:
        for _, line in zip(range(n), fh):
            prompt = " ".join(_block_text(b, block_words) for b in json.loads(line)["hash_ids"])
            keys = PrefixCache.keys(prompt_blocks(prompt))
            best = {port: model[port].held(keys) for port in ports}
            answer = client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4})
            if answer.status_code != 200:
                continue
            body = answer.json()
            port = body["served_by"]
            if max(best.values()) > 0:
                counted += 1
                hits += best[port] == max(best.values())
            on_arrival = model[port].serve(keys)
            if blocks_cap and body.get("held_blocks") != on_arrival:
                raise RuntimeError(f"replica {port} held {body.get('held_blocks')} blocks, the oracle {on_arrival}")
    return hits / counted if counted else 0.0


def session_flood(url: str, n: int, concurrency: int, start: int = 0) -> int:
    """Send ``n`` small chats of distinct sessions (``flood-{start}`` on), ``concurrency`` at once; returns the 200s."""
    async def run() -> int:
        import aiohttp

        done = 0
        queue = iter(range(start, start + n))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as client:
            async def worker() -> None:
                nonlocal done
                for i in queue:
                    body = {"model": "m", "max_tokens": 2, "user": f"flood-{i}",
                            "messages": [{"role": "user", "content": f"session {i} says hello"}]}
                    async with client.post(url + "/v1/chat/completions", json=body) as answer:
                        await answer.read()
                        done += answer.status == 200

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done

    return asyncio.run(run())
