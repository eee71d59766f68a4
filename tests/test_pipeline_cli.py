"""`esftctl --help` and `esftctl inspect` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import run_cli
from test_formats_checkpoint import EXPECTED


def test_help_lists_commands():
    proc = run_cli("--help", check=True)
    assert "inspect" in proc.stdout
    proc = run_cli("inspect", "--help", check=True)
    assert "--json" in proc.stdout


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_inspect_json(tiny_models, arch):
    d = json.loads(run_cli("inspect", tiny_models[arch], "--json", check=True).stdout)
    assert d["num_moe_layers"] == len(EXPECTED[arch]["moe_layers"])
    assert d["routed_experts_per_layer"] == EXPECTED[arch]["experts"]
    assert d["expert_bytes"] == 3 * 256 * EXPECTED[arch]["inter"] * 2


def test_inspect_table_on_tiny_world(world):
    out = run_cli("inspect", world.base_dir, check=True).stdout
    assert "deepseek_v2" in out
    row = next(line for line in out.splitlines() if "routed experts per layer" in line)
    assert row.split("│")[2].strip() == "64"
    d = json.loads(run_cli("inspect", world.base_dir, "--json", check=True).stdout)
    assert (d["num_layers"], d["moe_layers"], d["routed_experts_per_layer"], d["top_k"]) == (4, [1, 2, 3], 64, 6)
    assert d["shared_experts_per_layer"] == 2
    assert d["expert_bytes"] == 3 * 256 * 64 * 2


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    proc = run_cli("inspect", tmp_path / "missing")
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0
    assert "missing: no such file or folder (PATHS of `esftctl inspect`)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, what", [
    (("inspect", "M"), "PATHS of `esftctl inspect`"), (("pack", "M", "M", "-o", "o", "-n", "n"), "BASE of"),
    (("merge", ".", "M", "-o", "o"), "BUNDLE of"), (("serve", "M"), "BASE of `esftctl serve`"),
    (("serve", ".", "--variants", "M"), "--variants of"), (("compress", "M", "-o", "o"), "SOURCE of"),
    (("consolidate", ".", "M", "-o", "o", "--capacity", "1"), "MODELS of"),
    (("adapters", "load", "a", "M"), "BUNDLE of `esftctl adapters load`")])
def test_a_missing_input_is_named_before_any_heavy_import(tmp_path, args, what):
    """A mistyped path is one line naming it and what it was given as, from the command line's parsing: before the
    commands import torch or vLLM (3-4 s), in well under a second."""
    code = ("import sys, time; t = time.perf_counter(); sys.argv = ['esftctl', *sys.argv[1:]]\n"
            "from esftctl.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n"
            "    assert 'torch' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)[:5]\n"
            "    raise\n")
    missing = str(tmp_path / "missing")
    proc = subprocess.run([sys.executable, "-c", code, *(missing if a == "M" else a for a in args)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {missing}: no such file or folder ({what}"), proc.stderr


def test_a_port_out_of_range_is_one_line(world):
    """Issue 32, item 12: `serve --port 70000` and `--port -5` ended in a traceback (OverflowError from bind)."""
    for port in ("70000", "-5", "0"):
        proc = run_cli("serve", world.base_dir, "--port", port)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == f"error: --port {port}: choose a port in 1..65535", proc.stderr


def test_adapters_with_a_url_that_is_not_one_is_one_line(tmp_path):
    for args in (("adapters", "list"), ("adapters", "load", "a", tmp_path), ("adapters", "unload", "a")):
        proc = run_cli(*args, "--url", "notaurl")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == "error: notaurl: not a server URL (expected http://HOST:PORT)", proc.stderr


def test_compress_of_a_float32_model_names_the_model(tiny_models, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    model = tmp_path / "fp32"
    shutil.copytree(tiny_models["mixtral"], model)
    for file in model.glob("*.safetensors"):
        save_file({k: t.float() for k, t in load_file(file).items()}, file, metadata={"format": "pt"})
    assert next(iter(load_file(next(model.glob("*.safetensors"))).values())).dtype == torch.float32
    proc = run_cli("compress", model, "--out", tmp_path / "store")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"error: {model}: tensor ") and "only bf16 expert weights" in proc.stderr
    assert not (tmp_path / "store").exists() and list(tmp_path.iterdir()) == [model]


def test_one_name_rule_for_pack_serve_and_load(world, tmp_path):
    """Issue 18, item 5: a name with a space is refused alike by pack, serve and adapters load, in one line. Issue 32,
    item 12: so is a name starting with '-' (vLLM read `--lora-modules -dash=PATH` as an option, 18 s later)."""
    for args in (("pack", world.base_dir, world.base_dir, "--out", tmp_path / "b", "--name", "a b"),
                 ("pack", world.base_dir, world.base_dir, "--out", tmp_path / "b", "--name", "-dash"),
                 ("serve", world.base_dir, "--adapter", f"a b={tmp_path}"),
                 ("serve", world.base_dir, "--adapter", f"-dash={tmp_path}"),
                 ("serve", world.base_dir, "--name", "my base"),
                 ("serve", world.base_dir, "--name", ".."),
                 ("adapters", "load", "a b", tmp_path, "--url", "http://127.0.0.1:9"),
                 ("adapters", "load", "--url", "http://127.0.0.1:9", "--", "-dash", tmp_path)):
        proc = run_cli(*args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert "use 1-128 letters, digits, '.', '_' and '-'" in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "b").exists()


def test_outputs_are_checked_before_the_work(world, tmp_path):
    """Issue 18, items 8 and 9: a bad --out is one line and exit 1 before any work, nothing is left behind, and
    relevance/select refuse an existing output without --overwrite like every other command."""
    data = world.data_file(world.task_names[0], "test")
    scores = tmp_path / "scores.json"
    run_cli("relevance", world.base_dir, data, "--out", scores, "--max-examples", "8", check=True)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (("relevance", world.base_dir, data, "--out", scores), "output already exists"),
        (("select", scores, "--out", scores), "output already exists"),
        (("relevance", world.base_dir, data, "--out", tmp_path, "--overwrite"), "output is a folder"),
        (("select", scores, "--out", tmp_path, "--overwrite"), "output is a folder"),
        (("pack", world.base_dir, world.base_dir, "--name", "x", "--out", a_file / "b"), "cannot write the output"),
        (("pack", world.base_dir, world.base_dir, "--name", "x", "--out", "/proc/b"), "cannot write the output"),
        (("merge", world.base_dir, tmp_path, "--out", a_file, "--overwrite"), "output is a file"),
        (("compress", world.base_dir, "--out", a_file / "s"), "cannot write the output here"),
    ]
    for args, message in cases:
        proc = run_cli(*args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "scores.json"]  # no .tmp-* or probe left
    run_cli("select", scores, "--out", scores, "--overwrite", check=True)


def test_a_full_disk_is_one_line_and_leaves_nothing(world, tmp_path, monkeypatch, capsys):
    """Issue 19, item 3: the disk filling up halfway through `compress` (ENOSPC from a write) ends the command
    with one line naming the file and exit status 1, and the half-written store is gone."""
    import errno
    import sys

    from esftctl import cli
    from esftctl.formats import store

    class FillingFile:  # store.bin's file, full after 1 MiB (written from the store's writer thread)
        def __init__(self, path, mode):
            self.file, self.written = open(path, mode), 0

        def write(self, data):
            self.written += memoryview(data).nbytes
            if self.written > 1 << 20:
                raise OSError(errno.ENOSPC, "No space left on device", self.file.name)
            return self.file.write(data)

        def close(self):
            self.file.close()

    monkeypatch.setattr(store, "open", FillingFile, raising=False)
    monkeypatch.setattr(sys, "argv", ["esftctl", "compress", str(world.base_dir), "--out", str(tmp_path / "store")])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert "store.bin: No space left on device (nothing was written)" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_written_files_take_the_umask_modes(world, tmp_path):
    """Issue 18, item 13: every file of an output has the umask's mode (safetensors wrote 0600)."""
    from esftctl.world.synthetic import write_synthetic_adapter

    bundle = write_synthetic_adapter(world.base_dir, tmp_path / "bundle", "t", seed=1, experts_per_layer=1)
    modes = {p.name: p.stat().st_mode & 0o777 for p in bundle.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_sigterm_during_a_write_leaves_nothing(world, tmp_path):
    """Issue 18, item 13: SIGTERM while `compress` writes removes its temporary folder, as Ctrl-C does."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "esftctl.cli", "compress", world.base_dir, "--out",
                             tmp_path / "store", "--chunk", "16"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".store.tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "compress ended before its temporary folder was seen"
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_explicit_cpu_kv_cache_wins_over_the_environment(world, monkeypatch, tmp_path):
    """Issue 18, item 12: --cpu-kv-cache-gib beats VLLM_CPU_KVCACHE_SPACE; without it the variable holds."""
    from esftctl.serve import free_port, plan

    def env(**options):
        return plan(world.base_dir, [], port=free_port(), state_dir=tmp_path, **options).env()

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert env(cpu_kv_cache_gib=2.5)["VLLM_CPU_KVCACHE_SPACE"] == "2.5"
    assert env()["VLLM_CPU_KVCACHE_SPACE"] == "7"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert env()["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_pack_on_the_wrong_base_says_so(world, tmp_path):
    """Issue 18, item 7: packing a fine-tune against another base of the same shapes is refused as such, with or
    without --include-non-expert; a router-only change is called a router change and names a router tensor."""
    from esftctl.formats.checkpoint import MoECheckpoint, write_checkpoint
    from esftctl.merge import merge
    from esftctl.world.synthetic import write_synthetic_adapter, write_synthetic_variant

    bundle = write_synthetic_adapter(world.base_dir, tmp_path / "bundle", "t", seed=1, experts_per_layer=2)
    tuned = merge(world.base_dir, bundle, tmp_path / "tuned")
    other = write_synthetic_variant(world.base_dir, tmp_path / "other", seed=2, experts_per_layer=64,
                                    non_expert_scale=0.1)
    for extra in ((), ("--include-non-expert",)):
        proc = run_cli("pack", other, tuned, "--name", "t", "--out", tmp_path / "b", *extra)
        assert proc.returncode == 1 and "does not come from this base" in proc.stderr, proc.stderr
        assert "192 of its 192 routed experts differ" in proc.stderr
    base = MoECheckpoint(world.base_dir)
    router = base.arch.router_tensor(base.moe_layers[0])
    routed = write_checkpoint(base, tmp_path / "routed", {router: base.read_tensor(router) * 2})
    proc = run_cli("pack", world.base_dir, routed, "--name", "t", "--out", tmp_path / "b")
    assert proc.returncode == 1 and f"changed the router (1 tensors, e.g. {router!r})" in proc.stderr, proc.stderr
    assert not (tmp_path / "b").exists()


def test_slot_rows_are_pooled_at_start_as_when_loading(world, tmp_path):
    """Issue 18, item 4: rows are pooled per layer, at start as for `adapters load` while serving (where a layer
    takes any free rows): an adapter wider than --experts-per-slot is served if the layer has the rows."""
    import mmap

    import torch

    from esftctl.errors import EsftError
    from esftctl.runtime.address_space import HostAddressSpace
    from esftctl.runtime.moe_layer import VirtualMoELayer
    from esftctl.serve import free_port, plan
    from esftctl.world.synthetic import write_synthetic_adapter

    specs = [f"a{k}={write_synthetic_adapter(world.base_dir, tmp_path / f'a{k}', f'a{k}', seed=k, experts_per_layer=n)}"
             for k, n in enumerate((2, 4, 6))]
    assert plan(world.base_dir, specs, slots=3, experts_per_slot=4, port=free_port()).experts_per_slot == 4
    with pytest.raises(EsftError, match="= 9 expert rows per layer cannot hold the 12"):
        plan(world.base_dir, specs, slots=3, experts_per_slot=3, port=free_port())
    # The engine's rule: a layer of 2 slots x 2 rows loads a 3-expert adapter, then refuses 2 more.
    layer = VirtualMoELayer(8, 4, 2, num_slots=2, experts_per_slot=2, dtype=torch.float32,
                            make_space=lambda n: HostAddressSpace(n, page_size=mmap.PAGESIZE))
    layer.load_base_rows(torch.zeros(8, 4, 4), torch.zeros(8, 4, 2))
    layer.load(0, {0: None, 1: None, 2: None})
    with pytest.raises(EsftError, match="no room: 2 experts to load, 1 free rows"):
        layer.load(1, {3: None, 4: None})


def test_a_server_without_adapters_sets_aside_room_for_two_esft_sized_ones(world, tmp_path):
    """Started with no adapter, a server sets aside memory for two adapters of an eighth of the base's experts
    (DeepSeek's are 5-9%), not for whole slots (4 copies of the experts: 115 GB on DeepSeek-V2-Lite, where vLLM
    then found no room for its KV cache); where vLLM finds none anyway, the error says what esftctl set aside."""
    from esftctl.formats.bundle import Bundle
    from esftctl.formats.checkpoint import MoECheckpoint
    from esftctl.serve import Server, free_port, plan
    from esftctl.world.synthetic import write_synthetic_adapter

    base = MoECheckpoint(world.base_dir)
    experts = base.num_experts * len(base.moe_layers)
    served = plan(world.base_dir, [], port=free_port(), state_dir=tmp_path / "state")
    assert served.slots >= 2 and served.adapter_budget * 4 <= experts
    eighth = Bundle.open(write_synthetic_adapter(world.base_dir, tmp_path / "a", "a", seed=1,
                                                 experts_per_layer=base.num_experts // 8))
    assert served.adapter_budget >= 2 * eighth.num_experts  # two such adapters load later
    server = Server(served)
    served.state.mkdir(parents=True)
    served.log_file.write_text("ERROR ValueError: No available memory for the cache blocks. Try increasing\n")
    hint = server.memory_hint()
    assert "esftctl set aside" in hint and "lower --adapter-memory" in hint
    served.log_file.write_text("ERROR ValueError: something else\n")
    assert server.memory_hint() == ""


def test_usage_errors_are_one_line_and_exit_1_and_help_and_version_work():
    """Issue 18, item 14: a bad flag, a missing argument or an unparsable value is one line and exit 1 (typer's
    boxed errors exited 2); -h is --help; --version prints the version."""
    from esftctl import __version__

    for args, message in ((("pack", "--bogus"), "No such option: --bogus"),
                          (("select",), "Missing argument 'scores'"),
                          (("select", "s.json", "--out", "c.json", "-p", "abc"), "Invalid value for '--threshold'")):
        proc = run_cli(*args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert message in proc.stderr and f"(see `esftctl {args[0]} --help`)" in proc.stderr, proc.stderr
    assert "Usage: esftctl pack" in run_cli("pack", "-h", check=True).stdout
    assert run_cli("--version", check=True).stdout.strip() == f"esftctl {__version__}"
    assert run_cli().returncode == 0  # no arguments: the help


def test_help_shows_choices_and_no_bool_placeholders():
    """Issue 18, item 14: flags show no `<bool>` placeholder, fixed choices show as such, and consolidate says it
    takes exactly one of --capacity and --budget."""
    import os
    import subprocess
    import sys

    def help_of(*args):
        return subprocess.run([sys.executable, "-m", "esftctl.cli", *args, "--help"], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "200"}, check=True).stdout

    for args in (("pack",), ("serve",), ("bench", "memory"), ("bench", "consolidate")):
        text = help_of(*args)
        flags = [line for line in text.splitlines() if "--json" in line or "--overwrite" in line or "--serve " in line]
        assert all("<bool>" not in line for line in flags), flags
    assert "[gate|token]" in help_of("select") and "[layer|tensor]" in help_of("compress")
    assert "[auto|cuda|accounting]" in help_of("bench", "memory")
    assert "exactly one" in help_of("consolidate")


def test_json_for_scripts_on_every_writing_command(world, tmp_path):
    """Issue 18, item 15: relevance, select, merge, materialize, average, consolidate, decompress print JSON with
    --json (a script reads the result instead of scraping a table); merge and friends show a progress bar."""
    from esftctl.world.synthetic import write_synthetic_adapter, write_synthetic_variant

    def js(*args):
        return json.loads(run_cli(*args, "--json", check=True).stdout)

    data = world.data_file(world.task_names[0], "test")
    assert js("relevance", world.base_dir, data, "--out", tmp_path / "s.json", "--max-examples", "4")["out"]
    assert set(js("select", tmp_path / "s.json", "--out", tmp_path / "c.json")["experts"]) == {"1", "2", "3"}
    bundle = write_synthetic_adapter(world.base_dir, tmp_path / "b", "b", seed=1, experts_per_layer=1)
    merged = js("merge", world.base_dir, bundle, "--out", tmp_path / "m")
    assert merged["files"] and merged["bytes"] > 0 and merged["out"] == str(tmp_path / "m")
    v = [write_synthetic_variant(world.base_dir, tmp_path / f"v{i}", seed=i, experts_per_layer=2) for i in range(2)]
    assert js("consolidate", *v, "--capacity", "10", "--out", tmp_path / "map")["capacity"] == 10
    assert js("materialize", tmp_path / "map", "--variant", "1", "--out", tmp_path / "mat")["files"]
    assert js("average", *v, "--out", tmp_path / "avg")["files"]
    run_cli("compress", bundle, "--out", tmp_path / "st", check=True)
    assert js("decompress", tmp_path / "st", "--out", tmp_path / "back")["files"] == [
        "base_tensors.json", "experts.safetensors", "manifest.json"]
    exported = js("export", bundle, "--format", "esft", "--out", tmp_path / "esft")  # issue 32, item 12
    assert exported["files"] == ["expert_cfg.json", "model.safetensors"] and exported["format"] == "esft"
    assert [len(ids) for ids in exported["experts"].values()] == [1, 1, 1]


def test_consolidate_capacity_beyond_the_positions(world, tmp_path):
    """Issue 32, item 12: `--capacity 10000` was recorded as given. More positions than the variants have is refused
    before any work (a mistake: another model, or experts per layer); a budget above all of them is a memory limit
    that happens to be generous, so it loads every position and says so."""
    from esftctl.world.synthetic import write_synthetic_variant

    v = [write_synthetic_variant(world.base_dir, tmp_path / f"v{i}", seed=i, experts_per_layer=2) for i in range(2)]
    proc = run_cli("consolidate", *v, "--capacity", "10000", "--out", tmp_path / "map")
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert ("--capacity 10000: the variants have 192 expert positions (3 MoE layers x 64 experts); give 0..192"
            in proc.stderr), proc.stderr
    assert not (tmp_path / "map").exists()
    proc = run_cli("consolidate", *v, "--budget", "1GiB", "--out", tmp_path / "map", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["capacity"] == 192 and "holds all 192 expert positions" in proc.stderr


def test_readme_points_only_at_files_in_the_repository():
    """Issue 18, item 16: every file the README names (a path with a folder, or a bare module name) exists here,
    and nothing points outside the repository."""
    import re

    from conftest import ROOT

    text = (ROOT / "README.md").read_text()
    assert "../" not in text
    names = set(re.findall(r"`([\w./-]+\.(?:py|md|sh|toml))`", text))
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = set(tracked.split())
    for name in names:
        found = name in files if "/" in name else any(f.rsplit("/", 1)[-1] == name for f in files)
        assert found, f"the README names {name}, which is not in the repository"
    for command in re.findall(r"(?:python|bash) ((?:recipes|tests|scripts)/[\w/-]+\.(?:py|sh))", text):
        assert (ROOT / command).is_file(), command


def test_bench_without_its_extra_says_what_to_install(monkeypatch, capsys):
    """Issue 30: what only the benchmarks use (peft, zstandard) comes with the [bench] extra; `esftctl bench ...`
    without it is one line saying what to install."""
    import importlib.util
    import sys

    from esftctl import cli

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find(name, *a))
    monkeypatch.setattr(sys, "argv", ["esftctl", "bench", "memory", "--backend", "accounting"])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1 and "pip install 'esftctl[bench]'" in err, err
