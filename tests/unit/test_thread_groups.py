"""rlite's collectives called without a group run on the calling thread's group: the default group on
the trainer's thread, the producer's own group on the asynchronous rollouts' producer thread (so two
threads never share one group; rlite.distributed.new_side_group says why that is the rule)."""

from __future__ import annotations

import threading

import torch

import rlite.distributed as rd


def test_collectives_without_a_group_go_on_the_calling_threads_group(monkeypatch):
    calls = []
    monkeypatch.setattr(rd.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rd.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(rd.dist, "all_reduce",
                        lambda tensor, op=None, group=None: calls.append((threading.current_thread().name, group)))
    monkeypatch.setattr(rd.dist, "all_gather_object",
                        lambda out, obj, group=None: calls.append((threading.current_thread().name, group)))

    def producer():
        rd.use_thread_group("side")
        rd.all_reduce_sum(torch.ones(1))
        rd.all_reduce_max(torch.ones(1))
        rd.all_gather_objects("x")
        rd.all_reduce_sum(torch.ones(1), group="data-parallel")  # a group named explicitly stays

    rd.all_reduce_sum(torch.ones(1))
    thread = threading.Thread(target=producer, name="producer")
    thread.start()
    thread.join()
    rd.all_gather_objects("x")
    assert calls == [("MainThread", None), ("producer", "side"), ("producer", "side"), ("producer", "side"),
                     ("producer", "data-parallel"), ("MainThread", None)]  # fmt: skip
