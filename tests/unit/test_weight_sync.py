"""Weight sync building blocks: full tensors (FSDP2, LoRA merge, tied), buckets, checksums, the protocol."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from rlite.engines.base import EngineError
from rlite.plugins.fsdp2.weights import iter_full_tensors
from rlite.sync.buckets import (
    ALIGNMENT,
    bucket_checksum,
    iter_buckets,
    pack_bucket,
    plan_bucket,
    unpack_bucket,
)
from rlite.sync.transport import SharedBucketReceiver, SharedBucketSender

torch.set_num_threads(1)


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.fp32", torch.randn(3, 5, generator=g)),
        ("b.bf16", torch.randn(7, generator=g).to(torch.bfloat16)),  # 14 bytes: next offset needs padding
        ("c.fp16", torch.randn(2, 3, generator=g).half()),
        ("d.int64", torch.arange(5)),
        ("e.bool", torch.tensor([True, False, True])),
        ("f.scalar", torch.tensor(3.5)),
        ("g.empty", torch.zeros(0, 4)),
        ("h.transposed", torch.randn(4, 6, generator=g).T),  # not contiguous
    ]


def tiny_qwen2(tie: bool = False, seed: int = 0):
    from rlite.testing import tiny_qwen2 as build

    return build(96, tie=tie, seed=seed)


# -- buckets --------------------------------------------------------------------------------------


def test_pack_unpack_round_trip_is_bitwise_and_aligned():
    tensors = mixed_tensors()
    buffer, metas = pack_bucket(tensors)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert buffer.numel() % ALIGNMENT == 0
    for meta in metas:
        assert meta.offset % ALIGNMENT == 0
    for (name, original), (got_name, view), meta in zip(tensors, unpack_bucket(buffer, metas), metas):
        assert got_name == name == meta.name
        assert view.dtype == original.dtype and view.shape == original.shape
        assert torch.equal(
            view.reshape(-1).view(torch.uint8), original.contiguous().reshape(-1).view(torch.uint8)
        )
        if view.numel():  # a view into the buffer, not a copy
            assert view.data_ptr() == buffer.data_ptr() + meta.offset
    # offsets never overlap
    ends = [(m.offset, m.offset + m.nbytes) for m in metas]
    assert all(e0[1] <= e1[0] for e0, e1 in zip(ends, ends[1:]))


def test_pack_into_existing_buffer_rewrites_views():
    tensors = mixed_tensors()
    buffer, metas = pack_bucket(tensors)
    views = unpack_bucket(buffer, metas)
    new = [(n, t + 1 if t.dtype != torch.bool else ~t) for n, t in tensors]
    pack_bucket(new, out=buffer)
    for (_, view), (_, t) in zip(views, new):
        assert torch.equal(view, t)
    with pytest.raises(ValueError):
        pack_bucket(tensors, out=torch.zeros(8, dtype=torch.uint8))


def test_iter_buckets_respects_the_size_and_keeps_order():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 100, 40, 300, 5, 5, 60])]
    limit = 512  # bytes
    buckets = list(iter_buckets(iter(tensors), limit))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for bucket in buckets:
        size = plan_bucket(bucket)[1]
        assert size <= limit or len(bucket) == 1  # only an oversized tensor exceeds it, alone
    assert any(len(b) == 1 and b[0][0] == "t3" for b in buckets)  # 1200 bytes > 512


def test_checksum_is_a_wrapping_int64_sum_and_sees_one_flipped_bit():
    g = torch.Generator().manual_seed(1)
    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    expected = int(buffer.numpy().view(np.uint64).sum(dtype=np.uint64))
    assert bucket_checksum(buffer) == expected
    flipped = buffer.clone()
    flipped[1234] ^= 0x10
    assert bucket_checksum(flipped) != bucket_checksum(buffer)
    with pytest.raises(ValueError):
        bucket_checksum(buffer[:7])


def test_checksum_on_several_threads_equals_one_thread_and_restores_the_setting():
    # words near 2**63 make the partial sums overflow: the wrapping sum must not depend on the split
    g = torch.Generator().manual_seed(2)
    words = torch.randint(2**62, 2**63 - 1, (1 << 16,), dtype=torch.int64, generator=g)
    buffer = words.view(torch.uint8)
    expected = int(words.numpy().view(np.uint64).sum(dtype=np.uint64))
    before = torch.get_num_threads()
    assert bucket_checksum(buffer, threads=1) == expected
    assert bucket_checksum(buffer, threads=2) == expected
    assert bucket_checksum(buffer, threads=4) == expected
    assert torch.get_num_threads() == before


# -- full tensors ---------------------------------------------------------------------------------


def test_plain_model_streams_its_state_dict_and_tied_lm_head_once():
    for tie in (False, True):
        model = tiny_qwen2(tie=tie)
        got = dict(iter_full_tensors(model, lora_merge=False))
        expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        assert list(got) == [k for k in expected if k in got] and set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert ("lm_head.weight" in got) is (not tie)


def test_dtype_cast():
    model = tiny_qwen2()
    got = dict(iter_full_tensors(model, lora_merge=False, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))


def test_fsdp2_dtensors_are_gathered_to_full_hf_tensors(world_of_one):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    reference = tiny_qwen2(seed=3)
    model = tiny_qwen2(seed=3)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model.model.embed_tokens.weight, DTensor)
    got = list(iter_full_tensors(model, lora_merge=False))
    assert [n for n, _ in got] == [n for n, _ in reference.named_parameters()]
    for (name, tensor), (_, ref) in zip(got, reference.named_parameters()):
        assert not isinstance(tensor, DTensor), name
        assert torch.equal(tensor, ref), name


def _lora_model(seed: int = 0, dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model

    base = tiny_qwen2(seed=seed).to(dtype)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # B is zero at init; make the adapter do something
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _merged_reference(model) -> dict[str, torch.Tensor]:
    import copy

    return copy.deepcopy(model).merge_and_unload().state_dict()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_merge_is_bitwise_equal_to_merge_and_unload(dtype):
    model = _lora_model(dtype=dtype)  # bf16 base: peft keeps the adapters in fp32
    expected = _merged_reference(model)
    got = dict(iter_full_tensors(model, lora_merge=True))
    assert set(got) == set(expected)
    assert not any("lora_" in k or "base_layer" in k or k.startswith("base_model") for k in got)
    for name in expected:
        assert got[name].dtype == expected[name].dtype == dtype, name
        assert torch.equal(got[name], expected[name]), name
    # the merged weights differ from the base weights where LoRA applies
    assert not torch.equal(
        got["model.layers.0.self_attn.q_proj.weight"],
        model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
    )
    # unmerged: the raw peft names stream unchanged
    raw = dict(iter_full_tensors(model, lora_merge=False))
    assert set(raw) == {n for n, _ in model.named_parameters()}


def test_lora_merge_under_fsdp2_matches_merge_and_unload(world_of_one):
    from torch.distributed.fsdp import fully_shard

    model = _lora_model(seed=5)
    expected = _merged_reference(model)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    got = dict(iter_full_tensors(model, lora_merge=True))
    assert set(got) == set(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


# -- the protocol, in one process -----------------------------------------------------------------


class LazyChannel:
    """The receiver runs only when the sender waits for an answer, as late as a real one may."""

    def __init__(self, receiver: SharedBucketReceiver) -> None:
        self.receiver = receiver
        self.inbox: collections.deque = collections.deque()
        self.outbox: collections.deque = collections.deque()
        self.loaded: dict[str, torch.Tensor] = {}
        self.sent: list[tuple] = []
        self.errors: dict[int, str] = {}

    def send(self, message):
        self.sent.append(message)
        self.inbox.append(message)

    def recv(self, timeout_s):
        while not self.outbox:
            self.outbox.extend(self._answer(self.inbox.popleft()))
        return self.outbox.popleft()

    def _answer(self, message):
        op, *args = message
        if op == "begin_sync":
            self.receiver.begin(args[0])
            return [("ack", "begin_sync", args[0], True, "")]
        if op == "bucket":
            meta, handle = args
            try:
                views = self.receiver.receive(meta, handle)
            except EngineError as e:
                if meta.checksum is None:
                    self.errors[meta.index] = str(e)
                    return []
                return [("ack", meta.index, meta.version, False, str(e))]
            self.loaded.update({n: v.clone() for n, v in views})
            return [] if meta.checksum is None else [("ack", meta.index, meta.version, True, "")]
        if op == "bucket_checksum":
            index, version, checksum = args
            if index in self.errors:
                return [("ack", index, version, False, self.errors.pop(index))]
            try:
                self.receiver.confirm(index, version, checksum)
            except EngineError as e:
                return [("ack", index, version, False, str(e))]
            return [("ack", index, version, True, "")]
        if op == "end_sync":
            try:
                self.receiver.end(*args)
            except EngineError as e:
                return [("ack", "end_sync", args[0], False, str(e))]
            return [("ack", "end_sync", args[0], True, "")]
        if op == "abort_sync":
            self.receiver.version = None
            return [("ack", "abort_sync", args[0], True, "")]
        raise AssertionError(op)


def _weights(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [
        ("w1", torch.randn(64, 32, generator=g)),
        ("w2", torch.randn(100, generator=g).to(torch.bfloat16)),
        ("w3", torch.randn(200, 10, generator=g)),
        ("w4", torch.randn(3, generator=g)),
    ]


def test_sender_receiver_sync_then_reuse_the_same_buffers():
    channel = LazyChannel(SharedBucketReceiver())
    sender = SharedBucketSender(channel, bucket_bytes=4096, timeout_s=5.0)
    first = sender.sync(iter(_weights(1)), version=1)
    assert first.first_sync and first.buckets == len(sender.slots) > 1
    handles = [m[2] for m in channel.sent if m[0] == "bucket"]
    assert all(h is not None for h in handles)
    buffers = [slot.buffer.data_ptr() for slot in sender.slots]
    for step in (2, 3):
        channel.sent.clear()
        stats = sender.sync(iter(_weights(step)), version=step)
        assert not stats.first_sync
        assert all(m[2] is None for m in channel.sent if m[0] == "bucket")  # no new handles
        assert [slot.buffer.data_ptr() for slot in sender.slots] == buffers
        for name, tensor in _weights(step):
            assert torch.equal(channel.loaded[name], tensor)
    assert all(slot.buffer.is_shared() for slot in sender.slots)


def test_version_mismatch_raises_and_the_next_sync_recovers():
    channel = LazyChannel(SharedBucketReceiver())
    sender = SharedBucketSender(channel, bucket_bytes=4096, timeout_s=5.0)
    sender.sync(iter(_weights(1)), version=1)
    sender._debug_version_offset = 1
    with pytest.raises(EngineError, match="version mismatch"):
        sender.sync(iter(_weights(2)), version=2)
    sender._debug_version_offset = 0
    sender.sync(iter(_weights(3)), version=3)
    for name, tensor in _weights(3):
        assert torch.equal(channel.loaded[name], tensor)


def test_checksum_mismatch_raises():
    channel = LazyChannel(SharedBucketReceiver())
    sender = SharedBucketSender(channel, bucket_bytes=1 << 20, timeout_s=5.0)
    sender._debug_corrupt = True
    with pytest.raises(EngineError, match="checksum mismatch in bucket 0"):
        sender.sync(iter(_weights(1)), version=1)
    assert not sender.slots  # a failed first sync leaves no half layout
    sender.sync(iter(_weights(2)), version=2)


def test_a_changed_tensor_set_is_refused():
    channel = LazyChannel(SharedBucketReceiver())
    sender = SharedBucketSender(channel, bucket_bytes=4096, timeout_s=5.0)
    sender.sync(iter(_weights(1)), version=1)
    with pytest.raises(EngineError, match="got 3 tensors"):
        sender.sync(iter(_weights(2)[:3]), version=2)
    renamed = [("other", t) if n == "w2" else (n, t) for n, t in _weights(2)]
    with pytest.raises(EngineError, match="must not change"):
        sender.sync(iter(renamed), version=2)
    sender.sync(iter(_weights(4)), version=4)  # the link is clean again
    assert torch.equal(channel.loaded["w3"], _weights(4)[2][1])


def test_receiver_rejects_buckets_outside_a_sync():
    receiver = SharedBucketReceiver()
    buffer, metas = pack_bucket(_weights(1))
    from rlite.sync.buckets import BucketMeta
    from rlite.sync.transport import share_handle

    meta = BucketMeta(0, 1, buffer.numel(), bucket_checksum(buffer), tuple(metas))
    with pytest.raises(EngineError, match="outside a sync"):
        receiver.receive(meta, share_handle(buffer.share_memory_()))
    receiver.begin(1)
    views = receiver.receive(meta, share_handle(buffer))
    assert torch.equal(dict(views)["w3"], _weights(1)[2][1])
    with pytest.raises(EngineError, match="never received"):
        receiver.end(1, n_buckets=2)


def test_the_next_all_gather_starts_before_the_current_tensor_is_used_and_after_the_last_is_done(monkeypatch):
    # one all-gather in flight at a time: two at once on a gloo group corrupted the heap (weights.py)
    import rlite.plugins.fsdp2.weights as ws

    events = []
    monkeypatch.setattr(ws, "_start_full", lambda t, views=False: events.append(("start", int(t))) or t)
    monkeypatch.setattr(ws, "_finish_full", lambda t: events.append(("finish", int(t))) or t)
    plan = [(torch.tensor(i), False, f"entry{i}") for i in range(3)]
    for entry, full in ws._gather_ahead(plan):
        events.append(("use", int(full)))
        assert entry == f"entry{int(full)}"
    assert events == [
        ("start", 0), ("finish", 0), ("start", 1), ("use", 0),
        ("finish", 1), ("start", 2), ("use", 1),
        ("finish", 2), ("use", 2),
    ]


def test_a_consumer_that_stops_early_leaves_no_all_gather_in_flight(monkeypatch):
    import rlite.plugins.fsdp2.weights as ws

    started, finished = [], []
    monkeypatch.setattr(ws, "_start_full", lambda t, views=False: started.append(int(t)) or t)
    monkeypatch.setattr(ws, "_finish_full", lambda t: finished.append(int(t)) or t)
    plan = [(torch.tensor(i), False, f"entry{i}") for i in range(4)]
    stream = ws._gather_ahead(plan)
    assert next(stream)[0] == "entry0"
    stream.close()  # the consumer is done after one tensor: the gather of the second was in flight
    assert started == finished == [0, 1]

    started.clear(), finished.clear()
    stream = ws._gather_ahead(plan)
    next(stream)
    with pytest.raises(EngineError, match="no parameter"):
        stream.throw(EngineError("weight sync: engine model has no parameter named 'x'"))
    assert started == finished == [0, 1]


def test_the_configured_bucket_size_is_converted_once_to_the_bytes_the_sync_takes() -> None:
    """``rollout.sync_bucket_mb`` reaches every sender as ``RolloutConfig.bucket_bytes`` (MiB): four tensors of
    1 MiB each in buckets of 2 MiB make two buckets, in 1 MiB buckets four."""
    from rlite.config import RolloutConfig
    from rlite.sync import iter_buckets

    tensors = [(f"w{i}", torch.zeros(1 << 18)) for i in range(4)]  # 2^18 float32 = 1 MiB each
    assert RolloutConfig(sync_bucket_mb=2).bucket_bytes == 2 << 20
    assert [len(b) for b in iter_buckets(iter(tensors), RolloutConfig(sync_bucket_mb=2).bucket_bytes)] == [2, 2]
    assert [len(b) for b in iter_buckets(iter(tensors), RolloutConfig(sync_bucket_mb=1).bucket_bytes)] == [1, 1, 1, 1]
