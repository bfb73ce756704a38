"""``thirdparty_counting``: a registered engine (``transformers`` unless ``args.inner`` says otherwise),
wrapped with ``rlite.api.EngineWrapper``; it counts what it generates and changes nothing else.

The counts go to the step's metrics row through the engine's metrics channel (``context.metrics``, an
``rlite.api.MetricsSink`` shared with the engine it wraps): ``thirdparty/n_generate_calls`` and
``thirdparty/n_completions``, this step's, summed over the calls (never totals since the process started,
which a resumed run would restart from 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlite.api import EngineWrapper, MetricsSink, registered


@dataclass
class CountingEngineConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The registered engine to wrap."""
    inner_args: Any = None
    """The wrapped engine's options (a mapping in YAML, checked against its config class when the config loads);
    they arrive built, as that engine's config instance."""


class CountingEngine(EngineWrapper):
    """Counts ``generate`` calls and the completions they return; everything else is the inner engine's."""

    def __init__(self, inner, metrics: MetricsSink) -> None:
        super().__init__(inner)
        self.metrics = metrics

    def generate(self, prompts, params):
        completions = self.inner.generate(prompts, params)
        self.metrics.report({"thirdparty/n_generate_calls": 1, "thirdparty/n_completions": len(completions)},
                            reduce="sum")
        return completions


def make_counting_engine(model_config, tokenizer, rollout_config, cfg: CountingEngineConfig, context):
    inner = registered("rollout_engine", cfg.inner)  # the running rlite's registry: plugins.enable respected
    engine = inner.implementation(model_config, tokenizer, rollout_config, cfg.inner_args, context)
    return CountingEngine(engine, context.metrics)
