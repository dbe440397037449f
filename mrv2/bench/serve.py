"""``python -m mrv2 bench serve``: streaming clients against an OpenAI server, as ``vllm bench serve``.

Requests arrive as a Poisson process at each ``--request-rate`` (``inf``: all at once),
at most ``--max-concurrency`` in flight; each is a streaming ``/v1/completions`` call
with the workload's random token-id prompt, ``max_tokens`` its output length,
``ignore_eos`` (so it generates exactly that many tokens) and ``temperature=0.6`` (the
offline benchmarks' protocol, ``mrv2.bench.workloads``; ``top_p=1``, ``top_k=0`` so the
model's generation-config defaults do not apply). Per request, measured on the
client: TTFT (send -> first chunk with a choice), ITL (gaps between those chunks; a chunk
may carry several tokens when the server coalesces), TPOT ((e2e - TTFT) / (tokens - 1)),
e2e, and two parts of TTFT: ``connect_ms`` (the TCP connection up) and ``head_ms`` (the
response's head: the server admitted the request); per rate: p50 / p90 / p99 and output
tokens/s over the wall time of the rate.

The client is a few lines of asyncio HTTP/1.1 (not httpx, ~150 us of CPU per chunk) spread
over ``--client-procs`` processes: at saturation a server streams tens of thousands of
chunks per second, and a single client process would be the bound being measured
(``scripts/bench_serve_api.py`` measures both sides against a fast fake engine).

``--launch MODEL`` starts ``python -m mrv2 serve MODEL`` itself (``qwen3-0.6b-dummy``:
the Qwen3-0.6B config of ``$MRV2_SHARED_DATA/qwen3-tokenizer`` with dummy weights, what
``bench throughput`` uses on a GPU), waits for ``/health``, sweeps the rates, writes the
JSON and stops the server.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import subprocess
import sys
import time
import urllib.parse

import numpy as np

#: ``--launch`` shorthands -> ``serve`` arguments.
PRESETS = {"qwen3-0.6b-dummy": lambda data: [str(data / "qwen3-tokenizer"),
                                             "--load-format", "dummy"]}


def _rates(text: str) -> list[float]:
    out = []
    for x in text.split(","):
        r = float(x)
        if not (r > 0):
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {x!r}")
        out.append(r)
    return out


def percentiles(values, ps=(50, 90, 99)) -> dict:
    """``{"mean", "p50", "p90", "p99"}`` of ``values`` in milliseconds (``None`` if empty)."""
    if not len(values):
        return {"mean": None, **{f"p{p}": None for p in ps}}
    arr = np.asarray(values, dtype=float) * 1e3
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in ps}}


async def _http_stream(host: str, port: int, path: str, body: bytes, rec: dict | None = None):
    """POST ``body`` (JSON) over a fresh HTTP/1.1 connection; ``(status, async iterator of the
    response body's pieces)``. ``rec`` (if given) gets the ``perf_counter`` times the
    connection was up (``"connected"``) and the response's head came (``"head"``).

    NOTE: a few lines of asyncio, not httpx: httpx (h11 underneath) costs ~150 us of CPU per
    streamed chunk, more than the server's own ~90 us (scripts/bench_serve_api.py); at tens of
    thousands of chunks per second a client like that is the bound being measured.
    """
    reader, writer = await asyncio.open_connection(host, port)
    if rec is not None:
        rec["connected"] = time.perf_counter()
    writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                 % (path.encode(), host.encode(), len(body)) + body)
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    if rec is not None:
        rec["head"] = time.perf_counter()
    status = int(head.split(None, 2)[1])

    async def pieces():
        try:
            if "transfer-encoding: chunked" not in head:
                yield await reader.read()
                return
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                if size == 0:
                    return
                yield (await reader.readexactly(size + 2))[:-2]
        finally:
            writer.close()

    return status, pieces()


async def _one(target: tuple[str, int, str], payload: dict) -> dict:
    """One streaming request: its send time, content-chunk times, tokens, error."""
    rec = {"start": time.perf_counter(), "chunks": [], "tokens": 0, "error": None}
    try:
        status, pieces = await _http_stream(*target, json.dumps(payload).encode(), rec)
        if status != 200:
            rec["error"] = f"HTTP {status}: {b''.join([p async for p in pieces])[:200]!r}"
            return rec
        buf = b""
        async for piece in pieces:
            *events, buf = (buf + piece).split(b"\n\n")
            now = time.perf_counter()
            for ev in events:
                if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                    continue
                # NOTE: parse JSON only for the usage / error chunks. A chunk with a choice
                # carries tokens (its text may be empty: a partial UTF-8 character, or a
                # dummy model's id outside the tokenizer).
                if b'"choices": [{' in ev or b'"choices":[{' in ev:
                    rec["chunks"].append(now)
                elif b'"usage"' in ev or b'"error"' in ev:
                    chunk = json.loads(ev[6:])
                    if "error" in chunk:
                        rec["error"] = chunk["error"].get("message")
                        break
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 (a failed request is counted, not fatal)
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["end"] = time.perf_counter()
    return rec


def _target(base_url: str) -> tuple[str, int, str]:
    url = urllib.parse.urlparse(base_url.rstrip("/") + "/v1/completions")
    if url.scheme != "http":
        raise ValueError(f"--base-url: only http:// servers, got {base_url!r}")
    return url.hostname or "127.0.0.1", url.port or 80, url.path


async def _send_all(target, jobs: list, t0: float, max_concurrency: int) -> list[dict]:
    """``jobs`` of ``(send offset s, payload)``: each sent at ``t0 + offset`` (perf_counter
    time) once fewer than ``max_concurrency`` of them are in flight; their records."""
    sem = asyncio.Semaphore(max_concurrency)

    async def limited(payload):
        async with sem:
            return await _one(target, payload)

    tasks = []
    for offset, payload in jobs:
        await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(limited(payload)))
    return list(await asyncio.gather(*tasks))


def _client_proc(target, jobs, max_concurrency, barrier, out) -> None:
    barrier.wait()  # NOTE: every process is up: the rate's clock starts now, in all of them
    out.put(asyncio.run(_send_all(target, jobs, time.perf_counter(), max_concurrency)))


async def run_rate(base_url: str, model: str, prompts, output_lens, rate: float,
                   max_concurrency: int, seed: int = 0, temperature: float = 0.6,
                   client_procs: int = 1) -> dict:
    """Send every prompt at ``rate`` requests/s (Poisson), at most ``max_concurrency`` at once.

    Args:
        client_procs: client processes (requests dealt round-robin, each process a
            ``max_concurrency / client_procs`` share); 1: this event loop.

    Returns:
        The figures of this rate (see the module docstring).
    """
    target = _target(base_url)
    gaps = np.random.RandomState(seed).exponential(1.0 / rate, len(prompts)) \
        if math.isfinite(rate) else np.zeros(len(prompts))
    offsets = np.cumsum(gaps)
    jobs = [(float(off), {"model": model, "prompt": list(map(int, prompt)), "max_tokens": int(n),
                          "stream": True, "temperature": temperature, "ignore_eos": True,
                          # NOTE: set, or the server applies generation_config.json's
                          # top-k 20 / top-p 0.95 (Qwen3): the offline runs sample without.
                          "top_p": 1.0, "top_k": 0, "stream_options": {"include_usage": True}})
            for prompt, n, off in zip(prompts, output_lens, offsets)]
    procs = max(1, min(client_procs, len(jobs)))
    if procs == 1:
        start = time.perf_counter()
        recs = await _send_all(target, jobs, start, max_concurrency)
    else:
        import multiprocessing

        # NOTE: perf_counter is CLOCK_MONOTONIC on Linux: one clock for every process.
        ctx = multiprocessing.get_context("spawn")
        out, barrier = ctx.Queue(), ctx.Barrier(procs + 1)
        share = max(1, math.ceil(max_concurrency / procs))
        ps = [ctx.Process(target=_client_proc, daemon=True,
                          args=(target, jobs[i::procs], share, barrier, out))
              for i in range(procs)]
        for p in ps:
            p.start()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, barrier.wait, 300)
        start = time.perf_counter()
        recs = [r for _ in ps for r in await loop.run_in_executor(None, out.get)]
        for p in ps:
            p.join()
    duration = max(r["end"] for r in recs) - start
    return summarize(recs, duration, rate, max_concurrency, sum(len(p) for p in prompts))


def summarize(recs: list[dict], duration: float, rate: float, max_concurrency: int,
              prompt_tokens: int) -> dict:
    """Percentiles and throughput of one rate's request records."""
    ok = [r for r in recs if r["error"] is None and r["chunks"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in ok)
    errors = [r["error"] for r in recs if r["error"] is not None]
    return {"request_rate": rate if math.isfinite(rate) else "inf",
            "max_concurrency": max_concurrency, "num_prompts": len(recs),
            "completed": len(ok), "failed": len(recs) - len(ok), "errors": errors[:5],
            "duration_s": duration, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / duration, "request_throughput": len(ok) / duration,
            "total_tok_s": (out_tokens + prompt_tokens) / duration,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot),
            "itl_ms": percentiles(itl), "e2e_ms": percentiles([r["end"] - r["start"] for r in ok]),
            # NOTE: where a TTFT went: TCP connect (a full accept queue drops SYNs, retried
            # after 1 s, then 3 s), the response head (the server admitted the request)
            "connect_ms": percentiles([r["connected"] - r["start"] for r in ok
                                       if "connected" in r]),
            "head_ms": percentiles([r["head"] - r["start"] for r in ok if "head" in r])}


def _server_info(base_url: str, timeout: float = 5.0) -> dict:
    import httpx

    data = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout).json()["data"][0]
    return data


def launch(model: str, extra: list[str], base_url: str, timeout_s: float = 900.0):
    """Start ``python -m mrv2 serve`` and wait for ``/health``; the process."""
    import httpx

    from mrv2.bench.suite import shared_data_dir

    url = urllib.parse.urlparse(base_url)
    model_args = PRESETS[model](shared_data_dir()) if model in PRESETS else [model]
    cmd = [sys.executable, "-m", "mrv2", "serve", *model_args, *extra,
           "--host", url.hostname or "127.0.0.1", "--port", str(url.port or 8000)]
    print(f"[bench serve] launching: {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return proc, cmd
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop(proc)
    raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s")


def stop(proc) -> None:
    """Interrupt the launched server (uvicorn shuts down on SIGINT), then kill it."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_serve_bench(args) -> int:
    """``python -m mrv2 bench serve``: sweep the rates, write JSON (and PNG), print a table."""
    from mrv2.bench.report import default_out_path, environment, write_json
    from mrv2.bench.workloads import make_workload

    try:
        rates = _rates(args.request_rate)
    except ValueError as exc:
        print(f"[bench] error: {exc}")
        return 2
    proc, cmd = None, None
    try:
        if args.launch:
            proc, cmd = launch(args.launch, shlex.split(args.launch_args or ""), args.base_url)
        info = _server_info(args.base_url)
        wl = make_workload(args.workload, info.get("vocab_size") or args.vocab_size,
                           seed=args.seed, num_requests=args.num_prompts or args.num_requests,
                           input_len=args.input_len, output_len=args.output_len,
                           tiny=args.tiny)
        temperature = 0.6 if args.temperature is None else args.temperature
        procs = args.client_procs
        asyncio.run(run_rate(args.base_url, info["id"], wl.prompts[:args.warmup_prompts],
                             [min(n, 16) for n in wl.output_lens[:args.warmup_prompts]],
                             math.inf, args.max_concurrency, args.seed, temperature, procs))
        rows = []
        for rate in rates:
            rows.append(asyncio.run(run_rate(args.base_url, info["id"], wl.prompts,
                                             wl.output_lens, rate, args.max_concurrency,
                                             args.seed, temperature, procs)))
            print(_row(rows[-1]), flush=True)
    finally:
        if proc is not None:
            stop(proc)
    results = {"benchmark": "serve", **environment(),
               "config": {"base_url": args.base_url, "request_rates": [r["request_rate"]
                                                                       for r in rows],
                          "max_concurrency": args.max_concurrency, "seed": args.seed,
                          "warmup_prompts": args.warmup_prompts, "temperature": temperature,
                          "client_procs": args.client_procs,
                          "launch": cmd},
               "server": info, "workload": wl.summary(), "rates": rows}
    out = args.out or default_out_path("serve", wl.name, args.tiny)
    path = write_json(results, out)
    print(f"[bench] wrote {path}")
    if args.plot:
        print(f"[bench] wrote {save_serve_plot(results, path.with_suffix('.png'))}")
    return 0 if all(r["completed"] for r in rows) else 1


def _row(r: dict) -> str:
    return (f"rate {r['request_rate']!s:>6} req/s | {r['completed']}/{r['num_prompts']} ok | "
            f"{r['output_tok_s']:9.1f} out tok/s | TTFT p50/p99 {r['ttft_ms']['p50'] or 0:8.1f}"
            f"/{r['ttft_ms']['p99'] or 0:8.1f} ms | TPOT p50/p99 {r['tpot_ms']['p50'] or 0:6.2f}"
            f"/{r['tpot_ms']['p99'] or 0:6.2f} ms | ITL p50 {r['itl_ms']['p50'] or 0:6.2f} ms")


def plot_serve(results, axes=None):
    """Output tok/s, TTFT and TPOT (p50 and p99) against the request rate (3 axes).

    Args:
        results: a ``bench serve`` results dict or JSON path.
        axes: three matplotlib axes (default: a new figure).

    Returns:
        The axes.
    """
    from mrv2.bench.plots import _title, load_results

    res = load_results(results)
    if axes is None:
        import matplotlib.pyplot as plt

        _, axes = plt.subplots(1, 3, figsize=(15, 4), layout="constrained")
    rows = res["rates"]
    labels = [str(r["request_rate"]) for r in rows]
    x = range(len(rows))
    axes[0].plot(x, [r["output_tok_s"] for r in rows], "o-", color="tab:green")
    axes[0].set_ylabel("output tokens / s")
    for ax, key, what in ((axes[1], "ttft_ms", "TTFT"), (axes[2], "tpot_ms", "TPOT")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][p] for r in rows], style, label=f"{what} {p}")
        ax.set_ylabel(f"{what} (ms)")
        ax.legend(fontsize=8)
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
    axes[0].set_title(_title(res, f"bench serve, {res['workload']['name']}"), fontsize=9)
    return axes


def save_serve_plot(results, path: str | os.PathLike):
    """Write ``plot_serve`` as a PNG; the path."""
    import pathlib

    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4), layout="constrained")
    plot_serve(results, fig.subplots(1, 3))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
