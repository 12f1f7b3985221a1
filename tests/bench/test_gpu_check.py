"""`bench --gpu-check`: the first command on a machine with a GPU; without one, a one-line refusal."""

import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without CUDA")
def test_gpu_check_without_a_gpu_says_what_to_run_instead():
    done = subprocess.run([sys.executable, "-m", "dflash_agent", "bench", "--gpu-check"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --gpu-check needs a CUDA GPU and this machine has none; without one, "
        "`dflash-agent bench --kernels` checks the kernels' compile budgets"]


def test_gpu_check_takes_no_other_benchmark():
    done = subprocess.run([sys.executable, "-m", "dflash_agent", "bench", "--gpu-check", "--spec"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--gpu-check takes only --out" in done.stderr


def test_gpu_tests_name_every_kernel_test_that_runs_on_cuda():
    """Each listed file exists, and every kernel test module that takes the `kernels` fixture (run on CUDA when
    there is a GPU) is listed."""
    from pathlib import Path

    from dflash_agent.bench.gpu_check import GPU_TESTS

    repo = Path(__file__).resolve().parents[2]
    assert all((repo / t).exists() for t in GPU_TESTS)
    on_cuda = {f"tests/kernels/{p.name}" for p in (repo / "tests/kernels").glob("test_*.py")
               if "(kernels" in p.read_text()}
    assert on_cuda and on_cuda <= set(GPU_TESTS)


def test_each_step_is_written_as_it_ends(tmp_path, monkeypatch):
    """A check stopped at a time limit (the lent GPU machine's) keeps the steps it finished in its JSON."""
    import json

    from dflash_agent.bench import gpu_check, synthetic

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a test GPU")
    monkeypatch.setattr(gpu_check, "_gpu_tests",
                        lambda repo, log_path: gpu_check.Step("GPU tests", True, 1.0, "12 passed"))
    first = synthetic.QUANTS[0]

    def bench(quant):
        if quant != first:
            raise TimeoutError("stopped")
        return gpu_check.Step(f"synthetic {quant}", False, 2.0, "4 streams: 3.1x one")

    monkeypatch.setattr(gpu_check, "_synthetic", bench)
    out = tmp_path / "gpu-check.json"
    with pytest.raises(TimeoutError):
        gpu_check.run_gpu_check(out)
    written = json.loads(out.read_text())
    assert written["device"] == "a test GPU"
    # the first quantization's benchmark leads, then the tests; the second benchmark stopped the check
    assert [(s["name"], s["ok"], s["detail"]) for s in written["steps"]] == [
        (f"synthetic {first}", False, "4 streams: 3.1x one"), ("GPU tests", True, "12 passed")]
