"""An engine of your own in its own process, fed new weights by rlite's public weight-sync kit.

Two halves, one per process (``docs/weight_sync.md``, "Feeding your own engine"):

* :func:`serve` runs in the engine's process: it builds a transformers model from the checkpoint's
  config (no weights are read: the first sync brings them), answers the sync protocol through
  :class:`rlite.sync.SyncServer`, copying every bucket into the model, and answers calls of its own:
  ``report`` (the weight version and a checksum of the weights it holds), ``weights`` (copies, for
  checks) and ``generate`` (greedy tokens).
* :class:`OwnEngine` is the trainer's handle on it: it starts the process (``spawn``) and sends each new
  set of weights with :class:`rlite.sync.SharedBucketSender` (the same sender ``ProcessEngine`` uses:
  shared-memory buckets, written in place by every later sync, each checked by its checksum).

``tests/docs/test_own_engine_example.py`` runs it against rlite's FSDP2 backend. To try it by hand on
a local checkpoint: ``python examples/own_engine/own_engine.py MODEL_DIR``.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Iterable

import torch

from rlite.sync import (
    ConnectionChannel,
    SharedBucketSender,
    SyncServer,
    SyncStats,
    bucket_checksum,
    pack_bucket,
)


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """One number for a set of weights: the bucket checksum of them all, packed in name order."""
    named = sorted(((name, tensor.detach().cpu()) for name, tensor in named), key=lambda item: item[0])
    buffer, _ = pack_bucket(named, device="cpu")
    return bucket_checksum(buffer)


# --------------------------------------------------------------------------------------------------
# the engine's process
# --------------------------------------------------------------------------------------------------


def serve(conn, model_dir: str) -> None:
    """Entry point of the engine process: answer the trainer's messages until ``("shutdown",)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    params = dict(model.named_parameters())  # tied weights are listed once, as the trainer sends them
    seen: set[str] = set()

    @torch.no_grad()
    def load(views: list[tuple[str, torch.Tensor]]) -> None:
        for name, view in views:  # views into the shared bucket: copy them out (or make them the storage)
            if name not in params:
                raise KeyError(f"the engine's model has no parameter {name!r}")
            params[name].copy_(view)
            seen.add(name)

    def check_complete(version: int) -> None:
        missing = sorted(set(params) - seen)
        seen.clear()
        if missing:
            raise RuntimeError(f"sync v{version} left {len(missing)} parameters stale, e.g. {missing[:3]}")

    server = SyncServer(load, check_complete=check_complete)
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return  # the trainer is gone
        if server.handles(message):
            reply = server.handle(message)
            if reply is not None:
                conn.send(reply)
            continue
        op, *args = message
        if op == "shutdown":
            return
        if op == "report":
            conn.send((server.weight_version, weights_checksum(model.named_parameters())))
        elif op == "weights":
            conn.send({name: p.detach().clone() for name, p in model.named_parameters()})
        elif op == "generate" and not server.weights_valid:
            conn.send(f"refusing to generate: {server.invalid_reason}")
        elif op == "generate":
            conn.send(greedy(model, *args))
        else:
            conn.send(f"unknown call {op!r}")


@torch.no_grad()
def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The ``max_new_tokens`` most likely next tokens, one at a time (no cache: a tiny model's example)."""
    ids = torch.tensor([prompt])
    for _ in range(max_new_tokens):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


# --------------------------------------------------------------------------------------------------
# the trainer's handle
# --------------------------------------------------------------------------------------------------


class OwnEngine:
    """Starts :func:`serve` in a spawned process and talks to it over one pipe."""

    def __init__(self, model_dir: str, *, bucket_bytes: int = 512 << 20, timeout_s: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=serve, args=(child_conn, str(model_dir)), daemon=True)
        self.process.start()
        child_conn.close()
        self.timeout_s = timeout_s
        self.channel = ConnectionChannel(self.conn)
        if self.channel.recv(timeout_s) != ("ready",):
            raise RuntimeError("the engine process did not start")
        self.sender = SharedBucketSender(self.channel, bucket_bytes=bucket_bytes, timeout_s=timeout_s)

    def update_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        """Hand a stream of ``(Hugging Face name, tensor)`` pairs over as weight ``version``."""
        return self.sender.sync(named, version)

    def call(self, op: str, *args):
        self.channel.send((op, *args))
        return self.channel.recv(self.timeout_s)

    def report(self) -> tuple[int | None, int]:
        """``(weight version, weights checksum)`` as the engine process sees them."""
        return self.call("report")

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        return self.call("generate", prompt, max_new_tokens)

    def shutdown(self) -> None:
        try:
            self.channel.send(("shutdown",))
        except Exception:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def main(model_dir: str) -> None:
    """Sync a checkpoint's weights twice (the second time changed) and print what the engine reports."""
    from transformers import AutoModelForCausalLM

    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = OwnEngine(model_dir)
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in trainer_model.parameters():
                        p.mul_(1.01)
            stats = engine.update_weights(((n, p.detach()) for n, p in trainer_model.named_parameters()), version)
            weight_version, checksum = engine.report()
            expected = weights_checksum(trainer_model.named_parameters())
            print(f"v{weight_version}: {stats.nbytes} bytes in {stats.buckets} bucket(s), checksum {checksum:#018x} "
                  f"({'equal to' if checksum == expected else 'DIFFERENT from'} the trainer's); "
                  f"greedy tokens {engine.generate([1, 2, 3], 4)}")
    finally:
        engine.shutdown()


if __name__ == "__main__":  # spawn re-imports this module in the engine process
    main(sys.argv[1])
