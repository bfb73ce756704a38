"""The weight-sync kit (public): how rlite hands new weights to a rollout engine, for your own engine too.

A stable surface, documented in ``docs/weight_sync.md`` ("Feeding your own engine"): the flattened
bucket format (:func:`iter_buckets`, :func:`pack_bucket`, :func:`unpack_bucket`, :func:`bucket_checksum`,
:class:`TensorMeta`, :class:`BucketMeta`), the trainer's end (:class:`SharedBucketSender` over a
:class:`Channel` such as :class:`ConnectionChannel`, reporting :class:`SyncStats`) and the engine's
end (:class:`SyncServer`, built on :class:`SharedBucketReceiver`). Buffers are CPU shared memory or,
with ``SharedBucketSender(device="cuda")``, CUDA-IPC: the messages and the layout are the same.
Everything here is also in :mod:`rlite.api`.
"""

from rlite.sync.buckets import (
    ALIGNMENT,
    BucketMeta,
    TensorMeta,
    bucket_checksum,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
)
from rlite.sync.transport import (
    Channel,
    ConnectionChannel,
    SharedBucketReceiver,
    SharedBucketSender,
    SyncServer,
    SyncStats,
)

__all__ = [
    "ALIGNMENT",
    "BucketMeta",
    "Channel",
    "ConnectionChannel",
    "SharedBucketReceiver",
    "SharedBucketSender",
    "SyncServer",
    "SyncStats",
    "TensorMeta",
    "bucket_checksum",
    "iter_buckets",
    "pack_bucket",
    "unpack_bucket",
]
