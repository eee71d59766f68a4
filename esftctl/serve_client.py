"""Talking to a running `esftctl serve`: its models, its adapter table, loading and unloading adapters.

Plain HTTP against vLLM's own endpoints (/v1/models, /v1/load_lora_adapter, /v1/unload_lora_adapter) and
esftctl's /esftctl/status; errors come back as one-line EsftErrors carrying the server's message. A server
started with an API key wants it on every request (`Authorization: Bearer KEY`): every call takes `api_key`, which
the command line reads from `--api-key` or API_KEY_ENV (an environment variable keeps it out of `ps`).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table

from esftctl.errors import EsftError
from esftctl.runtime.engine_status import LOADED_FROM, EngineStatus
from esftctl.runtime.serve_config import API_KEY_ENV
from esftctl.units import format_bytes

DEFAULT_URL = "http://127.0.0.1:8000"


def request(url: str, path: str, body: dict | None = None, timeout: float = 600, *, api_key: str | None = None
            ) -> dict | str:
    """GET (no body) or POST JSON, with the server's API key if given; the decoded JSON reply, or its text when it
    is not JSON."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EsftError("not a server URL (expected http://HOST:PORT)", url)
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as reply:
            text = reply.read().decode()
    except urllib.error.HTTPError as e:
        message = _error_message(e.read().decode(errors="replace"))
        if e.code == 401:
            message += (f"; give the server's API key (--api-key or ${API_KEY_ENV})" if not api_key else
                        "; the server refused this API key")
        raise EsftError(f"{path}: {message} (HTTP {e.code})", url) from None
    except (urllib.error.URLError, OSError) as e:
        raise EsftError(f"cannot reach the server ({getattr(e, 'reason', e)})", url) from None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _error_message(text: str) -> str:
    try:
        error = json.loads(text).get("error", {})
        message = error.get("message") if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        message = None
    message = " ".join((message or text or "no message").split())
    # An engine-side refusal arrives wrapped: "Call to add_lora method failed: Worker failed with error '...'"
    inner = re.search(r"Worker failed with error '(.*)', please check", message)
    return inner.group(1) if inner else message


def models(url: str, *, api_key: str | None = None) -> list[str]:
    return [m["id"] for m in request(url, "/v1/models", api_key=api_key)["data"]]


def status(url: str, *, api_key: str | None = None) -> dict:
    """The server's status as it sends it (JSON; EngineStatus.from_json reads it)."""
    return request(url, "/esftctl/status", api_key=api_key)


def engine_status(url: str, *, api_key: str | None = None) -> EngineStatus:
    return EngineStatus.from_json(status(url, api_key=api_key))


def load(url: str, name: str, bundle: Path, *, api_key: str | None = None) -> str:
    from esftctl.names import check_name

    check_name(name)
    return str(request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(Path(bundle).resolve())},
                       api_key=api_key))


def unload(url: str, name: str, *, api_key: str | None = None) -> str:
    return str(request(url, "/v1/unload_lora_adapter", {"lora_name": name}, api_key=api_key))


def status_table(status: EngineStatus | dict, served: list[str] | None = None) -> Group:
    """Adapters, slots, experts per layer, and the memory they take against padding and merged copies; readable at
    80 columns (names fold rather than being cut; a load's phases are in `esftctl adapters list --json`)."""
    s = status if isinstance(status, EngineStatus) else EngineStatus.from_json(status)
    adapters = [a for a in s.adapters if not a.name.startswith("warmup_")]
    title = f"{len(adapters)} adapter(s) in {s.slots} slots, {len(s.moe_layers)} MoE layers, {s.device}: {s.base}"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("adapter", overflow="fold", min_width=12)
    for col in ("slot", "experts per layer", "total", "rows checked", "bytes", "loaded in"):
        table.add_column(col.replace(" ", "\n", 1), justify="left" if col in ("experts per layer", "loaded in")
                         else "right", no_wrap=True)
    if served:
        table.add_row(served[0], "base", "-", "-", "-", format_bytes(s.model_bytes), "")
    for a in adapters:
        counts = a.experts_per_layer
        name = f"{a.name} (retiring)" if a.retiring else a.name
        name += f" +shared ({a.shared_layers} layers)" if a.shared_layers else ""
        name += f" +{a.modules} modules" if a.modules else ""
        table.add_row(name, str(a.slot), _counts(counts), str(sum(counts)), str(a.checked_rows or "-"),
                      format_bytes(a.bytes), _load_time(a))
    if s.variants:
        table.add_section()
        for v in s.variants:
            counts = v.experts_per_layer
            table.add_row(f"{v.name} (variant)", "home" if v.home else str(v.slot), _counts(counts),
                          str(sum(counts)), "-", format_bytes(v.bytes), "")
    return Group(table, _memory_table(s), *([_ranks_table(s.per_rank)] if s.per_rank else []))


SOURCES = dict(zip(LOADED_FROM, ("cache", "file", "file*")))  # whence a load took its rows, short


def _load_time(a) -> str:
    """The engine's seconds for an adapter's last load and whence it came, short: "2.10 s file" (hashed), "file*"
    (verified before, by the launcher or the load check), "cache" (the host cache); its phases are in the JSON."""
    if not a.load_s:
        return "-"
    return f"{sum(a.load_s.values()):.2f} s {SOURCES.get(a.loaded_from, a.loaded_from)}"


def _memory_table(s: EngineStatus) -> Table:
    physical, kv = s.adapter_physical_bytes, s.kv_cache_tokens
    memory = Table(title="memory", title_justify="left", show_header=False)
    memory.add_column("what")
    memory.add_column("value", justify="right")
    memory.add_row("adapter experts, their own bytes", format_bytes(s.adapter_expert_bytes))
    if s.adapter_budget_bytes is not None:
        memory.add_row("adapter memory budget (--adapter-memory)", format_bytes(s.adapter_budget_bytes))
    if s.reserved_bytes:
        memory.add_row("GPU memory set aside before the KV cache", format_bytes(s.reserved_bytes))
    if physical is not None:
        memory.add_row("adapter experts, physical (virtual tensors)", format_bytes(physical))
        memory.add_row("saved vs padding to the widest adapter", format_bytes(max(s.padded_bytes - physical, 0)))
        memory.add_row("saved vs a merged copy per adapter", format_bytes(max(s.merged_bytes - physical, 0)))
    else:  # paged: what each tier holds now, base and adapters together
        p = s.paging
        memory.add_row(f"experts on the device now (paging window {s.paging_window}, fetch {p.fetch})",
                       format_bytes(s.expert_device_bytes))
        parked = f" ({len(p.parked_layers)} layers alone in theirs: parked, fetching nothing)" \
            if p.parked_layers else ""
        memory.add_row(f"  the window's blocks{parked}", format_bytes(p.window_bytes))
        memory.add_row(f"  {len(p.resident_layers)} layers kept resident", format_bytes(p.resident_bytes))
        memory.add_row("  adapter rows of the paged layers (on the device, never fetched)",
                       format_bytes(p.adapter_bytes))
        codec = {"huffman": "Huffman store, ", "fixed": "fixed-rate, ",
                 "fixed-host": "fixed-rate codes' tables; the codes on the host, "}.get(p.store_codec, "")
        memory.add_row(f"  compressed tier on the GPU ({codec}{p.store_experts} base experts per layer)",
                       format_bytes(p.store_bytes))
        if p.store_codec == "fixed-host":
            held = "the base experts' fixed-rate codes" + (" and bf16 copies" if p.host_base_rows else "")
            memory.add_row(f"host tier (pinned: {held})", format_bytes(p.host_bytes))
        else:
            copies = "the base experts" if p.host_base_rows else "none: the compressed tier has the base"
            memory.add_row(f"host tier (pinned copies of {copies})", format_bytes(p.host_bytes))
        bought = f" = {p.freed_kv_tokens:,} KV tokens" if p.freed_kv_tokens is not None else ""
        memory.add_row("expert memory paging leaves to the KV cache", format_bytes(p.freed_bytes) + bought)
        per_fetch = p.fetched_rows / p.fetches if p.fetches else 0.0
        memory.add_row("experts fetched per layer and step", f"{per_fetch:.1f} of {p.held_rows} ({p.fetches:,} "
                                                             "fetches so far)")
    if s.shared_copies:
        held = sum(1 for a in s.adapters if a.shared_layers)
        memory.add_row(f"shared-expert copies ({held} of {s.shared_copies} held)", format_bytes(s.shared_copy_bytes))
    if s.module_copies and s.variants:  # serve --one-step
        memory.add_row(f"variants' copies of the modules that differ ({s.module_copies} variants)",
                       format_bytes(s.module_copy_bytes))
    elif s.module_copies:
        held = sum(1 for a in s.adapters if a.modules)
        memory.add_row(f"module copies ({held} of {s.module_copies} held)", format_bytes(s.module_copy_bytes))
    if s.variants and not s.module_copies:
        memory.add_row("variants' non-expert weights, kept for switching", format_bytes(s.variant_switch_bytes))
    memory.add_row("KV cache", f"{kv:,} tokens" if kv else "not allocated yet")
    return memory


def _ranks_table(per_rank: list[dict | None]) -> Table:
    """Tensor or expert parallelism: each rank's part of the experts (the tables above count rank 0's)."""
    table = Table(title=f"memory per rank ({len(per_rank)} ranks; bytes above are rank 0's)",
                  title_justify="left")
    for col in ("rank", "device", "base experts", "adapter experts", "adapter experts, physical", "experts now"):
        table.add_column(col, justify="left" if col == "device" else "right")
    for r, s in enumerate(per_rank):
        if s is None:
            table.add_row(str(r), "not reported yet", "", "", "", "")
            continue
        physical = s["adapter_physical_bytes"]
        table.add_row(str(r), s["device"], format_bytes(s["base_expert_bytes"]),
                      format_bytes(s["adapter_expert_bytes"]), "paged" if physical is None else format_bytes(physical),
                      format_bytes(s["expert_device_bytes"]))
    return table


def _counts(counts: list[int]) -> str:
    if len(counts) <= 4:
        return " ".join(map(str, counts))
    return f"{min(counts)}-{max(counts)} ({sum(counts) / len(counts):.1f})"  # range (mean)


def ask_all(url: str, asks: list[tuple[str, dict]], *, max_tokens: int, api_key: str | None = None) -> list[str]:
    """Send every (model, example) as a greedy completion of the example's prompt, all at once; the answers."""
    from concurrent.futures import ThreadPoolExecutor

    def ask(job):
        model, example = job
        reply = request(url, "/v1/completions", {"model": model, "prompt": example["prompt"],
                                                 "max_tokens": max_tokens, "temperature": 0}, api_key=api_key)
        return reply["choices"][0]["text"]

    with ThreadPoolExecutor(len(asks)) as pool:
        return list(pool.map(ask, asks))


def answers_table(asks: list[tuple[str, dict]], answers: list[str], *, title: str) -> Table:
    """The answers against the examples' completions (the recipes' last step)."""
    table = Table(title=title)
    for col in ("model", "task", "prompt", "expected", "answer", "right"):
        table.add_column(col)
    for (model, example), answer in zip(asks, answers):
        right = answer.strip() == example["completion"].strip()
        table.add_row(model, example.get("task", ""), example["prompt"], example["completion"], answer,
                      "[green]yes[/]" if right else "[red]no[/]")
    return table
