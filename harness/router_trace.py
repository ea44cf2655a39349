"""Router measurements beyond request rate: a process tree's CPU and memory, the oracle share on a multi-turn
trace, and a flood of distinct sessions.

* ``tree_cpu_rss(pid)``: CPU seconds (user + system) and RSS bytes of ``pid`` and its descendants (/proc).
* ``oracle_share(url, trace, n, block_words, ports)``: the first ``n`` requests of a Mooncake-format trace
  (``hash_ids``: one id per 512-token block), each block id expanded into ``block_words`` deterministic words,
  sent in order as text completions through the router at ``url`` to stand-in replicas (which name the port
  that served them); the share of requests whose replica held the longest prefix of blocks among all replicas,
  by an oracle that knows every replica was sent and models each one's cache (unbounded, or the stand-ins'
  bounded LRU of block prefixes: ``blocks_cap``), over the requests some replica held anything for. With
  ``concurrency`` > 1 that many requests are in flight at once (each next one sent in trace order as one is
  answered), so a router must place a session's turn while others load the replicas: the oracle judges each
  request by its model of the replicas when it was sent (what the answers so far say they served).
* ``session_flood(url, n, concurrency)``: ``n`` short chat requests, each a new session; how many succeeded.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections import Counter
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TraceShare:
    """``oracle_share``'s figures: the share, over how many requests it was judged, and the busiest replica's
    requests over the mean (a router that sends everything to one replica scores a share of 1.0 trivially)."""

    share: float
    judged: int
    busiest_over_mean: float

    @staticmethod
    def of(hits: int, judged: int, served: Counter, ports: list[int]) -> TraceShare:
        mean = sum(served.values()) / len(ports)
        return TraceShare(hits / judged if judged else 0.0, judged, max(served.values(), default=0) / (mean or 1))


def oracle_share(url: str, trace: Path, n: int, block_words: int, ports: list[int],
                 blocks_cap: int | None = None, concurrency: int = 1) -> TraceShare:
    """See the module docstring. ``blocks_cap``: each stand-in holds at most that many block prefixes
    (harness.stub_replica --blocks) and the oracle models every replica's bounded cache alike; one at a time, a
    replica's answer (``held_blocks``) must agree with the oracle's model of it (RuntimeError otherwise)."""
    import httpx

    for port in ports:  # every replay starts from cold stand-ins, as the oracle's model does
        httpx.post(f"http://127.0.0.1:{port}/stub/forget", timeout=30).raise_for_status()
    with trace.open() as fh:
        prompts = [" ".join(_block_text(b, block_words) for b in json.loads(line)["hash_ids"])
                   for _, line in zip(range(n), fh)]
    return asyncio.run(_replay(url, prompts, ports, blocks_cap, concurrency))


async def _replay(url: str, prompts: list[str], ports: list[int], blocks_cap: int | None,
                  concurrency: int) -> TraceShare:
    import httpx

    from harness.stub_replica import PrefixCache, prompt_blocks

    model = {port: PrefixCache(blocks_cap or 1 << 62) for port in ports}
    queue = iter(prompts)
    hits = judged = 0
    served: Counter = Counter()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal hits, judged
        for prompt in queue:  # one shared iterator: the trace's order, each request sent once
            keys = PrefixCache.keys(prompt_blocks(prompt))
            best = {port: model[port].held(keys) for port in ports}  # the replicas as the answers so far say
            answer = await client.post(url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 4})
            if answer.status_code != 200:
                continue
            body = answer.json()
            port = body["served_by"]
            served[port] += 1
            if max(best.values()) > 0:
                judged += 1
                hits += best[port] == max(best.values())
            on_arrival = model[port].serve(keys)
            if concurrency == 1 and blocks_cap and body.get("held_blocks") != on_arrival:
                raise RuntimeError(f"replica {port} held {body.get('held_blocks')} blocks, the oracle {on_arrival}")

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return TraceShare.of(hits, judged, served, ports)


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
