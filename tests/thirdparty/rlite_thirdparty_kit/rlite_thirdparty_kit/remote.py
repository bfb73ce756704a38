"""``thirdparty_remote``: an engine in its own process, fed new weights by rlite's public weight-sync kit.

Two halves (the pattern of ``examples/own_engine`` and ``docs/weight_sync.md``, "Feeding your own engine"):

* :func:`serve` runs in the engine's process: it builds the model from the checkpoint's config (no weights
  are read: the trainer's first sync brings every one), answers the sync protocol through
  ``rlite.api.SyncServer`` (each verified bucket copied into the model), and samples on ``generate``: one
  full forward per token, no cache, so its log-probs are exactly the model's (temperature-scaled)
  distribution. It refuses to generate while its weights are not valid (before the first sync, after a
  failed one).
* :class:`RemoteEngine` is the trainer's handle, an ``rlite.api.RolloutEngine``: it starts the process
  (``spawn``), sends every weight sync with ``rlite.api.SharedBucketSender`` (shared-memory buckets,
  each checked by its checksum) and asks for completions over the same pipe.

Metrics cross the pipe both ways the metrics channel offers (``docs/plugins.md``, "Reporting metrics"): the
engine process reports into its own ``rlite.api.MetricsSink``; a ``generate`` reply carries what it reported
while sampling (``thirdparty/remote/n_forwards``: the model forwards it ran), and after every weight sync the
handle asks with the protocol's ``("metrics",)`` message (``SharedBucketSender.fetch_metrics``, answered by the
``SyncServer``: ``thirdparty/remote/n_tensors_loaded``). Both land in ``context.metrics``, the step's row.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

import torch

from rlite.api import (
    Completion,
    ConnectionChannel,
    EngineCapabilities,
    EngineDied,
    EngineError,
    MetricsSink,
    SharedBucketSender,
    SyncServer,
)


@dataclass
class RemoteEngineConfig:
    start_timeout_s: float = 300.0
    """How long the engine process may take to start (imports, building the model)."""


# --------------------------------------------------------------------------------------------------
# the engine's process
# --------------------------------------------------------------------------------------------------


def serve(conn, model_path: str, dtype: str, eos_token_ids: list[int]) -> None:
    """Entry point of the engine process: answer the trainer's messages until ``("shutdown",)``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    params = dict(model.named_parameters())  # tied weights listed once, as the trainer sends them
    seen: set[str] = set()
    metrics = MetricsSink()  # this process's reports; the trainer's handle collects them

    @torch.no_grad()
    def load(views):
        for name, view in views:  # views into the shared bucket: copy them out before the next sync reuses it
            if name not in params:
                raise KeyError(f"the engine's model has no parameter {name!r}")
            params[name].copy_(view)
            seen.add(name)
        metrics.report({"thirdparty/remote/n_tensors_loaded": len(views)}, reduce="sum")

    def check_complete(version: int) -> None:
        missing = sorted(set(params) - seen)
        seen.clear()
        if missing:
            raise RuntimeError(f"sync v{version} left {len(missing)} parameters stale, e.g. {missing[:3]}")

    server = SyncServer(load, check_complete=check_complete, metrics=metrics)  # answers ("metrics",) too
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
        if op == "generate" and not server.weights_valid:
            conn.send(("error", f"refusing to generate: {server.invalid_reason}"))
        elif op == "generate":
            try:
                completions, forwards = sample(model, *args, eos_token_ids=eos_token_ids)
                metrics.report({"thirdparty/remote/n_forwards": forwards}, reduce="sum")
                # the reply carries what this call reported (a message of the engine's own protocol)
                conn.send(("ok", server.weight_version, completions, metrics.drain()))
            except Exception as exc:  # the trainer gets the error, the process lives on
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            conn.send(("error", f"unknown call {op!r}"))


@torch.no_grad()
def sample(model, prompts: list[list[int]], params, *, eos_token_ids: list[int]) -> tuple[list[tuple], int]:
    """``params.n`` completions per prompt, grouped in order: ``(prompt_index, tokens, logprobs, finish)``; and
    the number of model forwards that took."""
    if params.top_p < 1.0 or params.top_k > 0:
        raise ValueError("this engine samples from the whole distribution: top_p must be 1 and top_k 0")
    generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    stops = set(eos_token_ids) | set(params.stop_token_ids)
    out, forwards = [], 0
    for index, prompt in enumerate(prompts):
        for _ in range(params.n):
            tokens, logprobs, finish = [], [], "length"
            for _ in range(params.max_new_tokens):
                logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].float()
                forwards += 1
                logp = torch.log_softmax(logits / (1.0 if params.greedy else params.temperature), dim=-1)
                if params.greedy:
                    token = int(logp.argmax())
                else:
                    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(logp[token]))
                if token in stops:
                    finish = "stop"
                    break
            out.append((index, tokens, logprobs, finish))
    return out, forwards


# --------------------------------------------------------------------------------------------------
# the trainer's handle
# --------------------------------------------------------------------------------------------------


class RemoteEngine:
    """Starts :func:`serve` in a spawned process and talks to it over one pipe."""

    capabilities = EngineCapabilities()  # its own copy of the weights; no LoRA, routing or drafts

    def __init__(self, model_path: str, dtype: str, eos_token_ids: list[int], *, bucket_bytes: int,
                 timeout_s: float, start_timeout_s: float, metrics: MetricsSink) -> None:
        ctx = mp.get_context("spawn")  # the engine must be a multiprocessing child: it maps the trainer's buffers
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=serve, args=(child_conn, str(model_path), dtype, list(eos_token_ids)),
                                   daemon=True)
        self.process.start()
        child_conn.close()
        self.timeout_s = timeout_s
        self.metrics = metrics  # the run's sink for this engine (context.metrics): what the process reports goes there
        self.weight_version = 0
        self.channel = ConnectionChannel(self.conn)
        if self.channel.recv(start_timeout_s) != ("ready",):
            raise EngineDied("the engine process did not start")
        self.sender = SharedBucketSender(self.channel, bucket_bytes=bucket_bytes, timeout_s=timeout_s)

    def generate(self, prompts, params):
        self.channel.send(("generate", [list(p) for p in prompts], params))
        reply = self.channel.recv(self.timeout_s)
        if reply[0] != "ok":
            raise EngineError(f"thirdparty_remote: {reply[1]}")
        _, version, completions, reported = reply
        self.metrics.merge(reported)
        return [Completion(index, tokens, logprobs, finish, version) for index, tokens, logprobs, finish in completions]

    def update_weights(self, named_tensors, version):
        self.sender.sync(named_tensors if named_tensors is not None else (), version)
        self.weight_version = version
        self.sender.fetch_metrics(into=self.metrics)  # what the process reported while loading

    def release_memory(self):
        pass  # on CPU there is nothing to hand back

    def resume_memory(self):
        pass

    def shutdown(self):
        if self.process is None:
            return
        try:
            self.channel.send(("shutdown",))
        except Exception:
            pass  # already gone
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.sender.reset()  # drop the shared buffers
        self.conn.close()
        self.process = None


def make_remote_engine(model_config, tokenizer, rollout_config, cfg: RemoteEngineConfig, context):
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return RemoteEngine(model_config.path, model_config.dtype, eos, bucket_bytes=rollout_config.bucket_bytes,
                        timeout_s=rollout_config.timeout_s, start_timeout_s=cfg.start_timeout_s, metrics=context.metrics)
