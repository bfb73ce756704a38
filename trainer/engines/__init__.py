"""The rollout-engine contract (:mod:`~rlite.engines.base`) and what every engine is given or may reuse: its
placement on the ranks (:mod:`~rlite.engines.placement`), the supervisor that restarts a dead one, the sampler
and the speculative-sampling maths. The engines rlite ships are plugins (:mod:`rlite.plugins.transformers`,
:mod:`rlite.plugins.sglang`)."""
