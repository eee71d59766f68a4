"""`esftctl bench serve`'s tables and plot, from its result dict (esftctl.bench.serve.finish, merged from the
slices by esftctl.bench.serve_slices: a partial grid prints what it has and lists what is missing)."""

from __future__ import annotations

import statistics

from esftctl.bench.load import REQUEST_KINDS


def tables(result: dict) -> list:
    out = [runs_table(result)]
    for table in (floors_table(result), requests_table(result), rounds_table(result), server_times_table(result),
                  modes_table(result), machine_table(result), micro_table(result), groups_table(result)):
        if table is not None:
            out.append(table)
    out.append(kv_table(result))
    load = next((res["adapter_load"] for res in result["servers"] if "adapter_load" in res), None)
    if load:
        out.append(load_table(load))
    for server, error in result["errors"].items():
        out.append(f"[red]{server} failed:[/red] {error}")
    note = slices_note(result)
    if note:
        out.append(note)
    compiled = {res["server"]: res["jit_compiles_in_runs"] for res in result["servers"]
                if res.get("jit_compiles_in_runs")}
    if compiled:
        out.append("[yellow]kernels compiled during measured runs (vLLM's JIT monitor; their runs carry the stalls):"
                   "[/yellow] " + ", ".join(f"{server} {n}" for server, n in compiled.items()))
    return out


def slices_note(result: dict) -> str | None:
    """How many of the planned slices are there, and the missing ones by server (None for a whole grid)."""
    if "slices" not in result:
        return None
    done = result["slices"]
    missing: dict[str, list[str]] = {}
    for m in result["missing"]:
        server, name = m.rsplit(" ", 1)
        missing.setdefault(server, []).append(name)
    head = (f"{result['grid']}: {done['present']} of {done['planned']} slices"
            + (f" ({done['failed']} failed)" if done["failed"] else ""))
    if not missing:
        return head + ", the grid is whole"
    return head + "; missing: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in missing.items())


def number(value, spec: str) -> str:
    """A value as a table cell in `spec`; "-" without one."""
    return "-" if value is None else format(value, spec)


def _throughput(r: dict) -> str:
    """Output tok/s, with its range over the rounds when there are several."""
    low, high = r.get("output_throughput_range") or (None, None)
    ranged = low is not None and len(r.get("rounds", ())) > 1
    return number(r["output_throughput"], ".0f") + (f" [{low:.0f}-{high:.0f}]" if ranged else "")


def percent(value, spec: str = ".0f") -> str:
    """A share (0-1) as a percent cell in `spec`; "-" without one."""
    return "-" if value is None else f"{100 * value:{spec}}%"


def runs_table(result: dict):
    from rich.table import Table

    c = result["config"]
    t = Table(title=f"serving on {c['device']}: {c['model']}, {c['input_len']} -> {c['output_len']} tokens per "
                    f"request; finite rates: {c['duration']:g} s of Gamma arrivals (cv {c['cv']:g}), inf: "
                    f"{c['prompts']} at once; vLLM bench serve; medians over rounds (each a fresh start of the "
                    f"server; 'rounds': the runs a row has, of {c['repeats']} planned rounds, the base's once more "
                    "on each further machine; tok/s with its range); ratios against plain vLLM serving the base "
                    "alone at the same rate, each round against the base's run of the same round (the same "
                    "traffic) on the same machine, their median ('k paired': only k of the rounds had one; 'k by "
                    "round': none had, k against the base's same round on another machine; 0 paired: the medians' "
                    "ratio across machines and rounds); TTFT mean x: the mean's (all at once, past --max-num-seqs, "
                    "the median lies between the first wave of prompts and the rest: read the mean); shares: the "
                    "drawn adapter shares against S-LoRA's alpha (chi-square p, worst share in standard errors)",
              title_justify="left")
    several = len(c.get("parallel", [1])) > 1
    for col in ("server", "scenario", "req", "rounds", "TTFT ms", "TTFT p99", "TTFT spread", "TPOT ms", "TPOT p99",
                "prefill tok/s", "decode tok/s", "tok/s", "TTFT x", "TTFT mean x", "TPOT x", "tok/s x",
                "shares p / z", "cv", *(["tok/s vs first"] if several else [])):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for res in result["servers"]:
        for r in res["rows"]:
            shares = r.get("shares")
            t.add_row(res["server"], r["scenario"], str(r.get("requests", "-")), _rounds(r),
                      number(r["median_ttft_ms"], ".1f"),
                      number(r["p99_ttft_ms"], ".1f"), percent(r.get("ttft_spread")),
                      number(r["median_tpot_ms"], ".2f"), number(r["p99_tpot_ms"], ".2f"),
                      number(r.get("median_prefill_tps"), ".0f"), number(r.get("median_decode_tps"), ".1f"),
                      _throughput(r),
                      *(number(r.get(k), ".3f")
                        for k in ("median_ttft_ratio", "ttft_ratio", "median_tpot_ratio", "throughput_ratio")),
                      f"{shares['p_value']:.2f} / {shares['worst_z']:.1f}" if shares else "-",
                      number(r.get("arrival_cv"), ".2f"), *([f"{r['throughput_vs_first']:.2f}"] if several else []))
    return t


def floors_table(result: dict):
    """The fastest tenth (esftctl.bench.load.floors: where a fixed cost per step shows at low load, undiluted by
    traffic) and vLLM's own decode time per token, with their ratios; None before any run kept its requests."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"] if r.get("p10_tpot_ms") is not None]
    if not rows:
        return None
    tokens = result["config"]["output_len"] - 1
    t = Table(title="the fastest tenth: the 10th percentile of the requests' TPOT (at low load, those that decoded "
                    "alone) and of the TTFT of prompts prefilled alone, and vLLM's decode time per token (its "
                    "histogram, engine-core timestamps: the engine's share of TPOT); medians over rounds, ratios "
                    "against plain vLLM's base as in the first table",
              title_justify="left")
    for col in ("server", "scenario", "TPOT p10 ms", "x", "vLLM decode ms/token", "x", "TTFT alone p10 ms", "x"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for server, r in rows:
        decode = r["server_decode_ms"] / tokens if r.get("server_decode_ms") is not None and tokens > 0 else None
        t.add_row(server, r["scenario"], number(r["p10_tpot_ms"], ".3f"), number(r.get("p10_tpot_ratio"), ".3f"),
                  number(decode, ".3f"), number(r.get("decode_time_ratio"), ".3f"),
                  number(r.get("p10_ttft_alone_ms"), ".1f"), number(r.get("p10_ttft_alone_ratio"), ".3f"))
    return t


def requests_table(result: dict):
    """Request by request (esftctl.bench.serve.request_paired): each request over the same request in plain vLLM's
    base run of its round, with 95% intervals; None before any row paired its requests."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"] if r.get("request_ratios")]
    if not rows:
        return None
    t = Table(title="request by request: each request's TTFT and TPOT over the same request (the same prompt sent at "
                    "the same time) in plain vLLM's base run of its round on the same machine; the median over the "
                    "paired requests with its 95% interval (a bootstrap over rounds, then requests: with one round "
                    "it covers the requests, not what a server's start moves); vLLM base: its run of a round on "
                    "another machine over its first, plain vLLM against itself",
              title_justify="left")
    for col in ("server", "scenario", "against", "rounds", "requests", "TTFT x", "TTFT x, both alone", "TPOT x"):
        t.add_column(col, justify="left" if col in ("server", "scenario", "against") else "right")
    for server, r in rows:
        q = r["request_ratios"]
        t.add_row(server, r["scenario"], q["against"], str(q["rounds"]), str(q["requests"]),
                  *(interval(q.get(kind)) for kind in REQUEST_KINDS))
    return t


def interval(m) -> str:
    """A median with its 95% interval (esftctl.bench.slices.clustered_median) as a cell; "-" without one."""
    return "-" if not m else f"{m[0]:.3f} [{m[1]:.3f}-{m[2]:.3f}]"


def rounds_table(result: dict):
    """The main ratios round by round (bench.serve.round_ratios), for the rows paired in two rounds or more, with
    the GPU busy share of each run and of its base run: a start whose engine waits on its host shows there. None
    where no row has two."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"] if len(r.get("by_round", ())) > 1]
    if not rows:
        return None
    letters: dict = {}  # machine -> A, B, ... in order of appearance
    for _, r in rows:
        for rnd in r["by_round"]:
            n = len(letters)
            letters.setdefault(rnd["machine"], chr(ord("A") + n) if n < 26 else f"M{n + 1}")
    t = Table(title="round by round: each round's ratios against plain vLLM's base run of the same round on the same "
                    "machine (the main table has their median), in round order; machines lettered in order of "
                    "appearance; GPU busy: nvidia-smi's utilization over the run, and the base run's",
              title_justify="left")
    for col in ("server", "scenario", "rounds", "machines", "TTFT mean x", "TPOT x", "tok/s x", "GPU busy %",
                "base's %"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for server, r in rows:
        runs = r["by_round"]
        t.add_row(server, r["scenario"], " ".join(str(rnd["round"]) for rnd in runs),
                  " ".join(letters[rnd["machine"]] for rnd in runs),
                  *(" / ".join(number(rnd.get(key), spec) for rnd in runs)
                    for key, spec in (("ttft_ratio", ".3f"), ("median_tpot_ratio", ".3f"), ("throughput_ratio", ".3f"),
                                      ("gpu_util", ".0f"), ("base_gpu_util", ".0f"))))
    return t


def server_times_table(result: dict):
    """Where the mean TTFT went (esftctl.bench.serve_runs.SERVER_TIMES): waiting to be scheduled, scheduled to
    first token, and the API server's share (the client's mean less vLLM's); medians over rounds. None before any
    run carried them."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"]
            if r.get("server_ttft_ms") is not None]
    if not rows:
        return None
    t = Table(title="inside the server (vLLM's per-request histograms, means over each run's requests, medians over "
                    "rounds): TTFT = queue + prefill + the API server's share (the client's mean TTFT less vLLM's)",
              title_justify="left")
    for col in ("server", "scenario", "client TTFT ms", "vLLM TTFT", "queue", "prefill", "API share", "decode ms"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for server, r in rows:
        api = r["mean_ttft_ms"] - r["server_ttft_ms"] if r.get("mean_ttft_ms") is not None else None
        t.add_row(server, r["scenario"], number(r.get("mean_ttft_ms"), ".1f"), number(r["server_ttft_ms"], ".1f"),
                  *(number(r.get(f"server_{k}_ms"), ".1f") for k in ("queue", "prefill")), number(api, ".1f"),
                  number(r.get("server_decode_ms"), ".0f"))
    return t


def modes_table(result: dict):
    """TTFT by what a prompt met (esftctl.bench.load.prefill_modes): the share prefilled alone, and each mode's
    median TTFT with its ratio against plain vLLM's base (medians over rounds). None before any run carried
    them."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"] if r.get("alone_share") is not None]
    if not rows:
        return None
    t = Table(title="TTFT by what the prompt met: alone (no other request in flight from its arrival to its first "
                    "token: a CUDA graph where the prompt fits the captured sizes) or beside others (a step shared "
                    "with decodes, eager past the captured sizes), and the stall such a step costs the requests "
                    "decoding beside it (their longest gap between tokens across it, esftctl.bench.load."
                    "prefill_stalls); medians over rounds, ratios against plain vLLM's base as in the first table",
              title_justify="left")
    for col in ("server", "scenario", "alone", "TTFT alone ms", "x", "TTFT beside ms", "x", "stall ms", "x"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for server, r in rows:
        t.add_row(server, r["scenario"], percent(r["alone_share"]), number(r.get("median_ttft_alone_ms"), ".1f"),
                  number(r.get("ttft_alone_ratio"), ".3f"), number(r.get("median_ttft_beside_ms"), ".1f"),
                  number(r.get("ttft_beside_ratio"), ".3f"), number(r.get("median_stall_ms"), ".1f"),
                  number(r.get("stall_ratio"), ".3f"))
    return t


def machine_table(result: dict):
    """The machine over each run (esftctl.bench.conditions): the GPU's SM clock (mean and 10th percentile),
    power, hottest temperature, how busy nvidia-smi found it (the share of time a kernel ran), the shares of
    samples it called idle or slowed down, and the host's CPU busy and steal shares; medians over rounds. None
    before any run carried them."""
    from rich.table import Table

    rows = [(res["server"], r) for res in result["servers"] for r in res["rows"]
            if r.get("gpu_sm_mhz") is not None or r.get("host_busy") is not None]
    if not rows:
        return None
    t = Table(title="the machine over each run (esftctl.bench.conditions: nvidia-smi every 100 ms, /proc/stat): "
                    "medians over rounds; GPU busy: nvidia-smi's utilization, the time a kernel ran (a GPU that waits "
                    "on its host is less busy for the same work); idle and slowed: the shares of samples whose clock "
                    "reasons say so (slowed: power cap, thermal or hardware slowdown); steal: CPU time the host's "
                    "other tenants took",
              title_justify="left")
    for col in ("server", "scenario", "SM MHz", "SM p10", "power W", "max C", "GPU busy", "idle", "slowed",
                "CPU busy", "steal"):
        t.add_column(col, justify="left" if col in ("server", "scenario") else "right")
    for server, r in rows:
        busy = r.get("gpu_util")
        t.add_row(server, r["scenario"], number(r.get("gpu_sm_mhz"), ".0f"), number(r.get("gpu_sm_mhz_p10"), ".0f"),
                  number(r.get("gpu_power_w"), ".0f"), number(r.get("gpu_temp_c"), ".0f"),
                  "-" if busy is None else f"{busy:.0f}%",
                  *(percent(r.get(k)) for k in ("gpu_idle_share", "gpu_slowdown_share", "host_busy")),
                  percent(r.get("host_steal"), ".1f"))
    return t


def _rounds(r: dict) -> str:
    n, paired, across = len(r.get("rounds", [0])), r.get("paired_rounds"), r.get("paired_across")
    if across:
        return f"{n} ({across} by round)"
    return str(n) if paired is None or paired == n else f"{n} ({paired} paired)"


def micro_table(result: dict):
    from rich.table import Table

    rows = [(res["server"] + (" (other machine)" if res.get("micro_across") else ""), k, m)
            for res in result["servers"] for k, m in (res.get("micro") or {}).items()]
    if not rows:
        return None
    c = result["config"]
    lengths, batches = [str(x) for x in c["micro_lengths"]], [str(x) for x in c["micro_batches"]]
    t = Table(title=f"microbenchmarks (ExpertWeave 5.3): median TTFT at batch 1 by prompt length, {c['micro_runs']} "
                    f"requests each; median TPOT over {c['decode_steps']} steps after a {c['decode_prompt']}-token "
                    "prompt by batch size; requests to the first adapter (or the base) with the given count "
                    "loaded; x: against plain vLLM's base (on the same machine unless the server says other); SM MHz: "
                    "the card's mean SM clock over them (esftctl.bench.conditions)",
              title_justify="left")
    for col in ("server", "loaded", *(f"TTFT @{n}" for n in lengths), *(f"TPOT @b{b}" for b in batches), "SM MHz"):
        t.add_column(col, justify="left" if col in ("server", "loaded") else "right")
    for server, loaded, m in rows:
        cells = [_cell(m, "ttft_ms", n, ".1f") for n in lengths] + [_cell(m, "tpot_ms", b, ".2f") for b in batches]
        t.add_row(server, loaded, *cells, number((m.get("machine") or {}).get("gpu_sm_mhz"), ".0f"))
    return t


def _cell(m: dict, what: str, key: str, spec: str) -> str:
    value, ratio = m[what].get(key), (m.get(f"{what}_ratio") or {}).get(key)
    return number(value, spec) + (f" ({ratio:.3f}x)" if ratio is not None else "")


def groups_table(result: dict):
    from rich.table import Table

    grouped = [(res["server"], res["groups"]) for res in result["servers"] if res.get("groups")]
    if not grouped:
        return None
    t = Table(title="adapter groups over the runs (the scheduler's own count): engine steps, steps that held some "
                    "adapter back, the most adapters vLLM scheduled in one step, the longest a request was held "
                    "back (steps in a row); admitted by adapter: the bound (s) and the steps whose queue it "
                    "reordered", title_justify="left")
    for col in ("server", "G", "W", "steps", "held-back steps", "most in a step", "longest wait", "admit s",
                "reordered"):
        t.add_column(col, justify="left" if col == "server" else "right")
    for server, g in grouped:
        t.add_row(server, *(number(g.get(k), spec) for k, spec in (
            ("most", "d"), ("wait", "d"), ("steps", ",d"), ("grouped_steps", ",d"), ("most_groups_scheduled", "d"),
            ("longest_wait", "d"), ("admit_by_adapter", "g"), ("reordered", ",d"))))
    return t


def kv_table(result: dict):
    from rich.table import Table

    kv = result["kv_cache"]
    t = Table(title="KV-cache room: tokens vLLM reports, and per adapter count (esftctl: the base's room less the "
                    "adapters' bytes; merged copies: bound on one GPU)", title_justify="left")
    for col in ("what", "KV tokens", "N merged copies", "esftctl / merged"):
        t.add_column(col, justify="left" if col == "what" else "right")
    for server, tokens in kv["reported"].items():
        t.add_row(f"{server} (reported)", f"{tokens:,}" if tokens else "-", "", "")
    if "esftctl_all_loaded_computed" in kv:
        t.add_row("esftctl, every adapter loaded (computed: checks the report)",
                  f"{kv['esftctl_all_loaded_computed']:,}", "", "")
    for n, row in kv.get("by_adapters", {}).items():
        merged = f"{row['merged_copies']:,}" if row["merged_copies"] else "do not fit"
        t.add_row(f"{n} adapter{'s' * (int(n) > 1)}", f"{row['esftctl']:,}", merged,
                  f"{row['ratio']:.2f}x" if row["ratio"] else "-")
    return t


def load_table(load: dict):
    from rich.table import Table

    from esftctl.runtime.engine_status import LOAD_PHASES as phases  # the engine's part of a load, medians
    from esftctl.units import format_bytes

    t = Table(title=f"`esftctl adapters load` of {load['adapter']} ({format_bytes(load['bytes'])})",
              title_justify="left")
    for col in ("from", "median s", "runs", "floor s", "x floor", *(f"engine {p} s" for p in phases),
                "outside the engine s"):
        t.add_column(col, justify="left" if col == "from" else "right")
    for kind, floor in (("cold", load["cold_floor_s"]), ("warm", load["floor_s"])):
        secs, engine = load["seconds"][kind], load.get("engine", {}).get(kind, [])
        outside = [total - sum(e.get(p, 0.0) for p in phases) for total, e in zip(secs, engine)]  # the load
        t.add_row(f"{kind} ({'disk' if kind == 'cold' else 'host memory'})", f"{statistics.median(secs):.3f}",
                  " ".join(f"{x:.3f}" for x in secs), f"{floor:.3f}", f"{statistics.median(secs) / floor:.1f}",
                  *(number(statistics.median(v) if (v := [e[p] for e in engine if p in e]) else None, ".3f")
                    for p in phases), number(statistics.median(outside) if outside else None, ".3f"))
    return t  # outside the engine: the load check's hash (middleware), HTTP, vLLM's own handling


def plot(result: dict, path) -> None:
    """Median TTFT and TPOT against plain vLLM's base, over the adapters requests are spread over (at the first
    alpha), one line per server and rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    first_alpha = result["config"]["alphas"][0]
    styles = ("o-", "s--", "^:", "d-.", "v-")
    for res in result["servers"]:
        rates = list(dict.fromkeys(r["rate"] for r in res["rows"]))
        for k, rate in enumerate(rates):
            rows = [r for r in res["rows"] if r["rate"] == rate and "DeepSeek" not in r["scenario"]
                    and (r["adapters"] <= 1 or r["alpha"] == first_alpha) and "median_tpot_ratio" in r]
            if len(rows) < 2:
                continue
            for ax, key in zip(axes, ("median_ttft_ratio", "median_tpot_ratio")):
                ax.plot([r["adapters"] for r in rows], [r[key] for r in rows], styles[k % len(styles)],
                        label=f"{res['server']} @ {rate}")
    for ax, what in zip(axes, ("TTFT", "TPOT")):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xlabel(f"adapters the requests are spread over (alpha {first_alpha:g})")
        ax.set_ylabel(f"median {what} / plain vLLM base")
        ax.set_title(f"{what}, {result['config']['device']}")
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
