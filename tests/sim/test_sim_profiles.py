"""Profile files for `--simulate FILE`: a fitted profile round-trips, and a broken one is refused
with a ValueError that names the file and the field (a one-line error from `corral engine`),
never a traceback or a replica that starts and then never serves."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
from corral_engine.sim.perf_model import Fitted, Profile, load_profile

GOOD = {
    "name": "cpu-tiny",
    "kind": "fitted",
    "coefficients": [1e-3, 1e-5, 2e-5, 0.0, 0.0],
    "num_kv_blocks": 64,
}


def _write(tmp_path: pathlib.Path, data: object) -> str:
    path = tmp_path / "profile.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_a_fitted_profile_round_trips(tmp_path: pathlib.Path) -> None:
    profile = Profile("cpu-tiny", Fitted((1e-3, 1e-5, 2e-5, 0.0, 0.0)), 64, max_num_seqs=8, block_size=32)
    assert load_profile(_write(tmp_path, profile.to_json() | {"median_fit_error": 0.1})) == profile
    recorded = dataclasses.replace(profile, kv_bytes_per_token=256)  # as calibrate writes it now
    assert load_profile(_write(tmp_path, recorded.to_json())) == recorded


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ("not json", "not a JSON profile"),
        ([1, 2], "not a fitted profile"),
        ({**GOOD, "coefficients": ["a", 0, 0, 0, 0]}, "coefficients must be 5 numbers >= 0"),
        ({**GOOD, "coefficients": [-1, 0, 0, 0, 0]}, "coefficients must be 5 numbers >= 0"),
        ({k: v for k, v in GOOD.items() if k != "name"}, "needs a name"),
        ({k: v for k, v in GOOD.items() if k != "num_kv_blocks"}, "num_kv_blocks"),
        ({**GOOD, "num_kv_blocks": "100"}, "num_kv_blocks must be an integer"),
        ({**GOOD, "num_kv_blocks": 0}, "num_kv_blocks must be >= 1"),
        ({**GOOD, "max_num_seqs": 0}, "max_num_seqs must be in [1, 4096]"),
        ({**GOOD, "max_model_len": 1.5}, "max_model_len must be an integer"),
        ({**GOOD, "block_size": -4}, "block_size must be a power of two"),
        ({**GOOD, "block_size": True}, "block_size must be an integer"),
        ({**GOOD, "kv_bytes_per_token": "256"}, "kv_bytes_per_token must be an integer >= 1"),
        ({**GOOD, "kv_bytes_per_token": 0}, "kv_bytes_per_token must be an integer >= 1"),
    ],
)
def test_a_broken_profile_is_refused_naming_the_file_and_field(
    tmp_path: pathlib.Path, data: object, said: str
) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=r"profile\.json") as raised:
        load_profile(path)
    assert said in str(raised.value)
