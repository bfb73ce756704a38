"""rlite-thirdparty-kit: a third-party rlite plugin package written only against ``rlite.api``.

Registers a wrapper engine (``thirdparty_counting``), an out-of-process engine (``thirdparty_remote``), a
wrapper of the fsdp2 backend (``thirdparty_fsdp2``) and an advantage estimator (``range_baseline``) with its
float64 reference. The wrappers and the engine process report what they did through rlite's metrics channel
(``rlite.api.MetricsSink``), so each step's row in ``metrics.jsonl`` shows they were used. Heavy imports
(transformers, the engine process) happen in the factories, not here: every ``rlite`` command imports every
plugin.
"""

from __future__ import annotations

from rlite.api import hookimpl
from rlite_thirdparty_kit.backend import ThirdPartyBackendConfig, make_thirdparty_backend
from rlite_thirdparty_kit.engines import CountingEngineConfig, make_counting_engine
from rlite_thirdparty_kit.estimator import RangeBaselineConfig, range_baseline, range_baseline_reference
from rlite_thirdparty_kit.remote import RemoteEngineConfig, make_remote_engine


@hookimpl
def register_rollout_engines(register):
    register("thirdparty_counting", make_counting_engine, CountingEngineConfig)
    register("thirdparty_remote", make_remote_engine, RemoteEngineConfig)


@hookimpl
def register_training_backends(register):
    register("thirdparty_fsdp2", make_thirdparty_backend, ThirdPartyBackendConfig)


@hookimpl
def register_advantage_estimators(register):
    register("range_baseline", range_baseline, RangeBaselineConfig, reference=range_baseline_reference)
