"""bench/: the memory meter, the baselines, the harness's records, the report, demo and bench.

Everything runs on the ``tiny`` presets with a few steps: these tests check what the harness
promises (bitwise losses across baselines, budgets held, records complete, errors clear, OOMs
reported instead of crashing the sweep), never how fast anything is.
"""
from __future__ import annotations

import json
import weakref

import pytest
import torch
import torch.nn as nn

import chameleon_swap as cs
from chameleon_swap import cli
from chameleon_swap.bench import baselines as B
from chameleon_swap.bench import commands
from chameleon_swap.bench.harness import SweepConfig, parse_budget, run_sweep
from chameleon_swap.bench.meter import MemoryMeter
from chameleon_swap.bench.swap_all import SwapAll
from chameleon_swap.copy.host_pool import HostPool
from chameleon_swap.workloads import WORKLOADS

CPU = torch.device("cpu")
REQUIRED = {"workload", "baseline", "budget_bytes", "step_seconds_median", "peak_bytes", "oom",
            "losses_identical", "device", "torch", "commit", "config"}


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


# --------------------------------------------------------------------------- meter
def test_meter_counts_new_storages_until_they_die_and_nothing_else():
    base = torch.ones(1000)                       # exists before: never counted
    with MemoryMeter(CPU) as m:
        a = base * 2                              # 4000 bytes, new
        v = a[10:20].t() if a.dim() > 1 else a[10:20]   # a view: nothing new
        a.add_(1)                                 # in place: nothing new
        b = torch.empty(500, dtype=torch.float64)  # 4000 bytes, new
        assert m.live_bytes == 8000
        del a, v                                  # the storage dies with its last tensor
        assert m.live_bytes == 4000
        c = base.clone()
    assert m.peak_bytes == 8000 and m.live_bytes == 8000
    assert m.curve[0][1:] == (0, 0) and max(x for _, x, _ in m.curve) == 8000
    del b, c


def test_meter_leaves_out_host_buffers_the_pool_allocates():
    pool = HostPool(2**24, pin=False)
    with MemoryMeter(CPU) as m:
        buf = pool.acquire(10**6)                 # host memory, though it is RAM here too
        x = torch.ones(1000)
    assert m.peak_bytes == x.nbytes
    pool.release(buf)


def test_meter_sees_what_checkpointing_hides_from_saved_tensor_hooks():
    from torch.utils.checkpoint import checkpoint
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
              for _ in range(4)]
    x = torch.randn(256, 64)

    def peak(call):
        with MemoryMeter(CPU) as m:
            h = x
            for b in blocks:
                h = call(b, h)
            h.sum().backward()
        return m.peak_bytes
    plain = peak(lambda b, h: b(h))
    ckpt = peak(lambda b, h: checkpoint(b, h, use_reentrant=False))   # one block at a time
    assert 0 < ckpt <= plain - 2 * x.nbytes      # at least two activations fewer at the peak


# --------------------------------------------------------------------------- baselines
def test_unknown_baseline_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown baseline 'recompute'.*full-recompute"):
        B.make_baseline("recompute", CPU, None)


def test_command_names_match_the_registries():
    # commands.py keeps the names without importing torch; they must not drift.
    assert commands.WORKLOAD_NAMES == tuple(WORKLOADS)
    assert commands.BASELINE_NAMES == B.BASELINES


class _Transposes(nn.Module):
    """Saves a transpose (non-contiguous), a parameter view and small tensors."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 48) / 7)

    def forward(self, x):
        h = torch.tanh(x @ self.w)
        g = h.t() @ h                     # saves h.t() (a transpose) and h
        return (torch.sin(g) * h.sum()).sum() + (self.w.t() * 2).sum()


def test_swap_all_is_bitwise_moves_activations_and_keeps_parameters():
    torch.manual_seed(0)
    ref, test = _Transposes(), _Transposes()
    test.load_state_dict(ref.state_dict())
    x = torch.randn(64, 48)
    ref(x).backward()
    swap = SwapAll(CPU, 2**26)
    with swap.step():
        loss = test(x)
        loss.backward()
    assert torch.equal(loss, ref(x))
    assert torch.equal(test.w.grad, ref.w.grad)
    assert swap.moved_bytes > 0 and swap.fetched_bytes == swap.moved_bytes
    assert swap.pool.in_use_bytes == 0            # every host buffer back in the pool
    swap.close()


def test_swap_all_drops_each_fetched_tensor_once_backward_used_it():
    # If the baseline held fetched tensors until the step ended, its peak would be unfairly high.
    lin = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(6)])
    x = torch.randn(512, 128)
    swap = SwapAll(CPU, 2**28)
    refs = []
    real = swap._unpack

    def spy(s):
        t = real(s)
        if isinstance(s, object) and t is not None and t.numel() > 1000:
            refs.append(weakref.ref(t))
        return t
    swap._unpack = spy
    with swap.step():
        lin(x).sum().backward()
        alive = sum(r() is not None for r in refs)
    assert refs and alive <= 2


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("kwargs,match", [
    (dict(budgets=["150%"]), "percentage"), (dict(budgets=["abc%"]), "percentage"),
    (dict(budgets=["lots"]), "budget"), (dict(budgets=[]), "budgets"),
    (dict(steps=0), "steps"), (dict(warmup=-1), "warmup"), (dict(threads=0), "threads"),
    (dict(workloads=["gpt5"]), "unknown workload 'gpt5'.*llama-varlen"),
    (dict(baselines=["zero"]), "unknown baseline 'zero'"),
    (dict(device_memory="1GiB"), "device_memory caps CUDA"),
    (dict(lr=0), "lr"), (dict(size="huge"), "size"),
])
def test_sweep_config_errors_name_the_argument(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SweepConfig(**{"size": "tiny", **kwargs})


def test_parse_budget():
    assert parse_budget("30%").resolve(1000) == 300
    assert parse_budget("4KiB").resolve(10**9) == 4096
    assert parse_budget(123).resolve(5) == 123


# --------------------------------------------------------------------------- the sweep
@pytest.fixture(scope="module")
def sweep():
    cfg = SweepConfig(workloads=["llama-varlen", "moe"], baselines=list(B.BASELINES),
                      budgets=["30%", "70%"], steps=3, warmup=1, size="tiny", seed=3)
    seen = {}
    recs = run_sweep(cfg, {"device": "cpu", "torch": torch.__version__, "commit": "test"},
                     on_workload=lambda name, r, info: seen.setdefault(name, info))
    return cfg, recs, seen


def test_every_baseline_every_workload_every_budget_has_a_complete_record(sweep):
    cfg, recs, _ = sweep
    assert len(recs) == 2 * len(B.BASELINES) * 2      # peers repeated per budget, as a table
    for r in recs:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["error"] is None and not r["oom"], r["error"]
        assert len(r["per_step"]) == cfg.warmup + cfg.steps
        assert r["step_seconds_median"] > 0 and r["tokens_per_second"] > 0
        assert r["peak_bytes"] > 0 and r["peak_source"] == "meter"
    json.dumps(recs)                                    # JSON all the way down


def test_losses_are_bitwise_identical_across_all_baselines(sweep):
    _, recs, _ = sweep
    assert all(r["losses_identical"] is True for r in recs)


def test_engine_runs_hold_their_budget_and_move_bytes(sweep):
    _, recs, _ = sweep
    for r in recs:
        if r["budget_applies"]:
            assert r["budget_held"] is True
            assert r["activation_peak_bytes"] <= r["budget_bytes"] < r["natural_peak_bytes"]
            # Swapped, or (hybrid) recomputed instead.
            assert r["moved_bytes"] > 0 or any(s.get("recomputed_bytes")
                                               for s in r["per_step"])
            assert sum(r["plan_sources"].values()) == len(r["per_step"]) - 1 + 1
        else:
            assert r["activation_peak_bytes"] is None and r["sequence_changes"] is None


def test_fits_compares_each_step_with_the_memory_its_budget_implies(sweep):
    _, recs, _ = sweep
    for w in ("llama-varlen", "moe"):
        rows = [r for r in recs if r["workload"] == w]
        none = {r["budget"]: r for r in rows if r["baseline"] == "none"}
        for r in rows:
            caps = [s["memory_cap_bytes"] for s in r["per_step"]]
            assert len(caps) == len(r["per_step"]) and r["memory_cap_bytes"] == max(caps)
            # The same caps for every baseline: they come from the no-engine run.
            assert caps == [s["memory_cap_bytes"] for s in none[r["budget"]]["per_step"]]
        # Holding activations to 30% needs less memory than keeping them all...
        assert none["30%"]["memory_cap_bytes"] < none["30%"]["peak_bytes"]
        assert none["30%"]["fits"] is False
        assert all(r["ratio_vs_none"] == 1.0 for r in none.values())
        # ...and every engine run, which holds its activations to the budget, fits.
        assert all(r["fits"] is True for r in rows if r["budget_applies"])
        full = [r for r in rows if r["baseline"] == "full-recompute"]
        assert all(f["peak_bytes"] < none["30%"]["peak_bytes"] for f in full)


def test_curves_are_recorded_for_the_largest_step(sweep):
    _, _, seen = sweep
    for name, info in seen.items():
        (step,) = info["curve_steps"]
        tokens = [s["tokens"] for s in info["schedule"] if s["train"]]
        assert info["schedule"][step]["tokens"] == max(tokens)
        assert all(step in run.curves and len(run.curves[step]) > 2 for run in info["runs"])


def test_report_table_and_figures(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    from chameleon_swap.bench.report import markdown, plot_workload
    _, recs, seen = sweep
    md = markdown(recs)
    assert md.count("### ") == 2 and "swap-all (ours)" in md and "| 30% (" in md
    files = plot_workload("moe", [r for r in recs if r["workload"] == "moe"], seen["moe"]["runs"],
                          seen["moe"], tmp_path)
    assert sorted(f.name for f in files) == ["memory-moe.png", "steps-moe.png",
                                             "throughput-moe.png"]
    assert all(f.stat().st_size > 5000 for f in files)


def test_an_oom_is_a_row_not_a_crash(monkeypatch):
    calls = {"n": 0}
    real = B.Recompute.step

    def failing(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self)
    monkeypatch.setattr(B.Recompute, "step", failing)
    cfg = SweepConfig(workloads=["llama-varlen"], baselines=["none", "full-recompute", "guard"],
                      budgets=["50%"], steps=3, warmup=0, size="tiny", meter=False)
    recs = {r["baseline"]: r for r in run_sweep(cfg, {})}
    assert recs["full-recompute"]["oom"] is True
    assert "out of memory" in recs["full-recompute"]["error"]
    assert recs["full-recompute"]["step_seconds_median"] is None
    assert recs["none"]["oom"] is False and recs["guard"]["losses_identical"] is True


def test_other_errors_are_not_swallowed(monkeypatch):
    monkeypatch.setattr(B.SaveOnCpu, "step", lambda self: (_ for _ in ()).throw(KeyError("bug")))
    cfg = SweepConfig(workloads=["llama-varlen"], baselines=["none", "save-on-cpu"],
                      budgets=["50%"], steps=1, warmup=0, size="tiny", meter=False)
    with pytest.raises(KeyError):
        run_sweep(cfg, {})


def test_eval_and_accumulation_steps_run_under_every_kind_of_baseline():
    cfg = SweepConfig(workloads=["mixed"], baselines=["none", "selective-recompute", "chameleon"],
                      budgets=["30%"], steps=6, warmup=0, size="tiny", meter=False)
    recs = run_sweep(cfg, {})
    assert all(r["losses_identical"] for r in recs)
    steps = recs[0]["per_step"]
    assert any(not s["train"] for s in steps) and any(not s["optimizer_step"] for s in steps)


# --------------------------------------------------------------------------- the commands
def test_bench_command_writes_results(tmp_path, capsys):
    out = tmp_path / "b"
    assert cli.main(["bench", "--workload", "layerdrop", "--baseline", "none", "chameleon",
                     "--budget", "40%", "--steps", "2", "--warmup", "1", "--size", "tiny",
                     "--out", str(out)]) == 0
    recs = json.loads((out / "results.json").read_text())
    assert isinstance(recs, list) and len(recs) == 2
    assert all(REQUIRED <= set(r) for r in recs)
    assert (out / "results.md").read_text().startswith("# chameleon-swap bench")
    assert "| 40% (" in capsys.readouterr().out


def _bench_config(*argv):
    parser, _ = cli.build_parser()
    return commands.bench_config(parser.parse_args(["bench", "--size", "tiny", "--device", "cpu",
                                                    *argv]))


def test_bench_quick_plans_a_fraction_of_the_full_sweep():
    from chameleon_swap.bench.harness import steps_per_workload
    full, quick = _bench_config(), _bench_config("--quick")
    assert list(full.workloads) == list(commands.WORKLOAD_NAMES)
    assert list(quick.workloads) == ["llama-varlen"]
    assert list(quick.baselines) == ["none", "full-recompute", "chameleon"]
    assert [b.label for b in quick.parsed_budgets] == ["30%"]
    assert (quick.steps, quick.warmup) == (4, 1)

    def planned(cfg):                   # step runs of the whole sweep
        return steps_per_workload(cfg) * len(cfg.resolved)
    assert planned(quick) * 20 <= planned(full), (planned(quick), planned(full))
    # What the command line says still applies under --quick.
    mine = _bench_config("--quick", "--workload", "moe", "--steps", "2", "--budget", "50%")
    assert list(mine.workloads) == ["moe"] and mine.steps == 2 and mine.warmup == 1
    assert [b.label for b in mine.parsed_budgets] == ["50%"]
    assert list(mine.baselines) == list(quick.baselines)


@pytest.mark.parametrize("argv,match", [
    (["--workload", "bert"], "unknown workload 'bert'; valid: llama-varlen"),
    (["--baseline", "magic"], "unknown baseline 'magic'; choose from none"),
    (["--budget", "200%"], "percentage"),
])
def test_bench_command_rejects_bad_names_with_the_valid_ones(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--size", "tiny", *argv])
    assert e.value.code == 2
    assert match.split(";")[0] in capsys.readouterr().err


def test_demo_end_to_end(tmp_path, capsys, monkeypatch):
    from chameleon_swap.bench import demo
    bars = []
    real = demo.progress

    def counted(total, description):
        bar = {"total": total, "done": 0}
        bars.append(bar)
        ctx = real(total, description)

        class Counted:
            def __enter__(self):
                inner = ctx.__enter__()

                def advance(*a, **k):
                    bar["done"] += 1
                    inner(*a, **k)
                return advance

            def __exit__(self, *exc):
                return ctx.__exit__(*exc)
        return Counted()
    monkeypatch.setattr(demo, "progress", counted)
    out = tmp_path / "demo"
    assert cli.main(["demo", "--size", "tiny", "--steps", "5", "--out", str(out)]) == 0
    # Each progress bar counts to its total (the sweep's once overran it: 360 of 240).
    assert bars and all(b["done"] == b["total"] for b in bars), bars
    s = json.loads((out / "summary.json").read_text())
    for key in ("budget_bytes", "max_peak_resident_bytes", "losses_identical", "overhead_ratio",
                "sequence_changes", "steps"):
        assert key in s
    assert s["losses_identical"] is True and s["budget_held"] is True
    assert s["max_peak_resident_bytes"] <= s["budget_bytes"]
    assert s["budget_bytes"] == int(0.3 * s["natural_peak_bytes"])
    assert len(s["steps"]) == 2 * 5 and {x["workload"] for x in s["steps"]} == {"llama-varlen", "moe"}
    assert all(x["peak_resident_bytes"] <= s["budget_bytes"] for x in s["steps"])
    assert s["overhead_ratio"] > 0 and s["sequence_changes"] >= 1
    wall = s["wall_seconds"]
    assert 0 < wall["swapping"] < wall["total"] and 0 < wall["choice"] < wall["total"]
    assert wall["total"] == pytest.approx(wall["swapping"] + wall["choice"])
    screen = capsys.readouterr().out
    assert "budget held on every step" in screen and "losses identical" in screen
    assert f"the demo took {wall['total']:.0f} s" in screen
    # The header states the budget's share of each workload's own peak, not only of the larger.
    header = screen.splitlines()[1]
    for name, w in s["workloads"].items():
        share = s["budget_bytes"] / w["natural_peak_bytes"]
        assert f"{share:.0%} of {name}'s" in header
    try:
        import matplotlib  # noqa: F401
        assert (out / "demo.png").stat().st_size > 10000
    except ImportError:
        pass


def test_demo_rejects_too_few_steps(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--steps", "2", "--size", "tiny"])
    assert "steps must be an int > 2" in capsys.readouterr().err


def test_engine_baseline_uses_the_public_engine():
    b = B.make_baseline("guard", CPU, 1234)
    assert isinstance(b.engine, cs.Chameleon) and b.engine.budget_bytes == 1234
    assert b.engine.policy == "guard"
    b.close()


def test_meter_caps_are_the_memory_with_saved_activations_held_to_each_budget():
    # Four 40 KB activations saved in forward, a 40 KB gradient-like tensor at the end.
    w = torch.randn(100, 100, requires_grad=True)
    x = torch.randn(100, 100)
    with MemoryMeter(CPU, budgets=(0, 80_000, 10**9)) as m:
        h = x
        for _ in range(4):
            h = torch.tanh(h @ w)           # saves its output (tanh) and its input (mm)
        h.sum().backward()
    assert m.largest_saved_bytes == 40_000
    assert m.caps[10**9] == m.peak_bytes                     # no budget: the step as it ran
    assert m.caps[0] < m.caps[80_000] < m.caps[10**9]
    # With nothing saved allowed on the device, only the unsaved bytes remain at each moment.
    assert m.caps[0] <= m.peak_bytes - 3 * 40_000
