"""The ``chameleon-swap`` CLI and the bandwidth measurement behind ``info``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from chameleon_swap import cli
from chameleon_swap._version import __version__
from chameleon_swap.copy import bandwidth
from chameleon_swap.copy.bandwidth import (BandwidthResult, cached_bandwidth,
                                           clear_bandwidth_cache, measure_bandwidth,
                                           pinned_memory_status)

# Small transfers keep each `info` run to milliseconds; the figure is not checked for size.
SMALL = "4MB"


def test_version_in_process(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"chameleon-swap {__version__}"


def test_version_through_python_dash_m():
    # The one test that goes through a real interpreter: proves __main__.py is wired up.
    proc = subprocess.run([sys.executable, "-m", "chameleon_swap", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"chameleon-swap {__version__}"


def test_no_command_prints_help_and_returns_2(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: chameleon-swap" in err
    assert "info" in err


def test_only_implemented_commands_are_listed(capsys):
    _, subparsers = cli.build_parser()
    assert set(subparsers) == set(cli.COMMANDS)
    assert {"demo", "bench", "info"} <= set(cli.COMMANDS)
    assert list(cli.COMMANDS)[0] == "demo"                 # the main job comes first
    for name in cli.COMMANDS:                              # each one parses its own help
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: chameleon-swap {name}")


def test_info_text(capsys):
    assert cli.main(["info", "--device", "cpu", "--bytes", SMALL]) == 0
    out = capsys.readouterr().out
    for label in ("device:", "torch:", "python:", "host -> device:", "device -> host:",
                  "pinned memory:", "host RAM:"):
        assert label in out
    assert "GB/s" in out and "cpu-memcpy" in out
    assert torch.__version__ in out


def test_info_json(capsys):
    assert cli.main(["info", "--device", "cpu", "--bytes", SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)

    assert report["version"] == __version__
    assert report["device"] == "cpu"
    assert isinstance(report["device_name"], str)
    if not torch.cuda.is_available():
        assert report["device_name"] == "cpu (no accelerator)"
    assert report["device_memory_total_bytes"] is None
    assert report["torch_version"] == torch.__version__
    assert isinstance(report["python_version"], str)

    bw = report["bandwidth"]
    for key in ("h2d_bytes_per_s", "d2h_bytes_per_s", "h2d_gb_per_s", "d2h_gb_per_s"):
        assert isinstance(bw[key], float) and bw[key] > 0, key
    assert bw["nbytes"] == 4 * 10**6
    assert bw["repeats"] >= 1
    assert bw["method"] == "cpu-memcpy"
    assert bw["pinned"] is False

    pinned = report["pinned_memory"]
    assert isinstance(pinned["available"], bool) and isinstance(pinned["reason"], str)
    assert pinned["reason"]

    for key in ("host_memory_total_bytes", "host_memory_available_bytes"):
        assert report[key] is None or (isinstance(report[key], int) and report[key] > 0)


@pytest.mark.parametrize("value", ["abc", "0", "-4MB", "12XB", ""])
def test_info_bad_bytes_exits_2(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--device", "cpu", "--bytes", value])
    assert exc.value.code == 2
    assert "--bytes" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["foo", "meta", "cuda:x", "cuda:99"])
def test_info_bad_device_exits_2(capsys, value):
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--device", value, "--bytes", SMALL])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device" in err
    # One error line after argparse's usage line, no traceback.
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_info_cuda_without_cuda_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


# ------------------------------------------------------------------------ measure_bandwidth

def test_measure_bandwidth_cpu():
    result = measure_bandwidth("cpu", nbytes=2**20, repeats=3)
    assert isinstance(result, BandwidthResult)
    assert result.device == "cpu" and result.method == "cpu-memcpy" and result.pinned is False
    assert result.nbytes == 2**20 and result.repeats == 3
    assert result.h2d_bytes_per_s > 0 and result.d2h_bytes_per_s > 0
    with pytest.raises(AttributeError):  # frozen: a cached result cannot be edited by a caller
        result.nbytes = 1  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, exc_type, name", [
    ({"nbytes": 0}, ValueError, "nbytes"),
    ({"nbytes": -1}, ValueError, "nbytes"),
    ({"nbytes": 1.5}, TypeError, "nbytes"),
    ({"nbytes": "4MB"}, TypeError, "nbytes"),
    ({"nbytes": True}, TypeError, "nbytes"),
    ({"repeats": 0}, ValueError, "repeats"),
    ({"repeats": 2.0}, TypeError, "repeats"),
    ({"repeats": True}, TypeError, "repeats"),
    ({"device": "foo"}, ValueError, "device"),
    ({"device": "meta"}, ValueError, "device"),
    ({"device": 0}, TypeError, "device"),
])
def test_measure_bandwidth_rejects_bad_arguments(kwargs, exc_type, name):
    args = {"device": "cpu", "nbytes": 1024, "repeats": 1, **kwargs}
    with pytest.raises(exc_type, match=name) as exc:
        measure_bandwidth(**args)
    # The message says what is accepted, not only what was wrong.
    assert "must be" in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA answer")
def test_pinned_memory_status_without_cuda():
    assert pinned_memory_status() == (False, "no CUDA device: pinned memory needs one")


def test_pinned_memory_status_shape():
    ok, reason = pinned_memory_status()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason


@pytest.fixture
def counting_measure(monkeypatch):
    """Replace measure_bandwidth with a cheap fake that counts calls; start with an empty cache."""
    calls = []

    def fake(device, nbytes=bandwidth.DEFAULT_NBYTES, repeats=bandwidth.DEFAULT_REPEATS):
        calls.append(str(device))
        return BandwidthResult(device=str(device), h2d_bytes_per_s=1.0, d2h_bytes_per_s=2.0,
                               pinned=False, nbytes=nbytes, repeats=repeats, method="fake")

    monkeypatch.setattr(bandwidth, "measure_bandwidth", fake)
    clear_bandwidth_cache()
    yield calls
    clear_bandwidth_cache()  # leave no fake result for other tests


def test_cached_bandwidth_measures_once_per_device(counting_measure):
    first = cached_bandwidth("cpu")
    second = cached_bandwidth(torch.device("cpu"))
    assert first is second
    assert counting_measure == ["cpu"]


def test_cached_bandwidth_clear_measures_again(counting_measure):
    cached_bandwidth("cpu")
    clear_bandwidth_cache()
    cached_bandwidth("cpu")
    assert counting_measure == ["cpu", "cpu"]


def test_cached_bandwidth_validates_before_caching(counting_measure):
    with pytest.raises(ValueError, match="device"):
        cached_bandwidth("foo")
    assert counting_measure == []


# --------------------------------------------------------------------------------- CUDA only

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_measure_bandwidth_cuda():
    result = measure_bandwidth("cuda", nbytes=4 * 2**20, repeats=3)
    assert result.device == f"cuda:{torch.cuda.current_device()}"
    assert result.method in ("cuda-events-pinned", "cuda-events-pageable")
    assert result.pinned == (result.method == "cuda-events-pinned")
    assert result.h2d_bytes_per_s > 0 and result.d2h_bytes_per_s > 0


@pytest.mark.cuda
@cuda
def test_cached_bandwidth_cuda_aliases_share_an_entry(counting_measure):
    cached_bandwidth("cuda")
    cached_bandwidth(f"cuda:{torch.cuda.current_device()}")
    assert len(counting_measure) == 1


@pytest.mark.cuda
@cuda
def test_info_json_cuda(capsys):
    assert cli.main(["info", "--device", "cuda", "--bytes", SMALL, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"].startswith("cuda:")
    assert report["device_memory_total_bytes"] > 0
    assert report["bandwidth"]["method"].startswith("cuda-events")
    assert report["bandwidth"]["h2d_bytes_per_s"] > 0
    assert isinstance(report["pinned_memory"]["available"], bool)
