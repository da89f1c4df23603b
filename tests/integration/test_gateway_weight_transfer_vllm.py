"""vLLM's weight-update endpoints on the gateway, with REAL vLLM CPU workers (two, the tiny model).

A trainer pushes weights only through HTTP and the gloo group those endpoints set up
(``WeightTransferClient``: TRL's weight methods over gloo); the proof is the gateway's own
completions: afterwards their greedy tokens are the trainer model's, and they carry the new
weight version; before, neither holds. The packed layout the gateway plans with is checked
against vLLM's own packer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from helpers import local_cluster, running_gateway
from model_helpers import SYNC_PROMPTS, hf_greedy, trained_model

from zmq_rollout import RolloutClient
from zmq_rollout.errors import InvalidRequestError
from zmq_rollout.gateway.weight_bodies import InitInfo, UpdateInfo, chunks
from zmq_rollout.integrations.vllm_weights import WeightTransferClient
from zmq_rollout.local import LocalCluster
from zmq_rollout.weight_sync.buckets import dtype_name, named_tensors

PROMPTS = SYNC_PROMPTS
STEPS = 12


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("gateway-weights-logs")
    with local_cluster(tiny_model, logs, 2, heartbeat_interval_s=0.5, worker_liveness=10) as c:
        yield c


@pytest.fixture(scope="module")
def gateway(cluster: LocalCluster) -> Iterator[str]:
    gloo = {"weight_transfer_backend": "gloo", "weight_transfer_timeout_s": 120}
    with running_gateway(cluster.address, timeout_s=300, **gloo) as url:
        yield url


@pytest.fixture(scope="module")
def trainer(gateway: str) -> Iterator[WeightTransferClient]:
    client = WeightTransferClient(gateway, packed_buffer_size_bytes=200_000, timeout_s=120, check_names=True)
    try:
        client.init_communicator()
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def broker(cluster: LocalCluster) -> Iterator[RolloutClient]:
    with RolloutClient(cluster.address, timeout_s=300) as c:
        yield c


def completions(gateway: str) -> list[dict[str, Any]]:
    """Greedy completions of every prompt, through the gateway."""
    body = {"prompt": PROMPTS, "max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(f"{gateway}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    choices: list[dict[str, Any]] = answer.json()["choices"]
    assert [c["index"] for c in choices] == list(range(len(PROMPTS)))
    return choices


def agreement(choices: list[dict[str, Any]], model: torch.nn.Module) -> int:
    """Prompts whose greedy tokens are the trainer model's; one that parts where the trainer's
    top two logits are within 0.1 (a bf16 near tie) counts as equal."""
    equal = 0
    for prompt, choice in zip(PROMPTS, choices, strict=True):
        got, want = choice["token_ids"], hf_greedy(model, prompt, STEPS)
        if got == want:
            equal += 1
            continue
        k = next(k for k, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:k]])).logits[0, -1].float()
        equal += float(logits[want[k]] - logits[got[k]]) < 0.1
    return equal


def test_the_endpoints_describe_the_fleet(gateway: str, cluster: LocalCluster) -> None:
    assert httpx.get(f"{gateway}/get_world_size").json() == {"world_size": 2}
    config = httpx.get(f"{gateway}/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert config["weight_transfer_config"] == {"backend": "gloo"}
    assert config["model_config"]["model"] == cluster.model


def test_weights_pushed_through_the_endpoints_are_what_completions_come_from(
    gateway: str, trainer: WeightTransferClient, broker: RolloutClient, tiny_model: str
) -> None:
    model = trained_model(tiny_model, 21)
    before = completions(gateway)
    version = broker.status().fleet_version
    assert {c["weight_version"] for c in before} == {version}
    assert agreement(before, model) <= len(PROMPTS) // 2
    trainer.update_model_params(model)  # start, join, one broadcast per chunk, finish
    assert trainer.weight_version == version + 1
    after = completions(gateway)
    assert agreement(after, model) >= len(PROMPTS) - 1  # a bf16 near tie may split one prompt
    assert {c["weight_version"] for c in after} == {version + 1}
    status = broker.status()
    assert status.fleet_version == version + 1
    assert {(w.weight_version, w.state) for w in status.workers} == {(version + 1, "ready")}
    assert trainer.reset_prefix_cache() is True


def test_a_weight_update_block_of_single_tensors_unpacked(
    gateway: str, trainer: WeightTransferClient, broker: RolloutClient, tiny_model: str
) -> None:
    """TRL's other way: ``update_named_param`` per tensor inside ``weight_update()``, each one
    ``/update_weights`` of one broadcast, in one round (one version); vLLM's unpacked layout."""
    model = trained_model(tiny_model, 22)
    unpacked = WeightTransferClient(gateway, packed=False, timeout_s=120)
    try:
        unpacked.init_communicator()
        version = broker.status().fleet_version
        with unpacked.weight_update():
            for name, tensor in named_tensors(model):
                unpacked.update_named_param(name, tensor)
        assert unpacked.weight_version == version + 1
        after = completions(gateway)
        assert agreement(after, model) >= len(PROMPTS) - 1
        assert {c["weight_version"] for c in after} == {version + 1}
    finally:
        unpacked.close()
    # the module's trainer tells the gateway its group's address again at its next start_weight_update


def test_a_refused_update_leaves_the_fleet_serving_its_weights(
    gateway: str, trainer: WeightTransferClient, broker: RolloutClient, tiny_model: str
) -> None:
    version = broker.status().fleet_version
    served = completions(gateway)
    bad = [("model.embed_tokens.weight", trained_model(tiny_model, 23).model.embed_tokens.weight.data),
           ("not.a.weight", torch.zeros(4, dtype=torch.bfloat16))]  # fmt: skip
    with pytest.raises(InvalidRequestError, match=r"not\.a\.weight"):
        trainer.update_named_params(None, bad)
    status = broker.status()  # checked before anything loaded: no worker restarted, nobody paused
    assert status.fleet_version == version and {w.state for w in status.workers} == {"ready"}
    again = completions(gateway)
    assert [c["token_ids"] for c in again] == [c["token_ids"] for c in served]
    assert {c["weight_version"] for c in again} == {version}


def test_the_layout_is_vllms_packed_broadcast(tiny_model: str) -> None:
    """``chunks`` cuts where vLLM's own packer (``pack_tensors``, what TRL's trainer calls) cuts."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    pairs = named_tensors(trained_model(tiny_model, 24))
    limit = 150_000
    ours = chunks(
        UpdateInfo([n for n, _ in pairs], [dtype_name(t.dtype) for _, t in pairs], [list(t.shape) for _, t in pairs]),
        InitInfo("127.0.0.1", 1, 2, packed=True, packed_buffer_size_bytes=limit),
    )
    it = iter(pairs)
    theirs = []
    while (chunk := pack_tensors(it, lambda item: item[1], limit)) is not None:
        theirs.append((chunk.names, chunk.packed_tensor.numel()))
    assert [([m.name for m in b.tensors], b.nbytes) for b in ours] == theirs
    assert len(ours) > 1
