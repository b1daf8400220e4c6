"""`corral engine` flags round-trip with EngineArgs.to_cli_args (the operator renders them)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from corral_cli import cmd_engine
from corral_engine.args import EngineArgs


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cmd_engine.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "args",
    [
        EngineArgs(model="/m"),
        EngineArgs(
            model="/models/x",
            served_model_name="x",
            dtype="float32",
            device="cpu",
            block_size=32,
            num_kv_blocks=100,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=256,
            kv_policy="reserve",
            enable_prefix_caching=False,
            max_waiting=4,
            seed=7,
            num_threads=2,
        ),
        EngineArgs(model="/m", kv_cache_memory_bytes=123456789, max_waiting=0),
        EngineArgs(
            model="/m",
            speculative="ngram",
            num_speculative_tokens=3,
            prompt_lookup_min=1,
            prompt_lookup_max=5,
        ),
    ],
)
def test_flags_round_trip_with_engine_args(args: EngineArgs) -> None:
    assert cmd_engine.engine_args_from(parse(args.to_cli_args())) == args


def test_server_flags_and_defaults() -> None:
    ns = parse(["--model", "m"])
    assert (ns.host, ns.port, ns.drain_timeout, ns.log_interval) == ("127.0.0.1", 8100, 20.0, 10.0)
    ns = parse(
        ["--model", "m", "--api-key", "k", "--port", "9", "--drain-timeout", "3", "--log-interval", "1"]
    )
    assert (ns.api_key, ns.port, ns.drain_timeout, ns.log_interval) == ("k", 9, 3.0, 1.0)
    assert not ns.log_probe_requests
    assert parse(["--model", "m", "--log-probe-requests"]).log_probe_requests


def test_byte_sizes_and_exclusive_kv_flags() -> None:
    assert parse(["--model", "m", "--kv-cache-memory", "1Gi"]).kv_cache_memory_bytes == 1 << 30
    assert parse(["--model", "m", "--kv-cache-memory", "512MiB"]).kv_cache_memory_bytes == 512 << 20
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--num-kv-blocks", "4", "--kv-cache-memory", "1024"])
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--kv-cache-memory", "lots"])


def test_bad_engine_args_exit_2_before_loading_anything() -> None:
    assert cmd_engine.run(parse(["--model", "m", "--block-size", "3"])) == 2


def test_server_and_flag_parsing_do_not_import_torch() -> None:
    code = (
        "import sys, argparse; import corral_engine.server; from corral_cli import cmd_engine; "
        "p = argparse.ArgumentParser(); cmd_engine.add_arguments(p); "
        "cmd_engine.engine_args_from(p.parse_args(['--model', 'm'])); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_core_process_switch() -> None:
    """CORRAL_ENGINE_PROCESS: as set; auto puts the core in its own process on CUDA only."""
    from corral_engine.settings import EngineSettings

    def own(value: str, device: str) -> bool:
        settings = EngineSettings(engine_process=value)  # type: ignore[arg-type]
        return cmd_engine._engine_in_own_process(settings, device)

    assert own("1", "cpu") and not own("0", "cpu") and not own("auto", "cpu")
    assert EngineSettings().engine_process == "auto"
    import torch

    assert own("auto", "auto") is torch.cuda.is_available()
