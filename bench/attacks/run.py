"""bench/protocol_attacks.py's run of one attack: a fresh server (and proxy), the authorised client beside the
attacker, and what the attack cost them (CPU, memory, threads, the calls answered)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from attacks import TOKEN
from attacks.floods import ping_flood, rapid_reset, rapid_reset_anon, settings_flood, window_overflow, wrong_tokens
from attacks.slow import half_open, idle, idle_many, slow_headers, withheld_body, withheld_body_anon, zero_window

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "protocol_attacks.py"  # the authorised client and the overload run as its --probe, --load
ATTACKS = ["none", "ping-flood", "settings-flood", "rapid-reset", "rapid-reset-anon", "wrong-tokens", "idle",
           "idle-many", "half-open", "slow-headers", "withheld-body", "withheld-body-anon", "zero-window",
           "window-overflow", "overload", "overload-rate"]
TIMED = ("idle", "idle-many", "half-open", "slow-headers", "withheld-body", "withheld-body-anon", "zero-window")
TIMED_S = 12.0  # past the 10 s of the server's body_timeout_s and handshake_timeout_s, and the proxy's timeouts


def no_attack(port: int, seconds: float, tls_ca: Path | None) -> dict:
    """The authorised client alone: the CPU without an attacker, to subtract from the attacks' figures."""
    time.sleep(seconds)
    return {}


RUN = {"none": no_attack, "ping-flood": ping_flood, "settings-flood": settings_flood, "rapid-reset": rapid_reset,
       "rapid-reset-anon": rapid_reset_anon, "wrong-tokens": wrong_tokens, "idle": idle, "idle-many": idle_many,
       "half-open": half_open, "slow-headers": slow_headers, "withheld-body": withheld_body,
       "withheld-body-anon": withheld_body_anon, "zero-window": zero_window, "window-overflow": window_overflow}


NO_LIMIT = 1_000_000_000  # a per-address limit of the proxy's that nothing reaches


class Setup:
    """Where the clients call: the server of `repo` alone, or behind the proxy's image (`model_calls` set)."""

    def __init__(self, name: str, repo: Path, model_calls: int | None = None, source_limit: int | None = None,
                 server_args: str = "") -> None:
        self.name, self.repo, self.model_calls, self.source_limit = name, repo, model_calls, source_limit
        self.server_args = server_args.split()

    def proxy_settings(self, attack: str, pem: Path | None) -> dict[str, object]:
        """deploy/proxy/haproxy.cfg's settings: its defaults but MODEL_CALLS, and the call rate per address lifted
        for the overloads (their load is one address standing for many clients) unless a limit is given."""
        settings: dict[str, object] = {"MODEL_CALLS": self.model_calls}
        if self.source_limit is not None:
            settings["CALLS_PER_SOURCE_S"] = self.source_limit
        elif attack.startswith("overload"):
            settings["CALLS_PER_SOURCE_S"] = NO_LIMIT
        if pem is not None:
            settings["PROXY_TLS_CERT"] = pem
        return settings


def rss_mib(processes: list) -> float:
    import psutil

    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20



def helper(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, text=True, cwd=REPO)


def run_attack(name: str, setup: Setup, args: argparse.Namespace, certs: dict[str, Path] | None) -> dict:
    from serving_fixtures import FrontProxy, ServerProcess

    proxied = setup.model_calls is not None
    tls = ["--tls-cert", str(certs["server"]), "--tls-key", str(certs["server_key"])] if certs and not proxied else []
    behind = ["--behind-proxy"] if proxied else []  # as deployed (deploy/proxy/haproxy.cfg)
    server = ServerProcess(args.bundle, "--metrics-port", "0", "--device", "cpu", *tls, *behind,
                           *setup.server_args, repo=setup.repo, env={"SENTIMENT_AUTH_TOKEN": TOKEN},
                           cpus=args.server_cpus)
    server.wait_listening()
    tls_ca = certs["ca"] if certs else None
    proxy = None
    try:
        port = server.port
        if proxied:
            proxy = FrontProxy(server.port, setup.proxy_settings(name, certs["proxy_pem"] if certs else None),
                               cpus=args.server_cpus)
            port = proxy.port
        seconds = max(args.seconds, TIMED_S) if name in TIMED else args.seconds
        overload = name.startswith("overload")
        probe = helper("--probe", str(port), "--seconds", str(seconds + 2), "--interval", str(args.probe_interval),
                       *(["--tls-ca", str(tls_ca)] if tls_ca else []))
        assert probe.stdout is not None and probe.stdout.readline().strip() == "ready", "the probe did not start"
        load = None
        if overload:
            rate = ["--rate", str(args.overload_rate)] if name == "overload-rate" else []
            load = helper("--load", str(port), "--callers", "500", "--texts", "64", "--seconds", str(seconds), *rate)
        codes0, auth0 = server.codes(), server.metric("sentiment_auth_failures_total") or 0.0
        proxy_cpu0 = proxy.cpu_seconds() if proxy else 0.0
        cpu0, t0, threads = server.cpu_seconds(), time.monotonic(), [server.threads()]
        peaks = {"server": 0.0, "proxy": 0.0}
        sampler_stop = threading.Event()

        def sample() -> None:
            while not sampler_stop.wait(0.1):
                threads.append(server.threads())
                peaks["server"] = max(peaks["server"], rss_mib(server._tree()))
                if proxy is not None:
                    peaks["proxy"] = max(peaks["proxy"], rss_mib([proxy.haproxy]))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        if load is not None:
            outcome = json.loads(load.communicate(timeout=seconds + 120)[0])
        else:
            outcome = RUN[name](port, seconds, tls_ca)
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))  # CPU over the whole window, after a cut too
        wall = time.monotonic() - t0
        cpu = server.cpu_seconds() - cpu0
        proxy_cpu = (proxy.cpu_seconds() if proxy else 0.0) - proxy_cpu0
        sampler_stop.set()
        sampler.join(1)
        authorised = json.loads(probe.communicate(timeout=60)[0])
        codes = {k: int(v - codes0.get(k, 0.0)) for k, v in server.codes().items() if v > codes0.get(k, 0.0)}
        auth_failures = int((server.metric("sentiment_auth_failures_total") or 0.0) - auth0)
        warnings = [line.strip() for line in server.lines if " WARNING " in line or "WARNING:" in line]
        return {"attack": name, "setup": setup.name, "server_repo": str(setup.repo), "proxy": proxied,
                "model_calls": setup.model_calls, "tls": certs is not None, "wall_s": round(wall, 2),
                "server_cpu_cores": round(cpu / wall, 2), "server_threads_max": max(threads),
                "server_rss_mib_max": round(peaks["server"], 1), "server_codes": codes,
                "server_auth_failures": auth_failures,
                **({"proxy_cpu_cores": round(proxy_cpu / wall, 2), "proxy_rss_mib_max": round(peaks["proxy"], 1)}
                   if proxy is not None else {}),
                "server_alive": server.proc.poll() is None, "attacker": outcome, "authorised": authorised,
                "server_warnings": warnings[:3]}
    finally:
        if proxy is not None:
            proxy.close()
        try:
            server.stop(30)
        finally:
            server.close()
