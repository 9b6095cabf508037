"""The bench, without a GPU: each mode's ds_config (stream@B included), the mode list, the llama
presets and gradient checkpointing, the driver (a run cut short resumed, a failed, out-of-memory or
timed-out mode recorded, a timed-out worker killed with its children, the torchrun command for
several ranks), the summary's floor and hidden share, the memory timeline rebuilt from a synthetic
allocator trace, every chart from synthetic and committed results, the llama model at a tiny size,
and the worker itself on the CPU (one rank, and two ranks through torchrun; its out-of-memory record)."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench_runs import RESULTS, RUNS
from deepspeed_offload.bench import charts, driver, models, modes, options
from deepspeed_offload.bench import report as reporting
from deepspeed_offload.bench import timeline
from deepspeed_offload.bench.results import from_rows, plan_record, pool_rounds
from deepspeed_offload.config import OffloadConfig
from deepspeed_offload.runtime.memory.placement import MeasuredPlan

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ["--model", "llama", "--layers", "2", "--hidden", "64", "--intermediate", "176", "--heads", "4",
              "--kv-heads", "2", "--vocab", "128", "--batch", "2", "--seq", "16"]


def parse(*argv):
    return options.resolve(options.build_parser().parse_args(list(argv)))


def expand(spec, budgets="0,8,16,32,default"):
    """The names ``--modes spec --budgets budgets`` runs."""
    return [m.name for m in modes.expand(spec, parse("--budgets", budgets))]


def config(name, args):
    return modes.ds_config(modes.describe(name, args), args)


def test_every_mode_has_a_config_and_a_baseline():
    args = parse()
    names = expand("all", args.budgets) + modes.FIXED + list(modes.ALIASES)
    for name in names:
        cfg = config(name, args)
        assert cfg["zero_optimization"]["stage"] == 3
        block = cfg.get("optimizer_state_offload")
        if block is not None:
            OffloadConfig(**block)  # the keys and types our config accepts
        assert modes.describe(name, args).baseline in names
    block = {m: config(m, args)["optimizer_state_offload"] for m in ("stream", "stream_overlap")}
    assert block["stream"]["overlap"] is False and block["stream_overlap"]["overlap"] is True
    assert block["stream"]["memory_budget_gb"] == block["stream_overlap"]["memory_budget_gb"] == 0
    assert config("stream_overlap", parse("--overlap-memory-gb", "3"))[
        "optimizer_state_offload"]["overlap_memory_gb"] == 3.0
    budget = {m: config(m, args)["optimizer_state_offload"]["memory_budget_gb"]
              for m in ("compile_offload", "compile_offload_budget", "compile_offload_full", "compile_offload@8",
                        "compile_offload@default")}
    assert budget == {"compile_offload": None, "compile_offload_budget": args.budget_gb, "compile_offload_full": 0,
                      "compile_offload@8": 8.0, "compile_offload@default": None}
    assert "gradient_clipping" not in config("resident", args)  # DeepSpeed's default unless asked
    assert config("stream_speculate", parse("--gradient-clipping", "1e-9"))["gradient_clipping"] == 1e-9
    assert config("resident", parse("--reduce-bucket-size", "4194304"))["zero_optimization"] == {
        "stage": 3, "reduce_bucket_size": 4194304}
    assert config("stream_speculate", parse("--reduce-bucket-size", "99"))["zero_optimization"]["reduce_bucket_size"] == 99
    assert "optimizer_state_offload" not in config("dc_offload_opt_states", args)
    assert config("dc_offload_opt_states", args)["compile"]["offload_opt_states"] is True


def test_a_mode_with_its_own_bucket_runs_beside_the_same_mode_in_one_run():
    """``NAME/bucket=N``: NAME's config with reduce_bucket_size N over --reduce-bucket-size, its own
    result key and files, so that --rounds compares two buckets under the same drift."""
    args = parse("--reduce-bucket-size", "4194304")
    assert expand("resident,default@0,default@0/bucket=22369621") == [
        "resident", "default@0", "default@0/bucket=22369621"]
    plain, own = modes.describe("default@0", args), modes.describe("default@0/bucket=22369621", args)
    assert config("default@0", args)["zero_optimization"]["reduce_bucket_size"] == 4194304
    cfg = config("default@0/bucket=22369621", args)
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 22369621}
    assert cfg["optimizer_state_offload"] == config("default@0", args)["optimizer_state_offload"]
    assert (own.baseline, own.budget_gb, own.family, own.ours) == (plain.baseline, 0, "default", True)
    assert own.file_name() == "default_at_0_bucket22369621" != plain.file_name()
    assert config("resident/bucket=7", parse())["zero_optimization"]["reduce_bucket_size"] == 7
    assert "reduce_bucket_size" not in config("resident", parse())["zero_optimization"]  # left as it was
    for bad in ("default@0/bucket=", "default@0/bucket=0", "default@0/bucket=1e6", "default@0/size=4",
                "nosuch/bucket=4"):
        with pytest.raises(ValueError):
            modes.describe(bad, args)


def test_a_mode_with_its_own_sub_group_size_runs_beside_the_same_mode_in_one_run():
    """``NAME/sub_group_mb=N``: our block's sub_group_mb N over --sub-group-mb (with a bucket too, each
    once); refused for a mode without our block, where it would change nothing."""
    args = parse("--sub-group-mb", "256")
    assert expand("default@0,default@0/sub_group_mb=512,default@0/sub_group_mb=512/bucket=9") == [
        "default@0", "default@0/sub_group_mb=512", "default@0/sub_group_mb=512/bucket=9"]
    block = config("default@0/sub_group_mb=512", args)["optimizer_state_offload"]
    assert block == dict(config("default@0", args)["optimizer_state_offload"], sub_group_mb=512)
    assert config("default@0", args)["optimizer_state_offload"]["sub_group_mb"] == 256
    OffloadConfig(**block)
    both = config("default@0/sub_group_mb=512/bucket=9", args)
    assert both["optimizer_state_offload"]["sub_group_mb"] == 512
    assert both["zero_optimization"]["reduce_bucket_size"] == 9
    assert config("stream/sub_group_mb=64", args)["optimizer_state_offload"]["sub_group_mb"] == 64
    own = modes.describe("default@0/sub_group_mb=512", args)
    assert (own.baseline, own.budget_gb, own.family) == ("resident", 0, "default")
    assert own.file_name() == "default_at_0_sub_group_mb512"
    for bad in ("resident/sub_group_mb=512", "dc_offload_opt_states/sub_group_mb=512", "default@0/sub_group_mb=0",
                "default@0/sub_group_mb=512/sub_group_mb=256", "default@0/bucket=4/bucket=4", "default@0/",
                "default@0/sub_group_mb=1.5"):
        with pytest.raises(ValueError):
            modes.describe(bad, args)


def test_the_budget_sweep_is_one_run_of_several_modes():
    names = expand("all", "0,8,16,32,default")
    sweep = [m for m in names if m.startswith("compile_offload@")]
    assert sweep == ["compile_offload@0", "compile_offload@8", "compile_offload@16", "compile_offload@32",
                     "compile_offload@default"]
    assert names.index("compiled") < names.index(sweep[0]) < names.index("dc_offload_opt_states")
    assert {"stream", "stream_overlap", "bandwidth", "resident"} <= set(names)
    assert expand("resident,compile_sweep,resident", "4") == ["resident", "compile_offload@4"]
    for bad, budgets in (("strem", "0"), ("compile_offload@lots", "0"), ("compile_sweep", "0,-1"),
                         ("compile_offload@", "0")):
        with pytest.raises(ValueError):
            expand(bad, budgets)


def test_stream_modes_at_a_resident_budget():
    """stream@B (overlap off) and stream_overlap@B (overlap on) are stream mode with memory_budget_gb
    B (default: null); stream and stream_overlap are the same at budget 0."""
    args = parse("--overlap-memory-gb", "2")
    block = {m: config(m, args)["optimizer_state_offload"]
             for m in ("stream", "stream_overlap", "stream@0", "stream_overlap@0", "stream@16", "stream_overlap@16",
                       "stream@default", "stream_overlap@default", "stream@2.5")}
    for b in block.values():
        OffloadConfig(**b)
    assert block["stream@0"] == block["stream"] and block["stream_overlap@0"] == block["stream_overlap"]
    assert block["stream@16"] == dict(block["stream"], memory_budget_gb=16.0)
    assert block["stream_overlap@16"] == dict(block["stream_overlap"], memory_budget_gb=16.0)
    assert block["stream_overlap@16"]["overlap"] is True and block["stream_overlap@16"]["overlap_memory_gb"] == 2.0
    assert block["stream@default"]["memory_budget_gb"] is None and block["stream@2.5"]["memory_budget_gb"] == 2.5
    for name in ("stream@16", "stream_overlap@default"):
        mode = modes.describe(name, args)
        assert (mode.baseline, mode.against_floor, mode.traced, mode.compiled, mode.ours) == \
            ("resident", True, True, False, True)
        assert "compile" not in config(name, args)
    assert modes.describe("stream@16", args).budget_label == "16 GiB"
    assert modes.describe("stream_overlap@default", args).budget_label == "default"
    assert expand("resident,stream_sweep,stream_overlap_sweep", "0,16") == [
        "resident", "stream@0", "stream@16", "stream_overlap@0", "stream_overlap@16"]
    for bad in ("stream@lots", "stream@", "stream@-1", "stream_prefetch@4", "resident@0"):
        with pytest.raises(ValueError):
            expand(bad)


def test_a_bad_mode_is_refused_before_anything_runs(capsys):
    assert driver.main(["--modes", "resident,strem"]) == 2
    assert "strem" in capsys.readouterr().err


def test_llama_defaults_are_tinyllama_and_flags_override():
    args = parse("--model", "llama")
    assert (args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab, args.batch,
            args.seq) == (22, 2048, 5632, 32, 4, 32000, 8, 2048)
    assert parse("--model", "llama", "--layers", "4", "--seq", "512").layers == 4
    mlp = parse()
    assert (mlp.layers, mlp.hidden) == (64, 4096)
    assert config("resident", args)["train_micro_batch_size_per_gpu"] == 8


def test_llama_presets_set_the_shape_and_flags_still_override():
    shape = ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq")

    def sizes(*argv):
        args = parse("--model", "llama", *argv)
        return tuple(getattr(args, k) for k in shape)

    assert sizes() == sizes("--preset", "tinyllama") == (22, 2048, 5632, 32, 4, 32000, 8, 2048)
    assert parse("--model", "llama").preset == "tinyllama"
    assert sizes("--preset", "llama2-7b") == (32, 4096, 11008, 32, 32, 32000, 8, 2048)
    assert sizes("--preset", "llama3-8b") == (32, 4096, 14336, 32, 8, 128256, 8, 2048)
    assert sizes("--preset", "llama3-8b", "--layers", "4", "--batch", "2", "--seq", "4096", "--vocab", "1000") == \
        (4, 4096, 14336, 32, 8, 1000, 2, 4096)
    with pytest.raises(SystemExit):
        parse("--model", "llama", "--preset", "llama4")
    for flags in (["--preset", "llama2-7b"], ["--grad-ckpt"]):  # the MLPs have neither
        with pytest.raises(ValueError, match=flags[0]):
            parse(*flags)
        assert driver.main(["--modes", "resident", *flags]) == 2


def test_the_7b_preset_has_7b_parameters():
    """The presets are the published shapes: parameter counts from the config alone (nothing built)."""
    def count(preset):
        a = parse("--model", "llama", "--preset", preset)
        kv = a.hidden // a.heads * a.kv_heads
        layer = 2 * a.hidden * a.hidden + 2 * a.hidden * kv + 3 * a.hidden * a.intermediate + 2 * a.hidden
        return 2 * a.vocab * a.hidden + a.layers * layer + a.hidden

    assert count("llama2-7b") == 6_738_415_616  # Llama-2-7b-hf
    assert count("llama3-8b") == 8_030_261_248  # Meta-Llama-3-8B
    assert count("tinyllama") == 1_100_048_384  # TinyLlama-1.1B


def test_gradient_checkpointing_gives_the_same_gradients():
    """--grad-ckpt: every decoder layer recomputed in backward, in either style (the flag alone:
    non-reentrant; ``reentrant``: transformers' default), the loss and every gradient as without it."""
    import torch
    grads = []
    for flags in ([], ["--grad-ckpt"], ["--grad-ckpt", "reentrant"]):
        torch.manual_seed(0)
        args = parse(*TINY_LLAMA, *flags)
        model = models.build_llama(args)
        layers = model.model.layers
        assert all(getattr(layer, "gradient_checkpointing", False) for layer in layers) == bool(flags)
        if flags:  # the function HF's layers recompute through, with the style asked for
            fn = layers[0]._gradient_checkpointing_func
            assert fn.keywords["use_reentrant"] == (flags[1:] == ["reentrant"]), (flags, fn.keywords)
        torch.manual_seed(1)
        loss = models.make_loss(args, "cpu")(model)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    for other in grads[1:]:
        assert grads[0][0] == pytest.approx(other[0])
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0][1], other[1]))


def test_a_tiny_llama_builds_and_trains_on_the_cpu():
    args = parse(*TINY_LLAMA)
    model = models.build_llama(args)
    h, i, v, L, kv = 64, 176, 128, 2, 2 * 64 // 4
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q,o; k,v; gate,up,down; two norms
    assert sum(p.numel() for p in model.parameters()) == 2 * v * h + L * per_layer + h
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert not model.config.tie_word_embeddings
    loss_of = models.make_loss(args, "cpu")
    loss = loss_of(model)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() > 0
    assert all(p.grad is not None for p in model.parameters())


OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.72 GiB of which "
               "1.02 GiB is free.")


@pytest.fixture
def fake_workers(monkeypatch):
    """Every worker 'measures' a fixed result into its result file, except: stream fails, resident
    writes an out-of-memory record, zero_offload dies of it on a rank other than 0 (no result),
    offload_states runs past its timeout. Returns the (command, timeout) pairs launched."""
    launched, caches = [], []

    def run(cmd, env, timeout):
        mode = cmd[cmd.index("--worker") + 1]
        out = cmd[cmd.index("--out") + 1]
        if launched:  # results are written after every mode: the previous one is on disk already
            assert cmd_mode(launched[-1][0]) in json.loads(Path(out).read_text())["results"]
        launched.append((cmd, timeout))
        caches.append(env["TORCHINDUCTOR_CACHE_DIR"])  # one inductor cache per mode, made afresh
        assert os.path.isdir(caches[-1]) and not os.listdir(caches[-1]) and len(set(caches)) == len(caches)
        result_file = Path(cmd[cmd.index("--result-file") + 1])
        if mode == "stream":
            return "Traceback\nRuntimeError: boom", False
        if mode == "resident":
            result_file.write_text(json.dumps({"oom": True, "error": OOM_MESSAGE, "peak_before_GiB": 130.5,
                                               "last_progress": "iteration 1 of 11", "params": 10}))
            return "torch.OutOfMemoryError: " + OOM_MESSAGE, False
        if mode == "zero_offload":
            return (f"[bench] zero_offload: model built at 3.0 s\n[rank1]: torch.OutOfMemoryError: {OOM_MESSAGE}\n",
                    False)
        if mode == "offload_states":
            return ("[bench] offload_states: engine built at 9.0 s\n"
                    "[bench] offload_states: iteration 2 of 11 at 99.0 s\n", True)
        result = {"iter_s": 1.0, "step_s": 0.5, "pipelined_iter_s": 1.0, "peak_step_GiB": 1.0, "between_GiB": 1.0,
                  "params": 10}
        result_file.write_text(json.dumps(result))
        return "log of " + mode, False

    monkeypatch.setattr(driver, "run_process", run)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    return launched


def cmd_mode(cmd):
    return cmd[cmd.index("--worker") + 1]


def launched_modes(launched):
    return [cmd_mode(cmd) for cmd, _ in launched]


def test_a_run_cut_short_resumes_where_it_stopped(tmp_path, fake_workers):
    out = str(tmp_path / "b.json")
    assert driver.main(["--out", out, "--modes", "stream_overlap,stream"]) == 0
    first = json.loads(open(out).read())
    assert "iter_s" in first["results"]["stream_overlap"] and "boom" in first["results"]["stream"]["error"]
    assert launched_modes(fake_workers) == ["stream_overlap", "stream"]
    assert (tmp_path / "b-stream.log").read_text() == "Traceback\nRuntimeError: boom"  # the whole output is kept
    # the failed mode and the new ones run again, the measured one is kept
    assert driver.main(["--out", out, "--modes", "stream_overlap,stream,compile_sweep", "--budgets", "0,default",
                       "--resume"]) == 0
    assert launched_modes(fake_workers) == ["stream_overlap", "stream", "stream", "compile_offload@0",
                                            "compile_offload@default"]
    assert set(json.loads(open(out).read())["results"]) == {"stream_overlap", "stream", "compile_offload@0",
                                                            "compile_offload@default"}
    assert (tmp_path / "b-compile_offload_at_0.log").exists()
    # other arguments: not the same run, refused
    assert driver.main(["--out", out, "--modes", "stream_overlap", "--iters", "3", "--resume"]) == 2


def test_a_record_older_than_an_argument_resumes_with_its_default(tmp_path, fake_workers):
    out = tmp_path / "b.json"
    assert driver.main(["--out", str(out), "--modes", "stream_overlap", "--model", "llama"]) == 0
    old = json.loads(out.read_text())
    for newer in ("grad_ckpt", "preset"):
        del old["args"][newer]
    out.write_text(json.dumps(old))
    assert driver.main(["--out", str(out), "--modes", "stream_overlap", "--model", "llama", "--resume"]) == 0
    assert launched_modes(fake_workers) == ["stream_overlap"]  # kept
    assert driver.main(["--out", str(out), "--modes", "stream_overlap", "--model", "llama", "--grad-ckpt",
                        "--resume"]) == 2


def test_out_of_memory_and_timeouts_are_results(tmp_path, fake_workers):
    """A mode out of GPU memory, whether its worker wrote the record or a rank died of it, and a mode
    past its timeout are recorded; the run goes on, the table says which, a resume keeps the
    out-of-memory ones (a result of these arguments) and runs the timed-out one again."""
    out = tmp_path / "b.json"
    argv = ["--out", str(out), "--modes", "resident,zero_offload,offload_states,stream_overlap",
            "--timeout", "900,offload_states=30.5"]
    assert driver.main(argv) == 0
    assert [(cmd_mode(c), t) for c, t in fake_workers] == [("resident", 900), ("zero_offload", 900),
                                                          ("offload_states", 30.5), ("stream_overlap", 900)]
    res = json.loads(out.read_text())["results"]
    assert res["resident"]["oom"] is True and res["resident"]["peak_before_GiB"] == 130.5
    assert res["zero_offload"] == dict(res["zero_offload"], oom=True, error=OOM_MESSAGE, peak_before_GiB=None,
                                       last_progress="model built at 3.0 s")
    assert res["offload_states"]["timeout"] is True and res["offload_states"]["timeout_s"] == 30.5
    assert res["offload_states"]["error"].startswith("timed out after 30.5 s (iteration 2 of 11 at 99.0 s)\n")
    assert "iter_s" in res["stream_overlap"] and "overhead_s" not in res["stream_overlap"]  # no baseline figures
    text = reporting.report(json.loads(out.read_text()))
    assert "| resident | out of memory (peak 130.50 GiB before; iteration 1 of 11) |" in text
    assert "| zero_offload | out of memory (model built at 3.0 s) |" in text
    assert "| offload_states | timed out after 30.5 s (iteration 2 of 11 at 99.0 s) |" in text
    assert f"resident: out of memory: {OOM_MESSAGE}" in text
    assert driver.main(argv + ["--resume"]) == 0
    assert launched_modes(fake_workers)[4:] == ["offload_states"]
    for bad in ("0", "fast", "resident=-1", "compiled=60", "resident=", "=5"):
        assert driver.main(["--out", str(out), "--modes", "resident", "--timeout", bad]) == 2


def test_a_worker_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    """torchrun's ranks (here: a grandchild) must not outlive a timed-out worker: they hold the GPU."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('started', flush=True)\n"
            "time.sleep(300)\n")
    log, timed_out = driver.run_process([sys.executable, "-c", code], dict(os.environ), timeout=5)
    assert timed_out and "started" in log
    pid = int(pid_file.read_text())
    for _ in range(100):  # killed: gone, or a zombie until init reaps it
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the grandchild outlived the timeout")
    done = driver.run_process([sys.executable, "-c", "print('done')"], dict(os.environ), timeout=60)
    assert done == ("done\n", False)


def test_several_ranks_run_through_torchrun(tmp_path, fake_workers):
    out = str(tmp_path / "b.json")
    assert driver.main(["--out", out, "--modes", "resident", "--ranks", "2"]) == 0
    cmd = fake_workers[0][0]
    assert cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc_per_node=2" in cmd and cmd[cmd.index("-m", 3):][:2] == ["-m", "deepspeed_offload.bench"]
    assert driver.main(["--out", out, "--modes", "resident", "--ranks", "4"]) == 2  # 2 GPUs here


def test_the_cli_namespace_is_summarized(tmp_path):
    """``deepspeed-offload bench`` passes a namespace with the CLI's own entries (a function among them)."""
    from deepspeed_offload.cli import build_parser
    ns = build_parser().parse_args(["bench", "--out", str(tmp_path / "b.json"), "--model", "llama"])
    reporting.summarize({}, options.resolve(ns))
    written = json.loads((tmp_path / "b.json").read_text())["args"]
    assert written["model"] == "llama" and written["hidden"] == 2048 and "func" not in written


def synthetic(ranks=1):
    """A run's results, as the workers would write them: floor = 12e9 B / 24 GB/s = 0.5 s (one rank)."""
    def r(it, peak, **kw):
        return dict({"iter_s": it, "iter_s_min": it - 0.01, "iter_s_max": it + 0.02, "step_s": 0.2,
                     "fwd_bwd_s": it - 0.2, "pipelined_iter_s": it - 0.05, "peak_step_GiB": peak - 1,
                     "peak_fwd_bwd_GiB": peak, "peak_iter_GiB": peak, "between_GiB": peak - 2, "params": 10**9},
                    **kw)
    tl = {"t_s": [0.0, 0.1, 0.2, 0.3], "allocated_GiB": [5.0, 7.0, 6.0, 5.0], "peak_GiB": 7.0,
          "marks_s": {"forward": 0.0, "backward": 0.1, "step": 0.2, "end": 0.3}}
    results = {
        "bandwidth": {"h2d_GBps": 30.0, "d2h_GBps": 30.0, "both_each_way_GBps": 24.0, "pageable_h2d_GBps": 9.0,
                      "ranks": [{"rank": k, "alone": {"h2d_GBps": 30.0, "d2h_GBps": 30.0, "both_each_way_GBps": 25.0},
                                 "together": {"h2d_GBps": 28.0, "d2h_GBps": 28.0, "both_each_way_GBps": 24.0}}
                                for k in range(ranks)]},
        "resident": r(1.0, 20.0, timeline=tl),
        "stream": r(1.5, 8.0, timeline=tl),
        "stream_overlap": r(1.2, 9.0, timeline=tl,
                            host={"ranks_per_node": ranks, "store_bytes_per_node": 12 * 10**9,
                                  "rss_bytes_per_node": 14 * 10**9, "estimate_pinned_per_node": 12 * 10**9}),
        "compiled": r(0.8, 21.0),
        "compile_offload@0": r(1.1, 8.0),
        "compile_offload@16": r(1.0, 15.0),
        "compile_offload@default": r(0.9, 21.0),
        "dc_offload_opt_states": r(0.82, 20.0),
        "dc_offload_opt_states_full": r(1.3, 19.0),
        "zero_offload": {"error": "Traceback\nRuntimeError: out of | memory"},
    }
    return results


def test_raw_rows_and_the_timeline_are_written_only_with_trace(tmp_path):
    """--out holds each mode's medians, spreads and peaks, the command, commit and machine; each measured
    iteration's row and the allocator timeline only with --trace. The summary returned (what the report
    and --timeline's chart are drawn from) has them either way, and --trace does not change which run it is."""
    rows = [{"iter_s": 1.5, "step_s": 0.2}]
    out = tmp_path / "b.json"
    s = reporting.summarize(dict(synthetic(), stream=dict(synthetic()["stream"], per_iter=rows)),
                            parse("--out", str(out), "--iters", "5"))
    assert s["results"]["stream"]["per_iter"] == rows and s["results"]["stream"]["timeline"]["peak_GiB"] == 7.0
    written = json.loads(out.read_text())
    assert not [(m, k) for m, r in written["results"].items() for k in ("per_iter", "timeline") if k in r]
    assert written["results"]["stream"]["iter_s_max"] == 1.52 and written["args"]["trace"] is False
    assert written["command"].startswith("deepspeed-offload bench ") and "--iters 5" in written["command"]
    assert "--trace" not in written["command"] and "hardware" in written and "commit" in written
    reporting.summarize(dict(synthetic(), stream=dict(synthetic()["stream"], per_iter=rows)),
                        parse("--out", str(out), "--iters", "5", "--trace"))
    traced = json.loads(out.read_text())
    assert traced["results"]["stream"]["per_iter"] == rows and traced["results"]["stream"]["timeline"]["peak_GiB"] == 7.0
    assert "--trace" in traced["command"] and options.identity_diff(parse("--iters", "5"), traced["args"]) == []


def test_the_floor_and_the_share_of_it_hidden(tmp_path):
    args = parse("--out", str(tmp_path / "b.json"))
    s = reporting.summarize(synthetic(), args)
    assert s["floor_s"] == pytest.approx(0.5)
    res = s["results"]
    assert res["stream"]["hidden_share"] == pytest.approx(0.0)  # 0.5 s over resident: nothing hidden
    assert res["stream_overlap"]["hidden_share"] == pytest.approx(0.6)  # 0.2 s of the 0.5 s floor
    assert res["compile_offload@16"]["hidden_share"] == pytest.approx(0.6)  # against compiled's 0.8 s
    assert res["stream_overlap"]["pipelined_hidden_share"] == pytest.approx(0.6)
    assert "hidden_share" not in res["resident"] and "hidden_share" not in res["compiled"]
    # two ranks: each holds half the state, at the bandwidth measured with both copying
    s2 = reporting.summarize(synthetic(2), parse("--out", str(tmp_path / "c.json"), "--ranks", "2"))
    assert s2["floor_s"] == pytest.approx(0.25)
    text = reporting.report(s2)
    assert "rank 1: alone H2D/D2H/both 30.0/30.0/25.0, all ranks at once 28.0/28.0/24.0" in text
    assert "stream_overlap: host per node (2 ranks)" in text
    assert "| zero_offload | failed: RuntimeError: out of / memory |" in text
    assert "| stream | 1.500 (1.490-1.520) |" in text


def entry(action, t, size):
    return {"action": action, "time_us": t, "size": size, "addr": 0, "stream": 0}


def test_the_timeline_is_rebuilt_from_the_allocator_trace():
    marks = {"forward": 1000, "backward": 1500, "step": 2000, "end": 3000}
    trace = [entry("alloc", 900, 10**9),  # before the iteration: in the base already
             entry("segment_alloc", 1000, 4 * 10**9),
             entry("alloc", 1100, 2 * 10**9),
             entry("free_requested", 1200, 2 * 10**9),  # still in use by another stream until completed
             entry("alloc", 1600, 3 * 10**9),
             entry("free_completed", 1600, 3 * 10**9),  # the same microsecond: the peak stays
             entry("free_completed", 2500, 2 * 10**9),
             entry("alloc", 3100, 10**9)]  # after the iteration
    tl = timeline.timeline_from_trace(trace, marks, base_bytes=5 * 10**9)
    assert [round(y * timeline.GiB / 1e9) for y in tl["allocated_GiB"]] == [5, 7, 10, 7, 5, 5]
    assert tl["t_s"] == pytest.approx([0, 0.0001, 0.0006, 0.0006, 0.0015, 0.002])
    assert tl["peak_GiB"] == pytest.approx(10e9 / timeline.GiB) and tl["events"] == 4
    assert tl["marks_s"] == {"forward": 0, "backward": 0.0005, "step": 0.001, "end": 0.002}
    assert not tl["truncated"]
    # a ring buffer that wrapped before the iteration ended is flagged
    assert timeline.timeline_from_trace(trace[2:4], marks, 0, max_entries=2)["truncated"]


def test_a_long_timeline_keeps_its_peak():
    n = 10_000
    trace = [entry("alloc" if k % 2 == 0 else "free_completed", 10 + k, 10**6) for k in range(n)]
    trace.insert(5001, entry("alloc", 5011, 10**9))
    trace.insert(5002, entry("free_completed", 5011, 10**9))
    tl = timeline.timeline_from_trace(trace, {"forward": 0, "end": 20_000}, 0, max_points=500)
    assert len(tl["t_s"]) <= 502
    assert max(tl["allocated_GiB"]) == pytest.approx(tl["peak_GiB"]) == pytest.approx((10**9 + 10**6) / timeline.GiB)
    assert tl["t_s"] == sorted(tl["t_s"])


def test_memory_history_lists_each_segment_reserved_after_the_first_iteration():
    GB = 10**9
    marks = [{"forward": 1000, "backward": 1500, "step": 2000, "end": 3000},
             {"forward": 4000, "backward": 4500, "step": 5000, "end": 6000}]
    ours = {"filename": "/r/deepspeed_offload/runtime/memory/residency.py", "line": 211, "name": "_slot"}
    theirs = {"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}
    trace = [entry("segment_alloc", 1100, 4 * GB),  # first iteration: the pool being built, not listed
             entry("alloc", 1100, 3 * GB),
             entry("free_requested", 2100, 3 * GB),
             {**entry("segment_alloc", 2200, 2 * GB), "frames": [theirs, ours]},  # the free block is not back yet
             entry("alloc", 2200, 2 * GB),
             entry("free_completed", 2600, 3 * GB),
             entry("segment_free", 2700, 4 * GB),
             {**entry("segment_alloc", 5100, 1 * GB), "stream": 7},
             {**entry("segment_map", 6500, 1 * GB), "frames": [ours]}]  # an expandable segment grew
    marks_2 = [marks[0], {**marks[1], "forward": 2150}]  # the second segment falls in iteration 1's forward
    grew = timeline.growth(trace, active_end=7 * GB, reserved_end=20 * GB, marks=marks_2, after=1)
    assert [(g["iteration"], g["phase"]) for g in grew] == [(1, "forward"), (1, "step"), (2, "pipelined")]
    # both counted backwards from the end, just before each growth: reserved 20 - (4 + 2 - 4 + 1 + 1) = 16 GB
    # at the start; in use 7 - (3 + 2 - 3) = 5 GB, a block until its free_completed
    assert [round(g["reserved_GiB"] * timeline.GiB / GB) for g in grew] == [20, 18, 19]
    assert [round(g["active_GiB"] * timeline.GiB / GB) for g in grew] == [8, 7, 7]
    # a ring buffer that dropped the first entries: the same counts for what it kept
    kept = timeline.growth(trace[2:], active_end=7 * GB, reserved_end=20 * GB, marks=marks_2, after=1)
    assert [(g["reserved_GiB"], g["active_GiB"]) for g in kept] == [(g["reserved_GiB"], g["active_GiB"]) for g in grew]
    assert grew[0]["frames"] == ["runtime/memory/residency.py:211 _slot"] and grew[1]["stream"] == 7
    assert grew[0]["MiB"] == 2 * GB / 2**20
    # without an ``after``, the first iteration's segment is listed too; before any mark, iteration -1
    every = timeline.growth(trace, 7 * GB, 20 * GB, marks)
    assert [(g["iteration"], g["phase"]) for g in every][:2] == [(0, "forward"), (0, "step")]
    assert timeline.growth([entry("segment_alloc", 10, GB)], 0, GB, marks)[0]["iteration"] == -1
    assert timeline.growth([entry("segment_unmap", 10, GB)], 0, GB, marks) == []
    assert timeline.growth([], 0, GB, marks) == []


def test_the_report_lists_the_reserved_growth():
    r = {"reserved_growth": [{"iteration": 4, "phase": "step", "MiB": 1502.0, "active_GiB": 46.4, "reserved_GiB": 55.98,
                              "stream": 0, "frames": ["runtime/memory/residency.py:211 _slot", "runtime/step/stream.py:90 step"]},
                             {"iteration": 5, "phase": "backward", "MiB": 20.0, "active_GiB": 40.0, "reserved_GiB": 57.45,
                              "stream": 0, "frames": []}],
         "reserved_growth_truncated": True}
    lines = reporting._growth_lines("stream_speculate", r)
    assert lines[0] == ("stream_speculate: reserved memory grew 2 time(s) after the first iteration (its times were "
                        "measured with the allocator's history recorder on) (the history's oldest entries were dropped)")
    assert lines[1] == ("  1502 MiB in iteration 4 step, with 46.40 of 55.98 GiB reserved in use: "
                        "runtime/memory/residency.py:211 _slot < runtime/step/stream.py:90 step")
    assert lines[2] == "  20 MiB in iteration 5 backward, with 40.00 of 57.45 GiB reserved in use"


def png(path):
    return Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_chart_draws_from_synthetic_results(tmp_path):
    s = reporting.summarize(synthetic(), parse("--out", str(tmp_path / "b.json")))
    charts.plot(s, tmp_path / "c.png")
    assert charts.plot_sweep(s, tmp_path / "s.png") and charts.plot_timeline(s, tmp_path / "t.png")
    assert png(tmp_path / "c.png") and png(tmp_path / "s.png") and png(tmp_path / "t.png")
    bare = dict(s, results={"resident": s["results"]["resident"]})
    bare["results"]["resident"] = dict(bare["results"]["resident"], timeline=None)
    assert not charts.plot_sweep(bare, tmp_path / "s2.png") and not charts.plot_timeline(bare, tmp_path / "t2.png")
    assert not (tmp_path / "s2.png").exists() and not (tmp_path / "t2.png").exists()


def seven_b():
    """A 7B run's results as the workers would write them: resident ZeRO-3 out of memory, our stream
    modes at budgets 0 and 16, ZeRO-Offload measured, offload_states past its timeout."""
    full = synthetic()

    def r(it, peak):
        return dict(full["stream"], iter_s=it, iter_s_min=it - 0.1, iter_s_max=it + 0.1, peak_iter_GiB=peak,
                    params=6_738_415_616)
    return {
        "bandwidth": full["bandwidth"],
        "resident": {"oom": True, "error": OOM_MESSAGE, "peak_before_GiB": 137.9, "last_progress": "engine built",
                     "params": 6_738_415_616},
        "stream@0": r(9.0, 60.0), "stream_overlap@0": r(8.0, 70.0), "stream@16": r(8.5, 76.0),
        "stream_overlap@16": r(7.5, 86.0), "zero_offload": r(20.0, 50.0),
        "offload_states": {"timeout": True, "timeout_s": 1200.0, "last_progress": "iteration 3 of 11 at 1100.0 s",
                           "error": "timed out after 1200 s (iteration 3 of 11 at 1100.0 s)\n..."},
    }


def test_out_of_memory_rows_and_stream_budgets_in_the_report_and_charts(tmp_path, monkeypatch):
    s = reporting.summarize(seven_b(), parse("--out", str(tmp_path / "b.json"), "--model", "llama"))
    assert s["floor_s"] == pytest.approx(6_738_415_616 * 12 / 24e9)
    assert not any("overhead_s" in r for r in s["results"].values())  # no resident figures to compare with
    text = reporting.report(s)
    assert "| resident | out of memory (peak 137.90 GiB before; engine built) |" in text
    assert "| offload_states | timed out after 1200 s (iteration 3 of 11 at 1100.0 s) |" in text
    assert "| stream_overlap@16 | 7.500 (7.400-7.600) |" in text
    assert f"resident: out of memory: {OOM_MESSAGE}" in text
    why = []
    monkeypatch.setattr(charts, "_why", lambda ax, y, text: why.append(text))
    charts.plot(s, tmp_path / "c.png")
    assert why == ["timed out after 1200 s", "out of memory", "out of memory, peak 137.9 GiB before"]
    assert charts.plot_sweep(s, tmp_path / "s.png")  # the stream lines, resident named as out of memory
    assert png(tmp_path / "c.png") and png(tmp_path / "s.png")
    s["results"] = {m: dict(r, timeline=synthetic()["stream"]["timeline"]) if "@" in m else r
                    for m, r in s["results"].items()}
    assert charts.plot_timeline(s, tmp_path / "t.png") and png(tmp_path / "t.png")


def test_a_committed_run_measured_every_mode_it_asked_for():
    """One committed run in which every mode of its day produced figures (the MLP's run 5)."""
    def complete(run):
        res = run["results"]
        asked = [m for m in run["args"]["modes"].split(",") if m != "bandwidth"]
        return "h2d_GBps" in res.get("bandwidth", {}) and len(asked) >= 12 and all("iter_s" in res.get(m, {})
                                                                                   for m in asked)
    assert any(complete(json.loads(p.read_text())) for p in RUNS), [p.name for p in RUNS]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.name)
def test_the_chart_draws_every_committed_run(tmp_path, path):
    """Runs with failed modes (run 4) and with every mode (run 5), floor marks included; the budget
    sweep of every run that has a budget family (default@B among them)."""
    run = json.loads(path.read_text())
    charts.plot(run, tmp_path / "c.png")
    assert png(tmp_path / "c.png")
    settings = reporting.settings_of(run)
    swept = any("iter_s" in r and getattr(modes.lookup(name, settings), "family", None)
                for name, r in run["results"].items())
    assert charts.plot_sweep(run, tmp_path / "s.png") == swept
    assert (tmp_path / "s.png").exists() == swept


def test_charts_from_committed_runs_of_one_model(tmp_path, capsys):
    """The 7B memory-speed curve of docs/benchmarks.md: budgets from one run, the default plan and the
    peers from another; drawn without a GPU. Runs of another model are refused, and so is nothing to draw."""
    results = RESULTS
    seven = [str(results / f) for f in ("llama-7b-2026-12-02-curve.json", "llama-7b-2026-12-03-default.json",
                                        "llama-7b-2026-12-03-peers.json")]
    out = tmp_path / "curve.png"
    assert driver.main(["--charts-from", *seven, "--plot", str(out)]) == 0
    assert png(out) and png(tmp_path / "curve-sweep.png")
    merged = driver.merge_runs(seven)
    assert merged["date"] == "2026-12-02, 2026-12-03"
    assert {"default@0", "default@16", "default@32", "default@48", "default@default", "resident", "zero_offload",
            "offload_states"} <= set(merged["results"])
    assert merged["results"]["default@0"] == json.loads(Path(seven[0]).read_text())["results"]["default@0"]
    assert driver.main(["--charts-from", seven[0], str(results / "llama-13b-2026-12-03-default.json"),
                        "--plot", str(tmp_path / "x.png")]) == 2
    assert "another model or batch" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
    assert driver.main(["--charts-from", seven[0]]) == 2


def start_worker(tmp_path, launcher, mode, *extra):
    """A worker process as the bench driver starts it; ``finish_worker`` waits for its result."""
    out = tmp_path / f"{mode}.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")))
    cmd = launcher + ["-m", "deepspeed_offload.bench", "--worker", mode, "--result-file", str(out), *TINY_LLAMA,
                      "--warmup", "1", "--iters", "2", "--sub-group-mb", "1", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, out


def finish_worker(proc, out):
    stdout, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0 and out.exists(), stdout[-6000:]
    return json.loads(out.read_text())


def run_worker(tmp_path, launcher, mode, *extra):
    return finish_worker(*start_worker(tmp_path, launcher, mode, *extra))


def check_worker_result(r, ranks):
    params = sum(p.numel() for p in models.build_llama(parse(*TINY_LLAMA)).parameters())
    assert r["params"] == params and r["model"] == "llama" and r["ranks"] == ranks
    assert len(r["per_iter"]) == 2 and all(math.isfinite(row["loss"]) for row in r["per_iter"])
    for k in ("iter_s", "step_s", "fwd_bwd_s", "pipelined_iter_s"):
        assert r[k + "_min"] <= r.get(k + "_median", r[k]) <= r[k + "_max"], k
    assert r["peak_iter_GiB"] >= max(row["peak_step_GiB"] for row in r["per_iter"])
    assert r["last_step"]["bytes_h2d"] > 0 and r["last_step"]["sub_groups"] == r["sub_groups"] > 0
    assert [p["rank"] for p in r["per_rank"]] == list(range(ranks))
    # every rank's host store, and the estimate for this model on this many ranks of one node
    assert r["host"]["store_bytes_per_node"] == r["host"]["estimate_pinned_per_node"] == -(-params // ranks) * 12 * ranks
    assert r["host"]["rss_bytes_per_node"] > r["host"]["store_bytes_per_node"]
    # how long it took to start, and the host memory pinned (the store; torch's figure is CUDA's)
    assert 0 < r["model_built_s"] < r["engine_built_s"]
    assert r["host_pinned_GiB"] == r["host_store_bytes"] / 2**30 and r["torch_pinned_GiB"] is None
    assert "attach_s" in r and "pin_s" in r and "pin_GiBps" in r
    assert all(p["host_pinned_GiB"] > 0 for p in r["per_rank"])


def test_the_worker_trains_a_tiny_llama_on_the_cpu(tmp_path, no_shm_left_behind):
    """The worker as the GPU runs it (a CPU accelerator, one rank): stream mode with overlap, the
    second with gradient checkpointing and engine.offload_states()/reload_states() cycles timed
    after the iterations (colocate_stream). Two at once, the same mode, as two benches side by side (one
    per GPU) run them: each rank-0 rendezvous needs a port of its own (one derived from the mode's
    name made the second fail, EADDRINUSE)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_worker(tmp_path / "a", [sys.executable], "stream_overlap", "--timeline", str(tmp_path / "t.png"),
                         "--profile", str(tmp_path / "prof"))
    second = start_worker(tmp_path / "b", [sys.executable], "colocate_stream", "--grad-ckpt")
    results = finish_worker(*first), finish_worker(*second)
    for r in results:
        check_worker_result(r, 1)
    assert results[0]["timeline"] is None  # asked for, but the allocator trace is CUDA's
    assert results[0]["profile"] is None and results[0]["sync_sites"] is None  # (CUDA's too)
    assert [r["grad_ckpt"] for r in results] == [False, "non-reentrant"]
    colocation = {k: v for k, v in results[1].items() if k.startswith("colocate_")}
    assert colocation["colocate_offload_s"] > 0 and colocation["colocate_reload_s"] > 0, colocation
    assert colocation["colocate_cycle_s"] >= colocation["colocate_offload_s"], colocation
    # every field a committed run's stream_overlap result has (the summary adds the overhead figures
    # and the driver the wall time; the committed summaries keep no per-iteration rows, which the worker writes)
    committed = set().union(*(json.loads(p.read_text())["results"].get("stream_overlap", {}) for p in RUNS))
    later = {"overhead_s", "overhead_over_floor", "hidden_share", "step_over_floor", "pipelined_overhead_s",
             "pipelined_hidden_share", "wall_s", "timeline"}
    assert {"iter_s", "iter_s_min", "iter_s_max", "peak_reserved_GiB"} <= committed
    assert committed - later - set(results[0]) == set() and "per_iter" in results[0]


def test_the_worker_splits_iterations_by_what_speculation_did(tmp_path, no_shm_left_behind):
    """stream_speculate on the CPU, twice at once: clipping off, every step after the first commits
    what its backward updated (the first has no Adam state to speculate on); clipping at every step,
    the backoff (steps counted from 1, the warm-up's first) speculates at steps 2 and 4 (each rolled
    back) and not at 3 and 5. Each measured iteration carries its step's counts, and the split gives
    the medians of each kind."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    commits = start_worker(tmp_path / "a", [sys.executable], "stream_speculate", "--iters", "4",
                           "--gradient-clipping", "0")
    clips = start_worker(tmp_path / "b", [sys.executable], "stream_speculate", "--iters", "4",
                         "--gradient-clipping", "1e-9")
    commits, clips = finish_worker(*commits), finish_worker(*clips)
    members = commits["speculation"]["members"]
    assert members > 1 and clips["speculation"]["members"] == members
    assert [(r["speculated"], r["committed"], r["discarded"]) for r in commits["per_iter"]] == [(members, members, 0)] * 4
    assert [(r["speculated"], r["committed"], r["discarded"]) for r in clips["per_iter"]] == \
        [(members, 0, members), (0, 0, 0)] * 2
    assert {k: v["iters"] for k, v in commits["by_speculation"].items()} == \
        {"committed": 4, "rolled_back": 0, "not_speculating": 0}
    split = clips["by_speculation"]
    assert {k: v["iters"] for k, v in split.items()} == {"committed": 0, "rolled_back": 2, "not_speculating": 2}
    times = [r["iter_s"] for r in clips["per_iter"]]
    assert split["rolled_back"]["iter_s"] == pytest.approx((times[0] + times[2]) / 2)
    assert split["not_speculating"]["iter_s"] == pytest.approx((times[1] + times[3]) / 2)
    assert "speculated" not in clips and "committed" not in clips  # counts are not medians
    line = reporting.report({"results": {"stream_speculate": clips}})
    assert "stream_speculate: iterations by speculation (median s): 0 committed, 2 rolled back (" in line


def test_a_worker_out_of_gpu_memory_writes_its_record(tmp_path, monkeypatch):
    """The worker records running out of GPU memory (however wrapped) as its result, with what it
    knew by then, and exits with OOM_EXIT; any other error is not a result."""
    import torch

    from deepspeed_offload.bench import worker
    path = tmp_path / "r.json"
    args = parse(*TINY_LLAMA, "--worker", "resident", "--result-file", str(path))

    class Device:
        def max_memory_allocated(self):
            return 130.5 * 2**30

    def run_mode(mode, args, acc, progress):
        progress.facts.update(params=10, engine_built_s=42.0)
        progress("iteration 1 of 11 (9.000 s)")
        try:
            raise torch.OutOfMemoryError(OOM_MESSAGE + "\nIncluding non-PyTorch memory, this process has ...")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("a wrapper's message") from e

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(worker, "setup", Device)
    monkeypatch.setattr(worker, "run_mode", run_mode)
    assert worker.work(args) == worker.OOM_EXIT
    assert json.loads(path.read_text()) == {"oom": True, "error": OOM_MESSAGE, "peak_before_GiB": 130.5,
                                            "last_progress": "iteration 1 of 11 (9.000 s)", "params": 10,
                                            "engine_built_s": 42.0}
    assert worker.oom_error(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))  # older torch
    path.unlink()

    def fails(*_):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(worker, "run_mode", fails)
    with pytest.raises(RuntimeError, match="illegal"):
        worker.work(args)
    assert not path.exists()


@pytest.mark.e2e
def test_the_worker_runs_two_ranks_through_torchrun(tmp_path, no_shm_left_behind):
    """``--ranks 2``'s launch command, two gloo ranks on the CPU: rank 0 reports both ranks."""
    r = run_worker(tmp_path, driver.launcher(parse("--ranks", "2")), "stream@0")
    check_worker_result(r, 2)


def test_profile_summary_of_the_last_iteration():
    """--profile's summary: the phases of the last iteration from the GPU annotations, each stream's
    busy time in them (overlapping kernels counted once) and the bytes it copied each way."""
    from deepspeed_offload.bench.profile import summarize

    def x(cat, name, ts, dur, stream, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "args": dict(args, stream=stream)}

    events = []
    for it in (0, 1000):  # two iterations of 1000 us: forward 0-300, backward 300-800, step 800-900
        events += [x("gpu_user_annotation", "forward", it, 300, 7), x("gpu_user_annotation", "backward", it + 300, 500, 7),
                   x("gpu_user_annotation", "step", it + 800, 100, 7),
                   x("kernel", "gemm", it, 300, 7), x("kernel", "gemm", it + 300, 400, 7),
                   x("kernel", "adam", it + 350, 100, 30), x("kernel", "adam", it + 400, 100, 30),  # overlapping: 150 us
                   x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", it + 310, 200, 20, bytes=10**9),
                   x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", it + 820, 250, 21, bytes=2 * 10**9)]
    out = summarize({"traceEvents": events})
    assert out["phases_s"]["forward"] == [0.0, 0.0003] and out["phases_s"]["step"] == [0.0008, 0.0009]
    assert out["iteration_s"] == 0.00107  # to the end of the last copy
    by = {s["stream"]: s for s in out["streams"]}
    assert by[7]["busy_s"]["backward"] == 0.0004 and by[7]["busy_s"]["step"] == 0.0
    assert by[30]["busy_s"]["backward"] == 0.00015 and by[30]["kernel_s"] == 0.0002
    assert by[20]["h2d_GB"] == 1.0 and by[21]["d2h_GB"] == 2.0
    assert by[21]["busy_s"]["step"] == 0.00008 and by[21]["busy_s"]["after_step"] == 0.00017
    assert summarize({"traceEvents": []}) == {"error": "no forward/backward/step ranges in the trace"}


def test_profile_summary_takes_a_phase_on_every_stream_that_ran_it():
    """The profiler annotates a range once per stream that ran its work: the step's updates on the
    compute stream, its write-backs on the D2H stream, its commits' copies on the side stream (the
    last to start). The phase runs from the first to the end of the last; the iteration begins with
    the first of its forward's annotations after the main thread launched it (the step before it,
    unsynchronized, may still run on the GPU then, and is not its)."""
    from deepspeed_offload.bench.profile import summarize

    def x(cat, name, ts, dur, stream):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": stream, "args": {"stream": stream}}

    events = []
    for it in (0, 1000):  # the CPU launches each iteration at it - 50; forward 0-300, backward 300-800
        events += [x("user_annotation", "forward", it - 50, 100, 1), x("user_annotation", "backward", it + 50, 100, 1),
                   x("user_annotation", "step", it + 150, 900, 1),
                   x("gpu_user_annotation", "forward", it, 300, 7), x("gpu_user_annotation", "forward", it + 20, 200, 33),
                   x("gpu_user_annotation", "backward", it + 300, 500, 7),
                   x("gpu_user_annotation", "step", it + 800, 100, 7),  # updates
                   x("gpu_user_annotation", "step", it + 810, 240, 44),  # write-backs, to 1050
                   x("gpu_user_annotation", "step", it + 880, 15, 48),  # commits' copies, last to start
                   x("kernel", "gemm", it, 300, 7), x("kernel", "gemm", it + 300, 500, 7)]
    events.append(x("gpu_user_annotation", "step", 960, 60, 7))  # the first iteration's, after the second's launch
    out = summarize({"traceEvents": events})
    assert out["phases_s"]["forward"] == [0.0, 0.0003]
    assert out["phases_s"]["backward"] == [0.0003, 0.0008]
    assert out["phases_s"]["step"] == [0.0008, 0.00105]


def test_profile_summary_says_where_the_cpu_waited_for_the_device():
    """``host_waits``: the last iteration's synchronizing runtime calls per phase (the main thread's
    ranges; backward's autograd thread counted in backward), by call and the operators around it on
    its thread, innermost first; the first iteration's and the other runtime calls are not counted."""
    from deepspeed_offload.bench.profile import summarize

    def x(cat, name, ts, dur, tid):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": {"stream": tid}}

    events = []
    for it in (0, 1000):  # forward 0-100, backward 100-600 (autograd's thread 2), step 600-900, main thread 1
        events += [x("user_annotation", "forward", it, 100, 1), x("user_annotation", "backward", it + 100, 20, 1),
                   x("user_annotation", "step", it + 600, 300, 1), x("gpu_user_annotation", "forward", it + 5, 100, 7),
                   x("gpu_user_annotation", "backward", it + 105, 500, 7),
                   x("gpu_user_annotation", "step", it + 605, 300, 7)]
        for k in range(3):  # per sub-group: torch.tensor(-1.0, device=...) in DeepSpeed's norm
            t = it + 610 + 10 * k
            events += [x("cpu_op", "aten::to", t, 8, 1), x("cpu_op", "aten::_to_copy", t + 1, 6, 1),
                       x("cpu_op", "aten::copy_", t + 2, 4, 1), x("cuda_runtime", "cudaMemcpyAsync", t + 3, 1, 1),
                       x("cuda_runtime", "cudaStreamSynchronize", t + 4, 2, 1)]
        events += [x("cpu_op", "aten::item", it + 50, 30, 1), x("cpu_op", "aten::_local_scalar_dense", it + 51, 28, 1),
                   x("cuda_runtime", "cudaStreamSynchronize", it + 60, 20, 1),
                   x("cuda_runtime", "cudaEventSynchronize", it + 300, 50, 2),  # autograd's thread, from Python
                   x("cuda_runtime", "cudaLaunchKernel", it + 310, 5, 2),
                   x("cuda_runtime", "cudaHostUnregister", it + 700, 25, 1)]
    waits = summarize({"traceEvents": events})["host_waits"]
    assert waits == {
        "forward": {"cudaStreamSynchronize in aten::_local_scalar_dense < aten::item": {"count": 1, "seconds": 2e-05}},
        "backward": {"cudaEventSynchronize in python": {"count": 1, "seconds": 5e-05}},
        "step": {"cudaStreamSynchronize in aten::copy_ < aten::_to_copy < aten::to": {"count": 3, "seconds": 6e-06},
                 "cudaHostUnregister in python": {"count": 1, "seconds": 2.5e-05}}}


def test_profile_summary_says_why_the_compute_stream_idled():
    """``compute_idle``: per phase, each gap on the compute stream (the one with the most kernel time) split
    at its next operation's launch: before it the CPU was late (and what its launching thread ran then,
    by innermost operator, ``python`` where none), after it the device waited; gaps of the launch
    pipeline's size and other streams' work are not idling."""
    from deepspeed_offload.bench.profile import summarize

    def x(cat, name, ts, dur, tid, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    events = []
    for it in (0, 10000):  # forward 0-1000, backward 1000-3000, step 3000-3500; autograd's thread 2
        events += [x("user_annotation", "forward", it, 100, 1), x("user_annotation", "backward", it + 100, 50, 1),
                   x("user_annotation", "step", it + 3000, 100, 1),
                   x("gpu_user_annotation", "forward", it + 10, 990, 7, stream=7),
                   x("gpu_user_annotation", "backward", it + 1000, 2000, 7, stream=7),
                   x("gpu_user_annotation", "step", it + 3000, 500, 7, stream=7),
                   x("kernel", "fwd", it + 10, 990, 7, stream=7, correlation=it + 1),
                   x("cuda_runtime", "cudaLaunchKernel", it + 5, 3, 1, correlation=it + 1),
                   # backward: launched at 1050, ran 1100-1300; then autograd's thread ran a hook
                   # (AccumulateGrad, 1320-1780, an aten::empty of 400 us in it) and launched at 1790
                   x("kernel", "b1", it + 1100, 200, 7, stream=7, correlation=it + 2),
                   x("cuda_runtime", "cudaLaunchKernel", it + 1050, 3, 2, correlation=it + 2),
                   x("cpu_op", "torch::autograd::AccumulateGrad", it + 1320, 460, 2),
                   x("cpu_op", "aten::empty", it + 1340, 400, 2),
                   x("kernel", "b2", it + 1800, 200, 7, stream=7, correlation=it + 3),
                   x("cuda_runtime", "cudaLaunchKernel", it + 1790, 3, 2, correlation=it + 3),
                   # launched at 2010, in time, but started at 2110 after a copy on stream 40
                   x("gpu_memcpy", "Memcpy HtoD", it + 1100, 1000, 40, stream=40, correlation=it + 4),
                   x("kernel", "b3", it + 2110, 200, 7, stream=7, correlation=it + 5),
                   x("cuda_runtime", "cudaLaunchKernel", it + 2010, 3, 2, correlation=it + 5),
                   x("kernel", "b4", it + 2315, 600, 7, stream=7, correlation=it + 6),  # a 5 us gap: none
                   x("cuda_runtime", "cudaLaunchKernel", it + 2200, 3, 2, correlation=it + 6),
                   x("kernel", "s", it + 3010, 400, 7, stream=7, correlation=it + 7),
                   x("cuda_runtime", "cudaLaunchKernel", it + 3005, 3, 1, correlation=it + 7)]
    idle = summarize({"traceEvents": events})["compute_idle"]
    back = idle["backward"]
    # gaps 1000-1100 (late 50: launched at 1050), 1300-1800 (late 490), 2000-2110 (late 10, waited 100)
    assert back["idle_s"] == pytest.approx(710e-6) and back["host_late_s"] == pytest.approx(550e-6)
    assert back["device_wait_s"] == pytest.approx(160e-6)
    assert back["host_late_by"] == pytest.approx({"aten::empty": 400e-6, "torch::autograd::AccumulateGrad": 60e-6,
                                                 "python": 90e-6})
    assert idle["forward"]["idle_s"] == 0 and idle["step"]["idle_s"] == 0 and idle["forward"]["host_late_by"] == {}


def test_the_llama_is_checkpointed_in_the_style_asked_without_the_deprecated_call():
    """``--grad-ckpt reentrant|non-reentrant``: every decoder layer checkpointed with that
    ``use_reentrant``, through ``activation_checkpointing_enable`` where transformers has it (its old
    name warns from 5.25 on); off without the flag."""
    import warnings
    for style, reentrant in (("reentrant", True), ("non-reentrant", False)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model = models.build_llama(parse(*TINY_LLAMA, "--grad-ckpt", style))
        layers = model.model.layers
        assert all(layer.gradient_checkpointing for layer in layers)
        assert {layer._gradient_checkpointing_func.keywords["use_reentrant"] for layer in layers} == {reentrant}
        assert not [w for w in seen if "checkpointing_enable" in str(w.message)], [str(w.message) for w in seen]
    assert not any(layer.gradient_checkpointing for layer in models.build_llama(parse(*TINY_LLAMA)).model.layers)


def test_the_plan_record_reads_the_measured_plan_it_runs_with():
    """Where a run ends (resident, streamed) and what the measured plan decided on, read from a real
    ``MeasuredPlan`` (the record is written only on a device with memory of its own, so the CPU runs of
    the worker never reach it)."""
    from types import SimpleNamespace

    gib = 2**30
    plan = MeasuredPlan(limit=80 * gib, margin=2 * gib)
    promote, back = plan.decide(60 * gib, [3, 4, 5], lambda i: 4 * gib, resident_bytes=12 * gib)
    assert promote == [3, 4, 5] and back == []
    plan.landed(promote, back)  # (the move landed: runtime/step/moves.py)
    plan.held_back = gib // 2
    handle = SimpleNamespace(probe=SimpleNamespace(resident_bytes=lambda n: n * 4 * gib), resident=[0, 1, 2, 3, 4, 5],
                             layout=SimpleNamespace(nbytes={6: 4 * gib}), order=[6], plan=plan,
                             timing=SimpleNamespace(measurements=1, divergences=0))
    record = plan_record(handle)
    assert record == dict(resident_GiB=24.0, resident_sub_groups=6, streamed_GiB=4.0, streamed_sub_groups=1,
                          measurements=1, divergences=0, promoted=3, give_backs=0, decided_peak_reserved_GiB=60.0,
                          iteration_GiB=48.0, limit_GiB=80.0, margin_GiB=2.0, held_back_GiB=0.5)
    json.dumps(record)


def test_peaks_hold_through_the_runtimes_own_resets():
    """The measured plan resets the accelerator's peak statistics inside an iteration (DeviceMemory,
    the load policy's intervals): within ``Peaks.watching()`` each such reset folds the peak so far in,
    so the iteration's peak is its own (here 9 GiB, before the runtime's reset), not the 5 GiB after
    it; ``start()`` begins a new span; the accelerator's method is its class's again afterwards."""
    from deepspeed_offload.bench.peaks import Peaks

    class Acc:  # the accelerator's peak statistics
        def __init__(self):
            self.now = self.peak = self.reserved_peak = 0

        def allocate(self, n):
            self.now += n
            self.peak, self.reserved_peak = max(self.peak, self.now), max(self.reserved_peak, self.now + 1)

        def reset_peak_memory_stats(self):
            self.peak = self.reserved_peak = self.now

        def max_memory_allocated(self):
            return self.peak

        def max_memory_reserved(self):
            return self.reserved_peak

    acc = Acc()
    runtime_resets = acc  # the runtime holds the same accelerator object
    peaks = Peaks(acc)
    with peaks.watching():
        acc.allocate(4)
        peaks.start()
        acc.allocate(5)  # 9 allocated: the iteration's peak
        acc.allocate(-6)
        runtime_resets.reset_peak_memory_stats()  # the measured plan's interval
        acc.allocate(2)  # 5
        assert (peaks.allocated(), peaks.reserved()) == (9, 10)
        assert acc.max_memory_allocated() == 5  # what the statistics alone would say
        peaks.start()
        acc.allocate(1)
        assert (peaks.allocated(), peaks.reserved()) == (6, 7)
    assert "reset_peak_memory_stats" not in vars(acc)


def test_sync_sites_name_the_python_line_of_each_synchronizing_call():
    """``collect_sites``: the sync debug mode's warnings, by phase and by the two innermost frames outside
    torch and the warnings machinery (the line that called, then its caller), each time, whatever the
    filters; a warning outside a phase is not counted, and any other warning still reaches the caller's
    filters."""
    import inspect
    import warnings
    from deepspeed_offload.bench.profile import SYNC_WARNING, collect_sites

    phase = {"now": None}

    def norm_of(group):  # DeepSpeed's get_grad_norm_direct, say: one wait per sub-group
        warnings.warn("called a " + SYNC_WARNING)

    def norms(groups):
        for g in range(groups):
            norm_of(g)

    def run():
        phase["now"] = "forward"
        warnings.warn("called a " + SYNC_WARNING)
        phase["now"] = "step"
        norms(3)
        warnings.warn("something else", UserWarning)
        phase["now"] = None
        warnings.warn("called a " + SYNC_WARNING)  # (the final synchronize: not a phase's)

    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("default")  # once per place; the debug mode's are counted every time
        called_at = inspect.currentframe().f_lineno + 1
        sites = collect_sites(run, phase)
    here = "tests/unit/test_bench.py"
    line = {name: inspect.getsourcelines(fn)[1] for name, fn in (("norm_of", norm_of), ("norms", norms), ("run", run))}
    assert sites == {
        "forward": {f"{here}:{line['run'] + 2} run < {here}:{called_at} {inspect.currentframe().f_code.co_name}": 1},
        "step": {f"{here}:{line['norm_of'] + 1} norm_of < {here}:{line['norms'] + 2} norms": 3}}
    assert [str(w.message) for w in others] == ["something else"]


def test_rounds_run_the_modes_in_turn_and_pool_them(tmp_path, monkeypatch):
    """``--rounds 3``: resident and stream_speculate in turn, every other round reversed; each mode's
    iterations pooled (medians over all rounds, the mean of the pipelined means, the worst peaks),
    and its time over resident's round by round. The machine drifts: every launch is 10% slower
    than the one before, and speculation takes 1.2x resident's time in its own launch."""
    launched = []

    def run(cmd, env, timeout):
        mode = cmd_mode(cmd)
        launched.append(mode)
        drift = 1.1 ** (len(launched) - 1)
        t = drift * (1.2 if mode == "stream_speculate" else 1.0)
        rows = [{"iter_s": t * f, "step_s": 0.1, "fwd_bwd_s": t * f - 0.1, "peak_iter_GiB": 1.0 + len(launched),
                 "peak_reserved_GiB": 2.0, "between_GiB": 0.5} for f in (0.9, 1.0, 1.1)]
        result = dict(from_rows(rows), pipelined_iter_s=t, pipelined_iter_s_median=t, pipelined_peak_GiB=float(len(launched)),
                      params=10, launch=len(launched))
        Path(cmd[cmd.index("--result-file") + 1]).write_text(json.dumps(result))
        return f"log of {mode} {len(launched)}", False

    monkeypatch.setattr(driver, "run_process", run)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    out = tmp_path / "b.json"
    assert driver.main(["--out", str(out), "--modes", "resident,stream_speculate", "--rounds", "3", "--trace"]) == 0
    assert launched == ["resident", "stream_speculate", "stream_speculate", "resident", "resident", "stream_speculate"]
    assert (tmp_path / "b-round2-stream_speculate.log").read_text() == "log of stream_speculate 3"
    summary = json.loads(out.read_text())
    res, spec = summary["results"]["resident"], summary["results"]["stream_speculate"]
    drift = [1.1 ** k for k in range(6)]
    assert [r["iter_s"] for r in res["rounds"]] == pytest.approx([drift[0], drift[3], drift[4]])
    assert [r["iter_s"] for r in spec["rounds"]] == pytest.approx([1.2 * drift[1], 1.2 * drift[2], 1.2 * drift[5]])
    assert len(spec["per_iter"]) == 9 and spec["iter_s"] == pytest.approx(1.2 * drift[2])  # the pooled median
    assert spec["pipelined_iter_s"] == pytest.approx(1.2 * (drift[1] + drift[2] + drift[5]) / 3)
    assert spec["peak_iter_GiB"] == 7.0 and spec["pipelined_peak_GiB"] == 6.0  # the worst round's
    assert spec["launch"] == 6  # what the handle reported: the last round's
    ratios = spec["by_round"]["iter_s"]["ratios"]
    assert ratios == pytest.approx([1.2 * 1.1, 1.2 / 1.1, 1.2 * 1.1])
    assert spec["by_round"]["iter_s"]["median"] == pytest.approx(1.32)
    assert "by_round" not in res
    assert "stream_speculate: x resident by round: synchronized 1.32, 1.09, 1.32 (median 1.32); pipelined " \
        in reporting.report(summary)
    # more than one round never resumes: every mode runs afresh
    assert driver.main(["--out", str(out), "--modes", "resident", "--rounds", "2", "--resume"]) == 2
    assert driver.main(["--out", str(out), "--modes", "resident", "--rounds", "0"]) == 2


def test_two_buckets_of_one_mode_run_in_turn(tmp_path, fake_workers):
    """The driver launches ``NAME/bucket=N`` like any mode: in turn with NAME round by round, its
    worker told the full name, its result under it, its log in a file of its own, against resident."""
    out = tmp_path / "b.json"
    modes_arg = "stream_overlap,default@0,default@0/bucket=22369621"
    assert driver.main(["--out", str(out), "--modes", modes_arg, "--rounds", "2",
                        "--timeout", "300,default@0/bucket=22369621=400"]) == 0
    both = ["stream_overlap", "default@0", "default@0/bucket=22369621"]
    assert launched_modes(fake_workers) == both + both[::-1]
    assert [t for cmd, t in fake_workers][2] == 400
    results = json.loads(out.read_text())["results"]
    assert set(results) == set(both) and "iter_s" in results["default@0/bucket=22369621"]
    assert (tmp_path / "b-round2-default_at_0_bucket22369621.log").exists()


def test_a_failed_round_is_the_mode_s_result():
    good = dict(from_rows([{"iter_s": 1.0, "step_s": 0.1, "fwd_bwd_s": 0.9, "peak_iter_GiB": 1.0,
                            "peak_reserved_GiB": 1.0}]), pipelined_iter_s=1.0)
    pooled = pool_rounds([good, {"error": "boom"}, good])
    assert pooled == {"error": "boom", "round": 2}
    assert pool_rounds([{"h2d_GBps": 50.0}, {"h2d_GBps": 52.0}]) == {"h2d_GBps": 52.0}  # the probe: its last


def test_rounds_probe_once_and_do_not_repeat_a_failed_mode(tmp_path, fake_workers):
    """With ``--rounds 2``: the bandwidth probe runs in the first round only, and a mode that failed
    in a round is not run again (a mode that hangs would cost its timeout in every round)."""
    out = tmp_path / "b.json"
    assert driver.main(["--out", str(out), "--modes", "bandwidth,stream_overlap,stream", "--rounds", "2"]) == 0
    assert launched_modes(fake_workers) == ["bandwidth", "stream_overlap", "stream", "stream_overlap"]
    res = json.loads(out.read_text())["results"]
    assert "boom" in res["stream"]["error"] and res["stream"]["round"] == 1
    assert "iter_s" in res["stream_overlap"] and "iter_s" in res["bandwidth"]
