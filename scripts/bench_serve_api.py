"""How many streamed chunks and tokens per second the API process can serve (CPU only).

Starts ``python -m mrv2.serve.fake`` (the engine in its own process, a step every
``--step-ms`` with no host work, one token per running request a step: an engine far
faster than the HTTP layer), then ``--clients`` streaming clients spread over
``--client-procs`` processes, each sending ``--requests`` back-to-back streaming
``/v1/completions`` requests of ``--tokens`` tokens. Reports the chunks/s and tokens/s the
clients received, tokens per chunk, and the engine's steps/s (from ``/metrics``) beside
the fake engine's ideal (``1000 / step_ms``).

    python scripts/bench_serve_api.py --clients 64 256 --step-ms 5
    python scripts/bench_serve_api.py --clients 256 --client bench  # mrv2 bench serve's client

``--client raw`` (default) is a minimal asyncio HTTP/1.1 client, so that the clients are
not the bound; ``bench`` is ``mrv2.bench.serve``'s client, ``httpx`` the httpx streaming
loop it used before (the client's CPU per chunk is reported too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _raw_one(port: int, body: bytes) -> tuple[int, int]:
    """One streaming request over a fresh connection: (content chunks, completion tokens)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:200])
    buf, chunks, tokens = b"", 0, 0
    while True:  # chunked transfer encoding
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            break
        buf += (await reader.readexactly(size + 2))[:-2]
        *events, buf = buf.split(b"\n\n")
        for ev in events:
            if ev == b"data: [DONE]":
                continue
            if b'"usage":{' in ev or b'"usage": {' in ev:
                tokens = json.loads(ev[6:])["usage"]["completion_tokens"]
            elif b'"error"' in ev:
                raise RuntimeError(ev[:200])
            else:
                chunks += 1
    writer.close()
    return chunks, tokens


async def _httpx_one(client, port: int, payload: dict) -> tuple[int, int]:
    """The same with httpx (what ``mrv2 bench serve`` used before its own client)."""
    chunks = tokens = 0
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                             json=payload) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if '"usage": {' in line or '"usage":{' in line:
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            else:
                chunks += 1
    return chunks, tokens


async def _bench_one(port: int, payload: dict) -> tuple[int, int]:
    """The same with ``mrv2.bench.serve``'s client."""
    from mrv2.bench.serve import _one

    rec = await _one(("127.0.0.1", port, "/v1/completions"), payload)
    if rec["error"]:
        raise RuntimeError(rec["error"])
    return len(rec["chunks"]), rec["tokens"]


def _client_proc(port, n_streams, n_requests, tokens, kind, barrier, results) -> None:
    payload = {"model": "fake", "prompt": list(range(1, 33)), "max_tokens": tokens,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    body = json.dumps(payload).encode()

    async def main():
        client = None
        if kind == "httpx":
            import httpx
            client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(
                max_connections=n_streams + 8, max_keepalive_connections=n_streams + 8))

        async def stream():
            c = t = 0
            for _ in range(n_requests):
                cc, tt = (await _raw_one(port, body) if kind == "raw" else
                          await _bench_one(port, payload) if kind == "bench" else
                          await _httpx_one(client, port, payload))
                c, t = c + cc, t + tt
            return c, t

        barrier.wait()
        t0, c0 = time.perf_counter(), time.process_time()
        out = await asyncio.gather(*(stream() for _ in range(n_streams)))
        t1 = time.perf_counter()
        if client is not None:
            await client.aclose()
        return (t0, t1, sum(c for c, _ in out), sum(t for _, t in out),
                time.process_time() - c0)

    results.put(asyncio.run(main()))


def _steps(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return int(float(re.search(r"mrv2:steps_total\{[^}]*\} (\S+)", text).group(1)))


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 if unknown)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_pid(pid: int) -> int | None:
    child = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], check=False,
                           capture_output=True, text=True).stdout.split()
    return int(child[0]) if child else None


def measure(port: int, clients: int, procs: int, requests: int, tokens: int, kind: str,
            api_pid: int | None = None) -> dict:
    """One run of ``clients`` streams against the server on ``port``; its figures."""
    procs = max(1, min(procs, clients))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(procs + 1), ctx.Queue()
    per = [clients // procs + (i < clients % procs) for i in range(procs)]
    ps = [ctx.Process(target=_client_proc, args=(port, n, requests, tokens, kind, barrier,
                                                  results)) for n in per]
    for p in ps:
        p.start()
    steps0 = _steps(port)
    eng_pid = _engine_pid(api_pid) if api_pid else None
    cpu0 = _cpu_s(api_pid), _cpu_s(eng_pid)
    barrier.wait()
    got = [results.get(timeout=600) for _ in ps]
    for p in ps:
        p.join()
    cpu = _cpu_s(api_pid) - cpu0[0], _cpu_s(eng_pid) - cpu0[1]
    steps = _steps(port) - steps0
    wall = max(g[1] for g in got) - min(g[0] for g in got)
    chunks, toks = sum(g[2] for g in got), sum(g[3] for g in got)
    expect = clients * requests * tokens
    return {"clients": clients, "client_procs": procs, "client": kind, "wall_s": wall,
            "chunks": chunks, "tokens": toks, "tokens_expected": expect,
            "chunks_per_s": chunks / wall, "tok_per_s": toks / wall,
            "tokens_per_chunk": toks / max(chunks, 1), "engine_steps_per_s": steps / wall,
            # NOTE: CPU time is the figure that survives a shared, busy CPU: the API process
            # alone on a core would serve ~1e6 / api_cpu_us_per_token tokens/s.
            "api_cpu_s": cpu[0], "engine_cpu_s": cpu[1],
            "api_cpu_us_per_token": 1e6 * cpu[0] / max(toks, 1),
            "api_cpu_us_per_chunk": 1e6 * cpu[0] / max(chunks, 1),
            "api_cpu_load": cpu[0] / wall,
            "client_cpu_us_per_chunk": 1e6 * sum(g[4] for g in got) / max(chunks, 1)}


def measure_app(clients: int, requests: int, tokens: int, step_ms: float = 2.0) -> dict:
    """The app's own event-loop CPU per chunk: ASGI calls without a server or sockets.

    The FastAPI app runs on a ``FakeLLM`` stepped by a thread of this process; each of
    ``clients`` coroutines sends ``requests`` streaming requests straight into the ASGI
    app (a ``send`` that only counts the events). The event loop thread's CPU time
    (``time.thread_time``: not the engine thread's) per chunk is the cost of everything
    this repository's code and FastAPI/Starlette do per chunk, without uvicorn, h11 and
    the socket: a figure steady enough on a shared CPU to compare two versions.
    """
    from mrv2.serve.api_server import create_app
    from mrv2.serve.async_engine import AsyncLLM
    from mrv2.serve.fake import FakeLLM

    engine = AsyncLLM(FakeLLM(step_ms=step_ms, cpu_ms=0, max_num_seqs=clients))
    app = create_app(engine, "fake")
    body = json.dumps({"model": "fake", "prompt": list(range(1, 33)), "max_tokens": tokens,
                       "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"x"), (b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    count = {"events": 0, "bytes": 0}

    async def one():
        done = asyncio.Event()
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(msg):
            if msg["type"] == "http.response.body" and msg.get("body"):
                count["events"] += 1
                count["bytes"] += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    done.set()

        await app(dict(scope), receive, send)

    async def client():
        for _ in range(requests):
            await one()

    async def main():
        await asyncio.gather(*(client() for _ in range(min(clients, 8))))  # warm-up
        count.update(events=0, bytes=0)
        c0, t0, s0 = time.thread_time(), time.perf_counter(), engine.num_steps
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.thread_time() - c0, time.perf_counter() - t0, engine.num_steps - s0

    try:
        cpu, wall, steps = asyncio.run(main())
    finally:
        engine.shutdown()
    # NOTE: per request one [DONE] and one usage event besides the content chunks (empty
    # bodies are not counted)
    chunks = count["events"] - 2 * clients * requests
    toks = clients * requests * tokens
    return {"clients": clients, "mode": "app", "chunks": chunks, "tokens": toks,
            "wall_s": wall, "steps": steps, "tokens_per_chunk": toks / max(chunks, 1),
            "app_cpu_s": cpu, "app_cpu_us_per_chunk": 1e6 * cpu / max(chunks, 1),
            "app_cpu_us_per_token": 1e6 * cpu / toks,
            "app_cpu_ms_per_request": 1e3 * cpu / (clients * requests)}


def _spy(pid: int, out: str) -> list:
    """py-spy (raw stacks, 8 s from 2 s on) on the API process and its engine child."""
    os.makedirs(out, exist_ok=True)
    child = _engine_pid(pid)
    return [subprocess.Popen(f"sleep 2; exec py-spy record -d 8 -r 100 --nonblocking --format raw"
                             f" -o {out}/{name}.txt --pid {p}", shell=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, p in (("api", pid), ("engine", child)) if p]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[64, 256])
    p.add_argument("--client-procs", type=int, default=1)
    p.add_argument("--client", choices=("raw", "bench", "httpx"), default="raw")
    p.add_argument("--requests", type=int, default=2, help="back-to-back requests per client")
    p.add_argument("--tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--step-ms", type=float, default=5.0, help="the fake engine's step time")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--py-spy", default=None, metavar="DIR",
                   help="py-spy record the API and engine processes of the last run into DIR")
    p.add_argument("--app", action="store_true",
                   help="measure the ASGI app alone in this process (no server, no sockets): "
                        "its event loop's CPU per chunk, steady on a shared CPU")
    a = p.parse_args(argv)
    if a.app:
        rows = [measure_app(n, a.requests, a.tokens) for n in a.clients]
        for r in rows:
            print(f"{r['clients']:4d} clients (app in process): {r['tokens_per_chunk']:5.2f} "
                  f"tok/chunk | app CPU {r['app_cpu_us_per_token']:5.1f} us/token "
                  f"{r['app_cpu_us_per_chunk']:5.1f} us/chunk "
                  f"({r['app_cpu_ms_per_request']:4.1f} ms a request of {a.tokens} tokens)",
                  flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
         os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-m", "mrv2.serve.fake", "--port", str(port),
                               "--step-ms", str(a.step_ms), "--cpu-ms", "0",
                               "--max-num-seqs", str(max(a.clients))], env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the fake server did not start") from None
                time.sleep(0.3)
        measure(port, 8, 1, 1, 16, a.client)  # warm-up
        rows = []
        for i, n in enumerate(a.clients):
            spies = _spy(server.pid, a.py_spy) if a.py_spy and i == len(a.clients) - 1 else []
            r = measure(port, n, a.client_procs, a.requests, a.tokens, a.client, server.pid)
            r["engine_ideal_steps_per_s"] = 1e3 / a.step_ms
            rows.append(r)
            for spy in spies:
                spy.wait(60)
            print(f"{n:4d} clients ({r['client']}, {r['client_procs']} procs): "
                  f"{r['chunks_per_s']:8.0f} chunks/s {r['tok_per_s']:8.0f} tok/s "
                  f"{r['tokens_per_chunk']:5.2f} tok/chunk | engine {r['engine_steps_per_s']:5.0f}"
                  f" steps/s of {1e3 / a.step_ms:.0f} | API CPU {r['api_cpu_load']:4.2f} cores, "
                  f"{r['api_cpu_us_per_token']:5.1f} us/token {r['api_cpu_us_per_chunk']:5.1f} "
                  f"us/chunk | client {r['client_cpu_us_per_chunk']:5.1f} us/chunk | {r['tokens']}/{r['tokens_expected']} tokens", flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
