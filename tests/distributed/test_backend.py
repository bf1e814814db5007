"""The process group serves the devices our collectives use (no torchrun needed).

On a GPU, rlhflab's collectives carry both GPU tensors (gradients, FSDP2 shards) and small CPU
tensors (token denominators, metric sums, stop flags). A process group created with NCCL alone
refuses the CPU ones ("No backend type associated with device type cpu"): every launched run
on a GPU died at its first step that way. These tests pin the backend that `setup` asks for on a
CUDA machine (simulated here: nothing runs on a GPU) and on CPU.
"""

from __future__ import annotations

import pytest
import torch

from rlhflab import distributed
from rlhflab.distributed import group
from rlhflab.errors import ConfigError


def _served(backend: str) -> set[str]:
    """Device types a torch.distributed backend string serves: "gloo" serves CPU tensors only
    (gloo's CUDA support is not what we rely on), "nccl" CUDA only, "cpu:gloo,cuda:nccl" both."""
    if ":" not in backend:
        return {"gloo": {"cpu"}, "nccl": {"cuda"}}[backend]
    return {part.split(":")[0] for part in backend.split(",")}


def test_backend_serves_cpu_and_cuda_tensors_on_cuda():
    assert _served(distributed.backend_for(torch.device("cuda", 0))) == {"cpu", "cuda"}
    assert distributed.backend_for(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"


def test_backend_on_cpu_is_gloo():
    assert distributed.backend_for(torch.device("cpu")) == "gloo"


@pytest.fixture
def fresh_state(monkeypatch):
    saved = dict(group._STATE)
    # no parent-death signal or watchdog thread for the test process itself
    monkeypatch.setattr(group, "exit_with_parent", lambda *a, **k: False)
    yield
    group._STATE.clear()
    group._STATE.update(saved)


def _fake_launch(monkeypatch, *, cuda: bool) -> dict:
    """A 2-process launch on a machine with or without CUDA, where torch.distributed only records
    what `setup()` asks of it: returns the dict it writes ("backend", "device")."""
    calls: dict = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("device", i))
    monkeypatch.setattr(group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        group.dist,
        "init_process_group",
        lambda backend, **kw: calls.setdefault("backend", backend),
    )
    return calls


def test_setup_on_a_cuda_machine_asks_for_a_group_that_serves_cpu_tensors(monkeypatch, fresh_state):
    """What setup() asks torch.distributed for under torchrun on a (simulated) GPU machine."""
    calls = _fake_launch(monkeypatch, cuda=True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.setup("ddp", timeout_s=5)
    assert calls["device"] == 1
    assert distributed.device() == torch.device("cuda", 1)
    # Host-side counters (all_reduce_sum of a CPU float64, any_rank, sum_dict, micro_batches)
    # and GPU tensors (sync_grads, FSDP2) must both have a backend.
    assert {"cpu", "cuda"} <= _served(calls["backend"])
    group._STATE["owned"] = False  # nothing was really started


def test_setup_on_cpu_asks_for_gloo(monkeypatch, fresh_state):
    calls = _fake_launch(monkeypatch, cuda=False)
    distributed.setup("fsdp2", timeout_s=5)
    assert calls["backend"] == "gloo"
    group._STATE["owned"] = False


def test_more_ranks_than_gpus_is_a_one_line_config_error(monkeypatch, fresh_state):
    """`--nproc 2` on a one-GPU node: rank 1 has no GPU. It must say so in one line (on an H200
    it died in `torch.cuda.set_device(1)` with a CUDA traceback) and never join the group."""
    calls = _fake_launch(monkeypatch, cuda=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ConfigError) as e:
        distributed.setup("fsdp2", timeout_s=5)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 1: LOCAL_RANK 1 but this node shows 1 CUDA")
    assert calls == {}  # neither set_device nor init_process_group was reached
