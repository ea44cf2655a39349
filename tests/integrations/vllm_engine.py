"""Runs one vLLM engine through a list of steps and writes what it saw as JSON (a script, not a test).

vLLM starts its engine and workers in new processes, so each engine of the tests runs in its own
interpreter: ``python vllm_engine.py SPEC.json OUT.json``. SPEC holds ``model``, ``prompts`` (token id
lists), ``max_tokens``, ``kvtier`` (the connector's extra config, or null for plain vLLM) and ``steps``:

* ``"gen:<label>"``  generate greedily; record each prompt's output token ids and ``num_cached_tokens``
  (``"gen:<label>:<i>,<j>"``: only those prompts);
* ``"reset"``        reset vLLM's own prefix cache (retried while finished requests' saves still hold blocks);
* ``"corrupt:<p>:<c>"`` (in-process engines only) overwrite the token ids stored in chunk ``c`` of prompt
  ``p`` in the worker's memory tier, as a bit flip would, so that chunk no longer verifies;
* ``"corrupt-state:<p>:<k>:<kind>"`` (in-process engines only) the same to the state snapshot of kind ``kind``
  (``ssm``, ``conv``, ``window``) stored at boundary ``k`` (in chunks) of prompt ``p``;
* ``"metrics:<label>"`` (in-process engines only) record the worker's kvtier counters;
* ``"sleep:<seconds>"`` wait (a load cut short by its deadline may still be reading a slow tier);
* ``"prom:<label>"``  record the ``vllm:kvtier_*`` series of vLLM's Prometheus registry (needs ``log_stats``);
* ``"scrape:<label>"`` record the text a worker serves on the connector's ``metrics_port`` (over HTTP);
* ``"admin:<label>"`` make the calls ``SPEC["admin"][label]`` (``[method, path, body or null, key or null]``) to
  the admin API on the connector's ``metrics_port`` and record each answer's ``status`` and ``json``;
* ``"events:<label>"`` record the KV events vLLM published (``kv_events_port`` in SPEC turns vLLM's ZMQ
  publisher on) since the last such step, other than vLLM's own GPU blocks.

In-process engines also take these steps (vllm_faults.py):

* ``"slow:<seconds>"`` every read of the worker's first tier waits that long (``slow:0`` ends it);
* ``"evict:<p>:<c>"`` chunk ``c`` of prompt ``p`` disappears from every tier when the worker next reads it;
* ``"loads:<label>"`` record the worker's asynchronous loads so far, by how they ended, and their block counts;
* ``"preemptions:<label>"`` record how many requests vLLM's scheduler preempted so far;
* ``"abort:<label>"`` add every prompt, abort them all once their loads run, step until vLLM is idle;
* ``"stream:<label>"`` prompt 0 alone, the others once it decodes; record every output;
* ``"exit"`` add every prompt and stop (write the output, exit the process) while their loads run.

* ``"sleep:<seconds>"`` wait that long (a retention time passing).

SPEC may set ``kv_transfer_params``: per prompt, the request's ``kv_transfer_params`` (or null), sent with every
generate. SPEC may also set ``prefix_caching`` (vLLM's own, default true), ``num_blocks`` (vLLM's KV cache size in
blocks) and ``max_num_seqs``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_faults as faults  # noqa: E402


def _reset(llm) -> None:
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset")
        if in_process:  # nothing steps an in-process engine between calls: step it so saves complete
            llm.llm_engine.step()
        else:
            time.sleep(0.05)


def _worker_cache():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker.cache


def _corrupt(prompt: list[int], chunk: int, kind: str = "") -> None:
    from kvtier.base.state import StateKind, state_key

    cache = _worker_cache()
    keys = cache.keys(prompt)
    # the snapshot after ``chunk`` chunks is stored under the key of the chunk that ends there
    key = state_key(keys[chunk - 1], StateKind(kind)) if kind else keys[chunk]
    tier = cache.tiers[0]
    with tier.get([key]) as (blob,):
        assert blob is not None, "chunk to corrupt is not stored"
        tokens_at = 40 + 4 * blob[9]  # fixed header, then the shape (ndim at byte 9), then the chunk's token ids
        blob[tokens_at] ^= 0xFF


def _vllm_kvtier_series() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:kvtier_") and not sample.name.endswith("_created"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def _admin_call(port: int, method: str, path: str, body: object, key: str | None) -> dict:
    import urllib.error

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return {"status": answer.status, "json": json.loads(answer.read())}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "json": json.loads(exc.read())}


class _EventLog:
    """Subscribes to vLLM's KV event publisher and keeps every event not about vLLM's own GPU blocks."""

    def __init__(self, port: int) -> None:
        import threading

        import zmq

        self.events: list[dict] = []
        self._lock = threading.Lock()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.connect(f"tcp://127.0.0.1:{port}")
        self._sub.subscribe(b"")
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        while True:
            _, _, payload = self._sub.recv_multipart()
            for event in decoder.decode(payload).events:
                if getattr(event, "medium", None) in (None, "GPU"):
                    continue
                record = {"type": type(event).__name__, "medium": event.medium, "ownership": event.ownership,
                          "hashes": [h.hex() for h in event.block_hashes]}
                if isinstance(event, BlockStored):
                    record.update(parent=event.parent_block_hash.hex() if event.parent_block_hash else None,
                                  tokens=list(event.token_ids), block_size=event.block_size)
                with self._lock:
                    self.events.append(record)

    def take(self) -> list[dict]:
        """Events so far, once none arrived for a second (at most 30 s)."""
        deadline, seen, quiet_since = time.monotonic() + 30, -1, time.monotonic()
        while time.monotonic() < deadline:
            with self._lock:
                n = len(self.events)
            if n != seen:
                seen, quiet_since = n, time.monotonic()
            elif n and time.monotonic() - quiet_since > 1.0:
                break
            time.sleep(0.1)
        with self._lock:
            taken, self.events = self.events, []
        return taken


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.load(open(spec_path))
    enable_prefix_caching = spec.get("prefix_caching", True)
    transfer = None
    if spec.get("kvtier") is not None:
        transfer = KVTransferConfig(kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                    kv_role="kv_both", kv_connector_extra_config=spec["kvtier"])
    extra = {}
    log = None
    if spec.get("kv_events_port"):
        from vllm.config import KVEventsConfig

        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                   endpoint=f"tcp://*:{spec['kv_events_port']}")
        log = _EventLog(spec["kv_events_port"])
    started = time.monotonic()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), block_size=spec.get("block_size", 32),
              max_model_len=spec.get("max_model_len", 2048), enable_prefix_caching=enable_prefix_caching, seed=0,
              kv_transfer_config=transfer, max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
              enforce_eager=spec.get("enforce_eager", True), disable_log_stats=not spec.get("log_stats", False),
              num_gpu_blocks_override=spec.get("num_blocks"), max_num_seqs=spec.get("max_num_seqs", 256), **extra)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        faults.count_preemptions(llm)
    print(f"engine started in {time.monotonic() - started:.1f} s", file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    if spec.get("kv_transfer_params"):
        params = [params.clone() for _ in prompts]
        for p, extra_params in zip(params, spec["kv_transfer_params"]):
            p.extra_args = None if extra_params is None else {"kv_transfer_params": extra_params}
    out: dict[str, object] = {}
    for step in spec["steps"]:
        kind, _, arg = step.partition(":")
        if kind == "gen":
            arg, _, only = arg.partition(":")
            chosen = [prompts[int(i)] for i in only.split(",")] if only else prompts
            results = llm.generate(chosen, params, use_tqdm=False)
            out[arg] = [{"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens} for r in results]
        elif kind == "reset":
            _reset(llm)
        elif kind == "sleep":
            time.sleep(float(arg))
        elif kind == "metrics":
            out[arg] = _worker_cache().metrics.snapshot()
        elif kind == "prom":
            out[arg] = _vllm_kvtier_series()
        elif kind == "scrape":
            url = f"http://127.0.0.1:{spec['kvtier']['metrics_port']}/metrics"
            out[arg] = urllib.request.urlopen(url, timeout=10).read().decode()
        elif kind == "admin":
            out[arg] = [_admin_call(spec["kvtier"]["metrics_port"], *c) for c in spec["admin"][arg]]
        elif kind == "sleep":
            time.sleep(float(arg))
        elif kind == "events":
            assert log is not None, "events need kv_events_port in the spec"
            out[arg] = log.take()
        elif kind == "corrupt":
            p, c = (int(x) for x in arg.split(":"))
            _corrupt(spec["prompts"][p], c)
        elif kind == "corrupt-state":
            p, k, state = arg.split(":")
            _corrupt(spec["prompts"][int(p)], int(k), state)
        elif kind == "evict":
            p, c = (int(x) for x in arg.split(":"))
            faults.evict_on_load(spec["prompts"][p], c)
        elif kind == "slow":
            faults.slow(float(arg))
        elif kind == "loads":
            out[arg] = dict(faults.worker().loads.totals)
        elif kind == "preemptions":
            out[arg] = faults.preemptions(llm)
        elif kind == "abort":
            out[arg] = faults.abort_mid_load(llm, spec["prompts"], params)
        elif kind == "stream":
            out[arg] = faults.arrive_while_decoding(llm, spec["prompts"], params, decoded=4)
        elif kind == "exit":
            out["loading_at_exit"] = faults.start_loads(llm, spec["prompts"], params)
            break
        else:
            raise ValueError(f"unknown step {step!r}")
    with open(out_path, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
