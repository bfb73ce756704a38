"""The metrics channel of components (``rlite.api.MetricsSink``, docs/plugins.md "Reporting metrics"): what an
engine reports into ``EngineContext.metrics`` and a backend into its ``metrics`` reaches the row of the step it
worked in (reduced over calls and ranks as each name asks; an evaluation's into ``eval/<name>``), a process of
its own reports over ``rlite.sync`` (``SyncServer(metrics=...)`` / ``SharedBucketSender.fetch_metrics``), and
the rule that holds it together -- metrics must equal after a resume -- holds for per-step numbers, in the
synchronous loop and with a batch sampled ahead (``one_step_off``), while a running total breaks it, as the
audit's comparison shows."""

from __future__ import annotations

import threading

import pytest

from rlite.api import EngineWrapper, MetricsSink, SyncServer, hookimpl, registered
from rlite.metrics import merge_reported, reported_values
from rlite.plugin_manager import build_plugin_manager
from rlite.run.loop import run_training
from rlite.sync import SharedBucketSender
from rlite.testing import read_jsonl, tiny_config
from rlite.tokenizer import build_tiny_model_dir
from rlite.tools.audit import comparable

# --------------------------------------------------------------------------------------------------
# the sink
# --------------------------------------------------------------------------------------------------


def test_means_average_over_reports_and_sums_add_up() -> None:
    sink = MetricsSink()
    sink.report({"x/rate": 0.5, "x/other": 1.0})
    sink.report({"x/rate": 1.0})
    sink.report({"x/n_hits": 3}, reduce="sum")
    sink.report({"x/n_hits": 4}, reduce="sum")
    drained = sink.drain()
    assert drained == {"x/rate": ("mean", 1.5, 2), "x/other": ("mean", 1.0, 1), "x/n_hits": ("sum", 7.0, 2)}
    assert reported_values(drained) == {"x/n_hits": 7.0, "x/other": 1.0, "x/rate": 0.75}
    assert sink.drain() == {}  # drained means forgotten


def test_reports_of_ranks_merge_as_one_mean_over_every_report() -> None:
    """Rank 0 reported 1.0 once, rank 1 reported 4.0 and 7.0: the mean is over the three reports."""
    ranks = [MetricsSink(), MetricsSink()]
    ranks[0].report({"x/v": 1.0})
    ranks[1].report({"x/v": 4.0})
    ranks[1].report({"x/v": 7.0})
    for sink in ranks:
        sink.report({"x/n": 2}, reduce="sum")
    assert reported_values(merge_reported(sink.drain() for sink in ranks)) == {"x/n": 4.0, "x/v": 4.0}


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda s: s.report({"x/v": "1"}), TypeError, "'x/v' must be a real number"),
    (lambda s: s.report({"x/v": True}), TypeError, "'x/v' must be a real number"),
    (lambda s: s.report({"": 1.0}), TypeError, "'<your prefix>/<name>'"),
    (lambda s: s.report({"hits": 1.0}), TypeError, "'<your prefix>/<name>', got 'hits'"),
    (lambda s: s.report({"reward/mean": 1.0}), ValueError, "'reward/mean' is under reward/, a prefix of rlite's own"),
    (lambda s: s.report({"eval/x": 1.0}), ValueError, "under eval/"),
    (lambda s: s.report({"x/v": 1.0}, reduce="max"), ValueError, "reduce must be one of mean, sum"),
    (lambda s: (s.report({"x/v": 1.0}), s.report({"x/v": 1.0}, reduce="sum")), ValueError, "reported with reduce='sum' and with reduce='mean'"),
])  # fmt: skip
def test_bad_reports_are_refused_naming_the_metric(call, error, match) -> None:
    with pytest.raises(error, match=match):
        call(MetricsSink())


def test_reports_from_many_threads_are_all_counted() -> None:
    sink = MetricsSink()

    def work():
        for _ in range(500):
            sink.report({"x/n": 1}, reduce="sum")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert reported_values(sink.drain()) == {"x/n": 4000.0}


# --------------------------------------------------------------------------------------------------
# over rlite.sync
# --------------------------------------------------------------------------------------------------


class Loopback:
    """A channel whose other end is a :class:`SyncServer` in this process (what a pipe and a process do)."""

    def __init__(self, server: SyncServer) -> None:
        self.server, self.replies = server, []

    def send(self, message) -> None:
        assert self.server.handles(message), message
        reply = self.server.handle(message)
        if reply is not None:
            self.replies.append(reply)

    def recv(self, timeout_s: float):
        return self.replies.pop(0)


def test_the_engine_process_reports_over_the_sync_protocol() -> None:
    import torch

    engine_sink, trainer_sink = MetricsSink(), MetricsSink()

    def load(views):  # the engine process's loader reports what it loaded
        engine_sink.report({"eng/n_tensors": len(views)}, reduce="sum")

    sender = SharedBucketSender(Loopback(SyncServer(load, metrics=engine_sink)), bucket_bytes=64)
    # three buckets of 64 bytes: b (80 bytes) goes alone, so a and c are not neighbours
    sender.sync([("a", torch.ones(4)), ("b", torch.zeros(20)), ("c", torch.ones(2))], version=1)
    engine_sink.report({"eng/load_ms": 3.0})
    assert sender.fetch_metrics(into=trainer_sink) == {"eng/n_tensors": ("sum", 3.0, 3), "eng/load_ms": ("mean", 3.0, 1)}
    assert reported_values(trainer_sink.drain()) == {"eng/load_ms": 3.0, "eng/n_tensors": 3.0}
    assert sender.fetch_metrics() == {}  # the process's sink was drained by the first fetch
    assert SyncServer(load).handle(("metrics",)) == ("metrics", {})  # a server without a sink answers empty


def test_fetching_metrics_during_a_sync_is_refused() -> None:
    from rlite.api import EngineError

    sender = SharedBucketSender(Loopback(SyncServer(lambda views: None)))
    sender._pending.append("end_sync")  # an ack still to read: the channel is mid-sync
    with pytest.raises(EngineError, match="in progress"):
        sender.fetch_metrics()


# --------------------------------------------------------------------------------------------------
# in a run, and across a resume
# --------------------------------------------------------------------------------------------------


class Crash(Exception):
    pass


class ProbeEngine(EngineWrapper):
    """The transformers engine, reporting per-step numbers (and one running total, the mistake the rule forbids)."""

    def __init__(self, inner, metrics: MetricsSink) -> None:
        super().__init__(inner)
        self.metrics, self.calls_since_start = metrics, 0

    def generate(self, prompts, params):
        completions = self.inner.generate(prompts, params)
        self.calls_since_start += 1
        tokens = sum(len(c.token_ids) for c in completions)
        self.metrics.report({"probe/n_prompts": len(prompts), "probe/n_tokens": tokens}, reduce="sum")
        self.metrics.report({"probe/tokens_per_completion": tokens / len(completions),
                             "probe/running_total_calls": self.calls_since_start})
        return completions

    def update_weights(self, named_tensors, version):
        self.inner.update_weights(named_tensors, version)
        self.metrics.report({"probe/n_syncs": 1}, reduce="sum")


class ProbeBackend:
    def __init__(self, inner) -> None:
        self.inner, self.metrics = inner, MetricsSink()

    def step(self, before_step=None, *, skip=False):
        norm = self.inner.step(before_step, skip=skip)
        self.metrics.report({"probe/n_optimizer_steps": 1}, reduce="sum")
        return norm

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class Probes:
    def __init__(self, crash_after: int | None = None) -> None:
        self.crash_after = crash_after

    @hookimpl
    def register_rollout_engines(self, register):
        def make(model_config, tokenizer, rollout_config, cfg, context):
            inner = registered("rollout_engine", "transformers")
            engine = inner.implementation(model_config, tokenizer, rollout_config, inner.config_cls(share_weights=False),
                                          context)  # fmt: skip
            return ProbeEngine(engine, context.metrics)

        register("probe", make)

    @hookimpl
    def register_training_backends(self, register):
        def make(config, cfg, device, steps):
            inner = registered("training_backend", "fsdp2")
            return ProbeBackend(inner.implementation(config, None, device, steps))

        register("probe_fsdp2", make)

    @hookimpl
    def on_checkpoint_save(self, step):
        if step == self.crash_after:
            raise Crash(step)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model_dir(tmp_path_factory.mktemp("tiny")))


def train(model_dir, run_dir, mode: str, *, crash_after: int | None = None, resume: str = "never") -> None:
    pm = build_plugin_manager(autoload=False)
    pm.register(Probes(crash_after), name="probes")
    cfg = tiny_config(model_dir, run_dir, "rollout.engine=probe", "parallelism.backend=probe_fsdp2",
                      f"rollout.mode={mode}", "training.steps=3", "checkpoint.every=2", f"checkpoint.resume={resume}",
                      "rollout.temperature=1.0", pm=pm)  # fmt: skip
    run_training(cfg, pm)


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_component_metrics_reach_each_row_and_equal_after_a_resume(tmp_path, model_dir, mode) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(model_dir, straight, mode)
    with pytest.raises(Crash):
        train(model_dir, resumed, mode, crash_after=2)
    train(model_dir, resumed, mode, resume="auto")

    rows = read_jsonl(straight / "metrics.jsonl")
    steps = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2, 3]
    for row in steps:
        # 2 prompts x 4 samples a step; one optimizer step; the tokens are the batch's response tokens
        assert row["probe/n_prompts"] == 2 and row["probe/n_optimizer_steps"] == 1
        assert row["probe/n_tokens"] == pytest.approx(row["response/length"] * 8)
        assert row["probe/tokens_per_completion"] == pytest.approx(row["response/length"])
    # the syncs between the batch before and the step's batch: the build's before step 1, then in the
    # synchronous loop the one after each step; one_step_off draws step 2's batch before the first sync
    # after a step (with the build's weights) and step 3's after it
    assert [row.get("probe/n_syncs", 0) for row in steps] == ([1, 1, 1] if mode == "sync" else [1, 0, 1])
    # the evaluations (the baseline and the last step): their own calls, under eval/, no sync among them
    evals = [row for row in rows if "eval/greedy_accuracy" in row]
    assert [row["step"] for row in evals] == [0, 3]
    assert all(row["eval/probe/n_prompts"] == 2 * 8 and "eval/probe/n_syncs" not in row for row in evals)

    # what the audit compares: every per-step number equal after the resume. A running total since the process
    # started is not, where the resumed process sampled the batch itself; one_step_off's checkpoint of step 2
    # kept the batch of step 3, sampled before the crash, and what the engine reported with it (so even that
    # total equals: the report travelled with the batch)
    again = [row for row in read_jsonl(resumed / "metrics.jsonl") if "reward/mean" in row]
    assert [row["step"] for row in again] == [1, 2, 3]
    differing = {k for a, b in zip(comparable(again), comparable(steps)) for k in a
                 if a.get(k) != b.get(k) and not k.startswith("rollout/producer_")}  # the producer thread's timings
    assert differing == ({"probe/running_total_calls"} if mode == "sync" else set())
    assert again[-1]["probe/n_syncs"] == steps[-1]["probe/n_syncs"] == 1
