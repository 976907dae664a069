"""``--data-parallel-size``: several engine-core processes (replicas) behind one server. The
routing rule on its own (plain Python), then two SmolLM2 replicas: the in-process engine's
tokens, the load on both, a client gone freeing its blocks on its replica, per-engine metrics,
and ``jaxllm serve -dp 2`` draining on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import aiohttp
import pytest
from conftest import SMOLLM2_ENGINE_ARGS, assert_engine_idle
from jaxllm.serve.args import ServerConfig, build_parser, configs_from_args
from jaxllm.serve.server import BackgroundServer
from test_engine_process import PROMPTS, C, alive, serve_command, stream_text
from test_server_shutdown import ROOT, free_port, healthy

from jaxllm import EngineConfig, SamplingParams
from jaxllm.engine.core_client import EngineCoreClient
from jaxllm.engine.core_process import launch_engine_cores
from jaxllm.engine.load_balancer import LoadBalancer, ReplicaLoad
from jaxllm.engine.replica_devices import replica_device_env
from jaxllm.engine.snapshot import EngineSnapshot, merge_snapshots

BLOCK = 16
SYSTEM = list(range(100, 100 + 2 * BLOCK))  # a shared two-block prefix


# ------------------------------------------------------------ the rule, no processes
def test_requests_go_to_the_least_loaded_replica_ties_in_turn():
    lb = LoadBalancer(2, BLOCK, max_num_seqs=8)
    picks = []
    for _ in range(4):
        picks.append(lb.choose([1, 2, 3]))  # shorter than a block: no prefix key
        lb.added(picks[-1])
    assert picks == [0, 1, 0, 1] and lb.in_flight == [2, 2]
    lb.finished(0)
    assert lb.choose(None) == 0
    # Another front end's queue (reported) and a fuller KV cache (x max_num_seqs) weigh too.
    lb.report(0, ReplicaLoad(waiting=3))
    assert lb.load(0) == 1 + 3 and lb.choose(None) == 1
    lb.report(0, ReplicaLoad())
    lb.report(1, ReplicaLoad(kv_usage=0.5))
    assert lb.load(1) == 2 + 4 and lb.choose(None) == 0
    assert LoadBalancer(1, BLOCK, 8).choose(SYSTEM) == 0


def test_a_shared_prefix_sticks_to_its_replica_unless_it_is_much_more_loaded():
    lb = LoadBalancer(2, BLOCK, max_num_seqs=8, affinity_slack=2)
    first = lb.choose(SYSTEM + [1])
    lb.added(first)
    other = 1 - first
    # Up to `slack` more requests than the least loaded replica: the prefix's replica still.
    for _ in range(2):
        assert lb.choose(SYSTEM[:BLOCK] + [7] * BLOCK) == first  # the first block matches
        lb.added(first)
    assert lb.load(first) - lb.load(other) == 3
    # Past the slack it goes to the least loaded, and the prefix follows it there.
    assert lb.choose(SYSTEM + [2]) == other
    lb.added(other)
    assert lb.choose(SYSTEM + [3]) == other
    # The longest shared prefix decides: two blocks beat one.
    lb = LoadBalancer(2, BLOCK, max_num_seqs=8, affinity_slack=0)
    a, b = SYSTEM[:BLOCK] + [5] * BLOCK, SYSTEM  # the same first block
    assert lb.choose(a) == 0
    lb.added(0)
    assert lb.choose(b) == 1  # a's first block, but replica 0 is busier (no slack)
    lb.finished(0)
    assert lb.choose(b + [9]) == 1 and lb.choose(a + [9]) == 0
    assert len(lb.prefix_keys(list(range(10 * BLOCK)))) == 4  # at most AFFINITY_BLOCKS


def test_replica_totals_and_devices():
    a = EngineSnapshot(time=1.0, running=2, waiting=1, kv_usage=0.5, num_gpu_blocks=100,
                       kv_pool_utilisation=0.4, kv_waste=0.5, prompt_tokens=10,
                       host_rss_bytes=5, device_memory_used=None)
    b = EngineSnapshot(time=2.0, running=1, kv_usage=0.0, num_gpu_blocks=300,
                       kv_pool_utilisation=0.0, kv_waste=0.0, prompt_tokens=7,
                       host_rss_bytes=6, device_memory_used=None)
    total = merge_snapshots([a, b])
    assert (total.time, total.running, total.waiting, total.prompt_tokens) == (2.0, 3, 1, 17)
    assert total.kv_usage == pytest.approx(0.125) and total.num_gpu_blocks == 400
    assert total.kv_pool_utilisation == pytest.approx(0.1) and total.kv_waste == 0.5
    assert total.host_rss_bytes == 11 and total.device_memory_used is None
    gpus = {"CUDA_VISIBLE_DEVICES": "2,3,4,5"}
    assert replica_device_env(1, 2, gpus) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert replica_device_env(1, 2, {"JAX_PLATFORMS": "cpu"}) == {}
    args = build_parser().parse_args(["-dp", "3", "-tp", "2"])
    with pytest.raises(ValueError, match="needs 6 GPUs but 4 are visible"):
        configs_from_args(args, environ=gpus)
    with pytest.raises(ValueError, match="data-parallel-size=0 must be >= 1"):
        configs_from_args(build_parser().parse_args(["-dp", "0"]), environ={})


# ------------------------------------------------------------ two SmolLM2 replicas
ENGINE = EngineConfig(dtype="float32", **SMOLLM2_ENGINE_ARGS)
SERVER = ServerConfig(host="127.0.0.1", port=0, disable_log_requests=True,
                      disable_log_stats=True)


@pytest.fixture(scope="module")
def dp_server():
    handles = launch_engine_cores(ENGINE, data_parallel_size=2)
    with BackgroundServer(EngineCoreClient.for_handles(handles), SERVER) as server:
        yield server, handles
    # The last test kills replica 1; the server stopped the other one.
    assert [h.process.exitcode for h in handles] == [0, -signal.SIGKILL]


def replicas(server) -> list[EngineSnapshot]:
    return server.call(server.engine.snapshots)


def wait_idle(server, timeout: float = 30.0) -> list[EngineSnapshot]:
    deadline = time.monotonic() + timeout
    while True:
        per = replicas(server)
        if all(not (s.running or s.waiting or s.swapped) and s.kv_usage == 0 for s in per):
            return per
        assert time.monotonic() < deadline, f"the replicas are not idle: {per}"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_replicas_serve_the_in_process_tokens_and_share_the_load(dp_server, smollm2_llm):
    server, _ = dp_server
    expected = [o.outputs[0].text for o in smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    assert_engine_idle(smollm2_llm.engine)

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS * 2]
            responses = await asyncio.gather(*(session.post(C, json=b) for b in bodies))
            texts = [(await r.json())["choices"][0]["text"] for r in responses]
            return texts, await (await session.get("/metrics")).text()

    texts, metrics = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert texts == expected * 2
    per = wait_idle(server)
    assert all(s.prompt_tokens > 0 for s in per), per
    assert sum(s.prompt_tokens for s in per) >= sum(
        len(smollm2_llm.get_tokenizer()(p)["input_ids"]) for p in PROMPTS * 2)
    for engine in ("0", "1"):
        assert (f'jaxllm:engine_prompt_tokens_per_engine_total{{engine="{engine}",'
                'model_name="SmolLM2-135M-Instruct"}') in metrics, metrics
    assert 'jaxllm:num_requests_running{model_name="SmolLM2-135M-Instruct"}' in metrics


@pytest.mark.slow
def test_clients_gone_free_their_blocks_on_their_replicas(dp_server):
    server, _ = dp_server

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            responses = await asyncio.gather(*(session.post(C, json=body) for _ in range(2)))
            for response in responses:
                assert response.status == 200
                await response.content.readline()  # decoding has started
            busy = await asyncio.get_running_loop().run_in_executor(None, replicas, server)
            for response in responses:
                response.close()  # the client goes away mid-stream
            return busy

    busy = asyncio.run(asyncio.wait_for(scenario(), 60))
    # The same prompt: affinity has no key (shorter than a block), so one each.
    assert [s.running for s in busy] == [1, 1] and all(s.kv_usage > 0 for s in busy)
    for s in wait_idle(server):
        assert s.num_free_blocks == s.num_gpu_blocks - 1
    # Their abort outputs came back before the snapshots did (one socket each, in order).
    assert server.engine.balancer.in_flight == [0, 0]


@pytest.mark.slow
def test_a_killed_replica_fails_every_request_and_the_server_exits_1(dp_server):
    server, handles = dp_server

    async def scenario():
        async with aiohttp.ClientSession(base_url=server.url) as session:
            body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            responses = await asyncio.gather(*(session.post(C, json=body) for _ in range(2)))
            for response in responses:
                await response.content.readline()
            os.kill(handles[1].process.pid, signal.SIGKILL)
            return [(await r.content.read()).decode() for r in responses]

    rests = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert server.wait(30) == 1
    for rest in rests:  # the stream on the live replica fails too: one engine, one fate
        assert "engine-core process of replica 1 exited" in rest and "[DONE]" in rest, rest


@pytest.mark.slow
def test_serve_with_two_replicas_drains_on_sigterm(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(serve_command(port, "--data-parallel-size", "2",
                                              "--api-server-count", "2"),
                                cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            assert healthy(url, proc, timeout=300), log_path.read_text()
            deadline = time.monotonic() + 120  # the second front end may start later
            while log_path.read_text().count("serving SmolLM2") < 2:
                assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()
                time.sleep(0.2)

            async def scenario():
                async with aiohttp.ClientSession(base_url=url) as session:
                    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0}
                              for p in PROMPTS]
                    late = [asyncio.create_task(stream_text(session, b)) for b in bodies]
                    await asyncio.sleep(0.5)
                    proc.send_signal(signal.SIGTERM)
                    return await asyncio.gather(*late)

            finished = asyncio.run(asyncio.wait_for(scenario(), 120))
            assert proc.wait(120) == 0, log_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    log = log_path.read_text()
    assert [f for _, f in finished] == ["length"] * 3, log
    assert "engine core 0]" in log and "engine core 1]" in log, log
    match = re.search(r"front-end processes \(pids ([\d, ]+)\) and the engine-core processes "
                      r"\(pids ([\d, ]+)\)", log)
    assert match, log
    pids = [int(p) for group in match.groups() for p in group.split(", ")]
    assert len(pids) == 4 and not any(alive(p) for p in pids), log
