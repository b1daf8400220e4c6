"""`python -m bench.experiments`: run grids, result files, tables and plots (no engine processes)."""

from __future__ import annotations

import math

import pytest
from corral_cli.bench.report import write_result_file

from bench.experiments import specs, tables
from bench.experiments.__main__ import main as experiments_main
from bench.experiments.execute import CONTEXT_LEN, run_record
from bench.experiments.plots import plot


def test_rate_grid_runs_every_rate_on_one_engine_per_max_num_seqs():
    experiment = specs.rate_x_seqs()
    groups = specs.group_by_engine(experiment.runs)
    assert [engine.max_num_seqs for engine, _ in groups] == [8, 16, 32, 64, 128]
    for engine, runs in groups:
        assert [r.load.request_rate for r in runs] == [10.0, 20.0, 40.0, math.inf]
        assert all(
            r.load.lengths == specs.LengthSpec(128, 128) and r.load.max_tokens_cap is None for r in runs
        )
        assert engine.num_kv_blocks is None and engine.kv_policy == "preempt"


def test_group_by_engine_keeps_order_and_splits_only_on_change():
    a, b = specs.EngineConfig(4), specs.EngineConfig(8)
    load = specs.LoadConfig(1.0, 2, specs.FIXED_128)
    runs = tuple(specs.RunSpec(e, load) for e in (a, a, b, a))
    assert [(e, len(rs)) for e, rs in specs.group_by_engine(runs)] == [(a, 2), (b, 1), (a, 1)]


@pytest.mark.parametrize("quick", [False, True])
def test_preemption_budget_fits_some_but_not_all_max_num_seqs(quick):
    experiment = specs.preemptions(quick)
    (blocks,) = {r.engine.num_kv_blocks for r in experiment.runs}
    (lengths,) = {r.load.lengths for r in experiment.runs}
    assert blocks is not None
    full_seqs_that_fit = blocks * 16 // (lengths.input_len + lengths.output_len)
    seqs = [r.engine.max_num_seqs for r in experiment.runs]
    assert min(seqs) <= full_seqs_that_fit < max(seqs)  # preemption starts somewhere in the sweep


def test_kv_budget_sweeps_blocks_at_fixed_max_num_seqs():
    runs = specs.kv_budget().runs
    assert len({r.engine.max_num_seqs for r in runs}) == 1
    blocks = [r.engine.num_kv_blocks for r in runs]
    assert blocks == sorted(blocks) and len(set(blocks)) == len(blocks) > 3


@pytest.mark.parametrize("quick", [False, True])
def test_policy_compares_policies_at_the_same_budget_with_lengths_hidden(quick):
    experiment = specs.policy(quick)
    cap = experiment.runs[0].load.lengths.max_output_len
    assert cap is not None
    by_budget: dict[int | None, set[tuple[str, str, int | None]]] = {}
    for run in experiment.runs:
        key = (run.engine.kv_policy, run.variant, run.load.max_tokens_cap)
        by_budget.setdefault(run.engine.num_kv_blocks, set()).add(key)
        lengths = run.load.lengths
        assert lengths.max_input_len is not None and lengths.max_input_len + cap <= CONTEXT_LEN
    for variants in by_budget.values():
        assert variants == {
            ("preempt", specs.PREEMPT, cap),  # max_tokens = the cap: the engine cannot know the length
            ("reserve", specs.RESERVE, cap),
            ("reserve", specs.RESERVE_KNOWN, None),  # the reference: max_tokens = the sampled length
        }


def test_unknown_experiment_is_an_error():
    with pytest.raises(ValueError, match="rate-x-seqs"):
        specs.build("nope")


def test_kv_bytes_per_token_from_config():
    tiny = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}
    assert specs.kv_bytes_per_token({**tiny, "dtype": "float32"}) == 2 * 2 * 2 * 16 * 4
    small = {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768, "num_hidden_layers": 12}
    assert specs.kv_bytes_per_token({**small, "dtype": "bfloat16"}) == 2 * 12 * 4 * 64 * 2


def _summary(rate: float, tput: float, preemptions: int | None = 0) -> dict:
    latencies = {
        f"{s}_{k}_ms": tput / 100
        for s in ("mean", "median", "p90", "p99")
        for k in ("ttft", "tpot", "itl", "e2el")
    }
    return {
        "request_rate": rate,
        "output_throughput": tput,
        "num_preemptions": preemptions,
        "completed": 10,
        "failed": 0,
        **latencies,
    }


def _doc(experiment: specs.Experiment, tputs: list[float]) -> dict:
    runs = [
        run_record(spec, _summary(spec.load.request_rate, t, i))
        for i, (spec, t) in enumerate(zip(experiment.runs, tputs, strict=True))
    ]
    meta = {
        "experiment": experiment.name,
        "title": experiment.title,
        "date_utc": "2026-11-22 08:00",
        "preset": "tiny",
        "num_cpus": 2,
        "wall_time_s": 12.0,
        "quick": True,
        "block_size": 16,
        "kv_bytes_per_token": 256,
    }
    return {**meta, "runs": runs}


def test_result_file_round_trip_and_rate_grid_table(tmp_path):
    experiment = specs.rate_x_seqs(quick=True)  # max_num_seqs 8, 32 x rates 20, inf
    doc = _doc(experiment, [100.0, 200.0, 300.0, 400.0])
    path = tmp_path / "result.json"
    write_result_file(path, {k: v for k, v in doc.items() if k != "runs"}, doc["runs"])
    loaded = tables.load_result(path)
    assert loaded["runs"][1]["request_rate"] == "inf"  # strict JSON has no infinity
    text = tables.render(loaded)
    assert "`tiny` demo model" in text and "(--quick)" in text
    assert "| max_num_seqs | 20 req/s | inf req/s |" in text
    assert "| 8 | 100 | 200 |" in text and "| 32 | 300 | 400 |" in text  # throughput pivot
    assert "| 8 | 1 | 2 |" in text  # TTFT p99 pivot (the fake latencies are tput / 100)


def test_load_result_rejects_other_json(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"runs": 3}')
    with pytest.raises(ValueError, match="not an experiment result"):
        tables.load_result(path)


def test_kv_and_policy_tables_name_budgets_and_policies():
    kv = _doc(specs.kv_budget(quick=True), [1.0, 2.0])  # 48 and 256 blocks
    text = tables.kv_budget_table(kv)
    assert "| 48 | 768 | 0.19 |" in text and "| 256 | 4,096 | 1.00 |" in text  # 256 bytes per token
    policy = _doc(specs.policy(quick=True), [1.0, 2.0, 3.0])
    lines = tables.policy_table(policy).splitlines()
    assert "| preempt | 128 |" in lines[2] and "| reserve, lengths known | sampled length |" in lines[4]
    preemptions = tables.preemptions_table(_doc(specs.preemptions(quick=True), [5.0, 6.0]))
    assert preemptions.splitlines()[3].startswith("| 8 | 6 |")


@pytest.mark.parametrize("name", specs.EXPERIMENTS)
def test_every_experiment_plots(tmp_path, name):
    experiment = specs.build(name, quick=True)
    doc = _doc(experiment, [float(i + 1) for i in range(len(experiment.runs))])
    doc["runs"][0]["num_preemptions"] = None  # a run whose /metrics scrape failed still draws
    png = tmp_path / f"{name}.png"
    plot(doc, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_render_command_rewrites_table_and_plot(tmp_path, capsys):
    doc = _doc(specs.preemptions(quick=True), [5.0, 6.0])
    write_result_file(tmp_path / "result.json", {k: v for k, v in doc.items() if k != "runs"}, doc["runs"])
    assert experiments_main(["render", str(tmp_path / "result.json")]) == 0
    assert "| max_num_seqs |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "experiments-preemptions.png").is_file()
    assert "| 2 | 5 |" in capsys.readouterr().out
    assert experiments_main(["render", str(tmp_path / "missing.json")]) == 1


def test_a_run_gives_the_callers_sigterm_handler_back(tmp_path, monkeypatch):
    """main() runs inside pytest (e2e/bench): its SIGTERM-to-SystemExit handler outlived the run and
    made the SIGTERM that later stopped pytest a SystemExit failing whichever test was running."""
    import signal

    from bench.experiments import execute

    def no_model(*_args):
        raise ValueError("no model here")  # the run's first step after the handler is set

    monkeypatch.setattr(execute, "ensure_model", no_model)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ValueError, match="no model here"):
        experiments_main(["preemptions", "--quick", "--out", str(tmp_path)])
    assert signal.getsignal(signal.SIGTERM) is before
