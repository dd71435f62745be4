"""bench/protocol_attacks.py's report: what became of each attack, and the markdown rows of docs/RELIABILITY.md
("A front proxy") from runs made with --before-repo."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def outcome(r: dict) -> str:
    """What became of the attack (or of the overload's calls)."""
    a, who, attack = r["attacker"], r["authorised"], r["attack"]
    if attack.startswith("overload"):
        refused, answered = a.get("RESOURCE_EXHAUSTED", {}), a.get("OK", {})
        others = {code: v["calls"] for code, v in a.items() if code not in ("OK", "RESOURCE_EXHAUSTED")}
        return (f"{answered.get('calls', 0)} answered, {refused.get('calls', 0)} refused in "
                f"{refused.get('p50_ms')}/{refused.get('p99_ms')} ms" + (f", {others}" if others else "")
                + f"; the authorised client refused in {who.get('refused_p50_ms')}/{who.get('refused_p99_ms')} ms")
    if attack == "none":
        return "no attack"
    if attack == "wrong-tokens":
        return (f"{a['answered']} of {a['calls']} answered in {a['elapsed_s']} s, {r['server_auth_failures']} by the "
                f"server") + (f", {a['connections_refused']} connections not accepted" if a.get("connections_refused")
                              else "")
    if attack in ("idle", "idle-many"):
        return f"{a['kept']} of {a['opened']} kept after {a['kept_after_s']} s"
    if attack in ("half-open", "slow-headers"):
        return f"{a['closed']} of {a['opened']} closed within {a['within_s']} s" + (
            f" (median {a['median_closed_s']} s)" if a["closed"] else "")
    if attack.startswith("withheld-body"):
        ends = ", ".join(f"{n} {code}" for code, n in a["stream_ends"].items()) or "none"
        return f"{a['calls']} calls on {a['connections']} connections; ended: {ends}"
    if attack == "zero-window":
        ends = ", ".join(f"{n} {code}" for code, n in a["stream_ends"].items()) or "none"
        return f"{a['connections_ended']} of {a['of']} connections ended within {a['elapsed_s']} s; calls ended: {ends}"
    first = a.get("first", a) or {}
    ended = "kept open" if first.get("closed_after_s") is None else f"ended after {first['closed_after_s']} s"
    goaway = f"GOAWAY {first['goaway_code']}, " if first.get("goaway_code") is not None else ""
    cell = "first connection " + goaway + ended
    if "connections" in a:
        cell += f"; {a['connections']} connections" + (f", {a['not_accepted']} not accepted" if a.get("not_accepted")
                                                        else "")
    return cell


def refusals(r: dict) -> int:
    """The authorised client's calls refused (of about 50 a second)."""
    return sum(r["authorised"]["errors"].values())


def table(reports: list[Path]) -> str:
    """Markdown rows from reports made with --before-repo, each a run of both setups: `| attack | before | after |
    authorised p99 ms | authorised refused | server cores | proxy cores |`, the figures `before / after`, one pair
    per run (`; ` between runs); what became of the attack from the first run."""
    runs = [json.loads(path.read_text())["results"] for path in reports]
    rows: dict[tuple[str, bool], list[dict[str, dict]]] = {}
    for i, results in enumerate(runs):
        for r in results:
            pairs = rows.setdefault((r["attack"], r["tls"]), [{} for _ in runs])
            pairs[i][r["setup"]] = r

    def figures(pairs: list[dict[str, dict]], pick: Callable[[dict], object]) -> str:
        return "; ".join(" / ".join(str(pick(p[k])) if k in p else "-" for k in ("before", "after")) for p in pairs)

    out = []
    for (attack, tls), pairs in rows.items():
        first = pairs[0]
        cells = [outcome(first[k]) if k in first else "" for k in ("before", "after")]
        out.append(f"| {attack}{' (TLS)' if tls else ''} | {cells[0]} | {cells[1]} | "
                   f"{figures(pairs, lambda r: r['authorised']['p99_ms'])} | {figures(pairs, refusals)} | "
                   f"{figures(pairs, lambda r: r['server_cpu_cores'])} | "
                   f"{'; '.join(str(p['after'].get('proxy_cpu_cores', '-')) for p in pairs if 'after' in p)} |")
    return "\n".join(out)
