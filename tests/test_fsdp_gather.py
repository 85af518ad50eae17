"""The bucketed gather of a merged weight sync under FSDP2 (harness/weight_sync/gather.py), on CPU.

The pure parts (which rows each process holds, how items fall into buckets) with literal numbers; then two
gloo processes, each running this file (`python tests/test_fsdp_gather.py RANK WORLD PORT DIR`) as
tests/test_fsdp.py does: every rank builds the same tiny Qwen3s, reads the one-process merged weights,
shards the model with the trainer's `shard_model`, and gathers the weights one parameter at a time
(`bucket_size_bytes=None`, `DTensor.full_tensor()`) and in buckets of several sizes, counting the collectives
each way issues (`harness.testing.collectives.CollectiveCounter`). The models: untied and tied embeddings, a
vocabulary of 1001 rows (uneven shards), LoRA of rank 3 (factors of 3 rows: uneven) with rank 1 on
down_proj (one process holds no row of its lora_A), in float32 and with a bf16 base under bf16 mixed
precision (float32 factors beside bf16 weights in one bucket).
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.weight_sync.gather import GatherItem, ShardLayoutError, plan_gather_buckets, shard_rows

VOCAB_SIZE = 1001  # odd: the embedding and lm_head rows split 501/500
MODELS = ("full", "tied", "lora", "lora-bf16")
BUCKETS = ("one byte", "several", "all")


# --- the pure parts ---------------------------------------------------------------------------------------


def test_shard_rows_are_torch_chunks_padded_with_empty_ranges():
    assert shard_rows(4, 2) == [range(0, 2), range(2, 4)]
    assert shard_rows(5, 2) == [range(0, 3), range(3, 5)]
    assert shard_rows(1, 2) == [range(0, 1), range(1, 1)]
    assert shard_rows(5, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 5)]
    for rows, world in [(1001, 2), (7, 3), (3, 8)]:
        chunks = torch.arange(rows).chunk(world)
        got = shard_rows(rows, world)
        assert [list(r) for r in got[: len(chunks)]] == [c.tolist() for c in chunks]
        assert all(len(r) == 0 for r in got[len(chunks) :])


def test_buckets_take_items_while_they_fit_and_a_larger_item_goes_alone():
    assert plan_gather_buckets([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert plan_gather_buckets([4, 4, 4], 12) == [range(0, 3)]
    assert plan_gather_buckets([4, 4, 4], 1) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_gather_buckets([3, 10, 3], 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_gather_buckets([0, 0, 5, 0], 4) == [range(0, 2), range(2, 3), range(3, 4)]
    assert plan_gather_buckets([], 8) == []
    with pytest.raises(ValueError, match="bucket_size_bytes must be positive"):
        plan_gather_buckets([1], 0)


def test_gathering_nothing_sharded_is_refused_with_the_fix():
    from harness.weight_sync.gather import gather_in_buckets

    with pytest.raises(ShardLayoutError, match="read them as they are"):
        list(gather_in_buckets([GatherItem("w", (torch.zeros(2),))]))


# --- one rank ---------------------------------------------------------------------------------------------


def build(kind: str) -> tuple[Any, Any]:
    """The model of `kind` (the same on every rank) and its FSDP2 mixed-precision policy."""
    from harness.testing import build_tiny_qwen3
    from harness.training.fsdp import mixed_precision_policy

    bf16 = kind.endswith("bf16")
    model = build_tiny_qwen3(
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=kind != "full",
        dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    if kind.startswith("lora"):
        import peft

        config = peft.LoraConfig(
            r=3, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 1}
        )
        torch.manual_seed(0)
        model = peft.get_peft_model(model, config)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: random, so the merge changes the weights
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model, mixed_precision_policy(bf16=bf16, fp16=False)


def gathered(model: Any, **kwargs: Any) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(name -> tensor this rank got, the names in order, the collectives issued)."""
    from harness.testing.collectives import CollectiveCounter
    from harness.weight_sync.peft import merged_named_parameters

    with CollectiveCounter() as counter:
        pairs = [(name, tensor.clone()) for name, tensor in merged_named_parameters(model, **kwargs)]
    return dict(pairs), [name for name, _ in pairs], counter.names


def rank_results(kind: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from harness.training.fsdp import shard_model, use_float32_master_weights
    from harness.weight_sync.peft import merged_named_parameters, served_parameters

    model, policy = build(kind)
    use_float32_master_weights(model, policy)  # the dtypes the sharded model will have
    one_process = {name: tensor.clone() for name, tensor in merged_named_parameters(model)}
    bf16 = torch.bfloat16
    one_process_bf16 = {name: t.clone() for name, t in merged_named_parameters(model, dtype=bf16)}
    shard_model(model, mp_policy=policy, mesh=init_device_mesh("cpu", (2,)))
    served = list(served_parameters(model))
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
    uneven = [name for name, p in model.named_parameters() if p.shape[0] % 2]
    sizes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    total, largest = sum(sizes.values()), max(sizes.values())
    # several: a third of the weights, or a little more than the largest weight when that is larger
    bucket_sizes = {"one byte": 1, "several": max(-(-total // 3), largest + 1024), "all": 1 << 30}
    results: dict[str, Any] = {
        "one_process": one_process,
        "order": [name for name, _ in served],
        "uneven": uneven,
        "bytes": total,
        "largest": largest,
        "bucket_sizes": bucket_sizes,
        "one_at_a_time": gathered(model, bucket_size_bytes=None),
        "all_ranks": gathered(model, bucket_size_bytes=bucket_sizes["several"], all_ranks=True),
        "one_process_bf16": one_process_bf16,
        "bf16": gathered(model, bucket_size_bytes=bucket_sizes["several"], dtype=bf16),
    }
    for label, size in bucket_sizes.items():
        results[label] = gathered(model, bucket_size_bytes=size)
    return results


def odd_tensors() -> list[torch.Tensor]:
    """Tensors whose shards are odd numbers of bytes, of three dtypes: in one bucket, each slot must start
    where its dtype can be read."""
    return [
        torch.arange(5, dtype=torch.bfloat16),
        torch.arange(6, dtype=torch.float32).view(3, 2),
        torch.arange(7, dtype=torch.uint8),
        torch.arange(9, dtype=torch.float64).view(3, 3),
    ]


def gathered_odd_tensors() -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from harness.weight_sync.gather import gather_in_buckets

    mesh = init_device_mesh("cpu", (2,))
    items = [
        GatherItem(f"t{index}", (distribute_tensor(tensor, mesh, [Shard(0)]),))
        for index, tensor in enumerate(odd_tensors())
    ]
    return list(gather_in_buckets(items, 1 << 30))


def refusal() -> str | None:
    """The error for a tensor sharded on dim 1 (not FSDP2's layout), raised on every rank before gathering."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from harness.weight_sync.gather import gather_in_buckets

    by_column = distribute_tensor(torch.zeros(4, 6), init_device_mesh("cpu", (2,)), [Shard(1)])
    try:
        list(gather_in_buckets([GatherItem("w", (by_column,))]))
    except ShardLayoutError as exc:
        return str(exc)
    return None


def rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from harness.training.processes import end_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {kind: rank_results(kind) for kind in MODELS}
        results["refused"] = refusal()
        results["odd"] = gathered_odd_tensors()
    finally:
        end_process_group()  # and gloo's workers idle before the interpreter exits
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as handle:
        pickle.dump(results, handle)


# --- the two-process tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, Any]]:
    """Both ranks' results (one launch for every test below)."""
    from harness.testing.ranks import run_ranks

    out_dir = tmp_path_factory.mktemp("gather")
    run_ranks([sys.executable, __file__], out_dir, world_size=2, extra_args=[str(out_dir)])
    results = []
    for rank in range(2):
        with open(out_dir / f"rank{rank}.pkl", "rb") as handle:
            results.append(pickle.load(handle))
    return results


def assert_bit_identical(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("bucket", BUCKETS)
def test_buckets_deliver_what_one_parameter_at_a_time_delivers(ranks, kind, bucket):
    """Rank 0 gets every served tensor, in the served order, bit-identical to the one-at-a-time gather and to
    one process's; rank 1 gets nothing (only rank 0 sends)."""
    rank0, rank1 = ranks[0][kind], ranks[1][kind]
    tensors, order, _ = rank0[bucket]
    assert order == rank0["order"]
    assert_bit_identical(tensors, rank0["one_at_a_time"][0])
    assert_bit_identical(tensors, rank0["one_process"])
    assert rank1[bucket][0] == {}


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_the_models_have_uneven_and_empty_shards(ranks, kind):
    uneven = ranks[0][kind]["uneven"]
    assert any("embed_tokens" in name for name in uneven)
    if kind.startswith("lora"):
        assert any("lora_A" in name for name in uneven)
    if kind == "full":
        assert any("lm_head" in name for name in uneven)
    if kind.startswith("lora"):
        assert "lm_head.weight" not in ranks[0][kind]["order"]  # tied: the server ties it


@pytest.mark.slow
def test_odd_sizes_and_mixed_dtypes_share_a_bucket(ranks):
    assert [name for name, _ in ranks[0]["odd"]] == ["t0", "t1", "t2", "t3"]
    for (_, got), expected in zip(ranks[0]["odd"], odd_tensors(), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert ranks[1]["odd"] == []


@pytest.mark.slow
def test_another_layout_is_refused_on_every_rank_with_the_fix(ranks):
    for rank in ranks:
        assert "w is placed (Shard(dim=1),)" in rank["refused"]
        assert "pass bucket_size_bytes=None" in rank["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_all_ranks_gives_every_process_the_same_tensors(ranks, kind):
    for rank in ranks:
        assert_bit_identical(rank[kind]["all_ranks"][0], rank[kind]["one_process"])
    assert all(name == "c10d._allgather_base_.default" for name in ranks[1][kind]["all_ranks"][2])


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_weights_cast_to_the_servers_dtype_before_the_gather_arrive_as_one_process_casts_them(ranks, kind):
    """A bf16 server: each float32 shard is cast before it is packed (LoRA layers merged in float32 first,
    then cast), so rank 0 gets exactly what one process casts, in about half the bytes (fewer buckets)."""
    rank0, rank1 = ranks[0][kind], ranks[1][kind]
    tensors, order, collectives = rank0["bf16"]
    assert order == rank0["order"]
    assert all(tensor.dtype == torch.bfloat16 for tensor in tensors.values())
    assert_bit_identical(tensors, rank0["one_process_bf16"])
    assert_bit_identical(tensors, {name: t.to(torch.bfloat16) for name, t in rank0["one_process"].items()})
    assert rank1["bf16"][0] == {}
    if not kind.startswith("lora"):  # LoRA layers travel in float32 to be merged, the rest halves
        assert len(collectives) < len(rank0["several"][2])


@pytest.mark.slow
@pytest.mark.parametrize("kind", MODELS)
def test_one_collective_per_bucket_instead_of_one_per_parameter(ranks, kind):
    """One gather per bucket, on every rank: one for all the weights in a bucket larger than all; about
    ceil(bytes / bucket) for several; with buckets smaller than any parameter, one per served weight (a LoRA
    layer's factors travel with its base weight), where gathering one at a time costs one per parameter and
    more for each LoRA layer's delta."""
    for rank, all_results in enumerate(ranks):
        results = all_results[kind]
        served = len(results["order"])
        counts = {label: len(results[label][2]) for label in BUCKETS}
        for label in BUCKETS:
            assert set(results[label][2]) == {"c10d.gather_.default"}, (label, results[label][2])
        one_at_a_time = len(results["one_at_a_time"][2])
        assert counts["all"] == 1
        assert counts["one byte"] == served
        # every weight fits a bucket: at least ceil(bytes / bucket), and at most twice that (a bucket closes
        # when the next weight does not fit, so two buckets in a row hold more than one bucket's size)
        several = results["bucket_sizes"]["several"]
        assert results["largest"] < several
        assert 2 <= math.ceil(results["bytes"] / several) <= counts["several"]
        assert counts["several"] <= 2 * math.ceil(results["bytes"] / several)
        assert one_at_a_time >= served > counts["several"]
        if kind.startswith("lora"):
            assert one_at_a_time > served  # the deltas' own collectives
        print(f"\n{kind} (rank {rank}): {one_at_a_time} collectives one at a time, {counts}")


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
