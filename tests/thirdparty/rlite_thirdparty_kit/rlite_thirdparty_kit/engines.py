"""``thirdparty_counting``: a registered engine (``transformers`` unless ``args.inner`` says otherwise),
wrapped with ``rlite.api.EngineWrapper``; it counts what it generates and changes nothing else."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlite.api import EngineWrapper, registered

COUNTS: Counter[str] = Counter()
"""What this package's plugins did in this process: ``generate_calls`` and ``completions`` (the wrapper engine),
``remote_generate_calls`` (the out-of-process engine), ``backend_steps`` and ``backend_skipped_steps``."""


@dataclass
class CountingEngineConfig:
    inner: str = field(default="transformers", metadata={"choice_of": "rollout_engine"})
    """The registered engine to wrap."""
    inner_args: Any = None
    """The wrapped engine's options (a mapping in YAML, checked against its config class when the config loads);
    they arrive built, as that engine's config instance."""


class CountingEngine(EngineWrapper):
    """Counts ``generate`` calls and the completions they return; everything else is the inner engine's."""

    def generate(self, prompts, params):
        completions = self.inner.generate(prompts, params)
        COUNTS["generate_calls"] += 1
        COUNTS["completions"] += len(completions)
        return completions


def make_counting_engine(model_config, tokenizer, rollout_config, cfg: CountingEngineConfig, context):
    inner = registered("rollout_engine", cfg.inner)  # the running rlite's registry: plugins.enable respected
    return CountingEngine(inner.implementation(model_config, tokenizer, rollout_config, cfg.inner_args, context))
