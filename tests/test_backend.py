"""Backend and device selection: the CUDA decisions, checked on CPU with the CUDA facts given."""

import pytest
import torch

from shardcheck.errors import BadInput
from shardcheck.backend import choose_backend, process_group_backend, rank_device
from shardcheck.harness.controller.worlds.joined import launched_by_torchrun


@pytest.mark.parametrize("cuda,gpus,nproc,want", [
    (False, 0, 4, "gloo"),   # no CUDA: gloo on CPU
    (True, 1, 4, "gloo"),    # one GPU cannot hold a 4-rank NCCL world
    (True, 1, 1, "nccl"),    # ... but a world of one rank runs the CUDA path
    (True, 8, 4, "nccl"),    # a GPU per rank
])
def test_auto_takes_nccl_only_with_a_gpu_per_rank(cuda, gpus, nproc, want):
    backend, why = choose_backend("auto", nproc, cuda_available=cuda, device_count=gpus)
    assert backend == want and why


def test_nccl_asked_for_without_enough_gpus_is_one_line():
    with pytest.raises(BadInput, match="needs CUDA"):
        choose_backend("nccl", 1, cuda_available=False, device_count=0)
    with pytest.raises(BadInput, match="one GPU per rank: 4 ranks, 1 GPU"):
        choose_backend("nccl", 4, cuda_available=True, device_count=1)
    with pytest.raises(BadInput, match="unknown backend 'mpi'"):
        choose_backend("mpi", 1, cuda_available=False, device_count=0)
    assert choose_backend("gloo", 4, cuda_available=True, device_count=8)[0] == "gloo"


def test_gloo_cuda_shares_the_gpus_with_gloo_collectives():
    """A CP world on one GPU (code whose CP needs CUDA tensors): every rank on a GPU, gloo's
    collectives; it needs CUDA, and says so in one line where there is none."""
    backend, why = choose_backend("gloo-cuda", 4, cuda_available=True, device_count=1)
    assert backend == "gloo-cuda" and "4 rank(s) sharing 1 GPU(s)" in why
    assert process_group_backend(backend) == "gloo" and process_group_backend("nccl") == "nccl"
    with pytest.raises(BadInput, match="gloo-cuda needs CUDA"):
        choose_backend("gloo-cuda", 2, cuda_available=False, device_count=0)


def test_gloo_ranks_compute_on_the_cpu():
    assert rank_device("gloo", 3) == torch.device("cpu")


def test_this_machine_without_cuda_picks_gloo():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    assert choose_backend("auto", 4)[0] == "gloo"


def test_torchrun_is_recognised_by_its_environment():
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert launched_by_torchrun(env)
    assert not launched_by_torchrun({k: v for k, v in env.items() if k != "MASTER_PORT"})
