"""Multi-turn rollouts: an environment answers each sampled turn, token in and token out.

A rollout workflow (``rollout.workflow``, registered by ``register_rollout_workflows``) is a factory
of environments, one per trajectory::

    env = factory(cfg, tokenizer)
    first = env.reset(sample)                      # None, text, or token ids: appended to the prompt
    observation, reward, done = env.step(action)   # after every sampled turn

:class:`TurnRunner` drives the engine and the environments of a batch together, turn by turn:

1. every live trajectory's context (prompt, then all tokens so far) goes to the engine as token ids;
   the engine returns the sampled token ids and their log-probs;
2. the sampled ids are appended to the trajectory unchanged (loss mask 1, the engine's log-probs);
3. the environment reads the turn (:class:`Action`: the ids, and their text for convenience) and
   answers; unless it is done, its observation is appended as tokens with loss mask 0 and log-prob 0:
   the chat template's turn separators (encoded once, when the runner is built), the observation's
   own tokens (text is encoded once, on its own; never the conversation), and the separator that
   opens the next assistant turn.

Nothing is ever decoded and encoded again, so the trainer's input ids are exactly the sampled tokens
and the observation tokens. A trajectory ends when its environment says done (``stop``), after
``rollout.max_turns`` sampled turns (``turns``), or when the next turn would not fit into
``rollout.max_response_tokens`` (``length``; the budget counts sampled and observation tokens). It
always ends with a sampled turn: an observation is appended only when another turn follows.

The environment's rewards are summed over the trajectory: the batch keeps them, the turns and the
environment's ``metrics()`` as typed columns (``RolloutBatch.env``, :class:`rlite.rollout.EnvResults`), and
the reward functions see them as ``sample["env_reward"]``, ``sample["turns"]`` and ``sample["env_metrics"]``
(:func:`rlite.reward_runner.reward_samples`): the built-in ``env_reward`` reward function returns the first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlite.engines.base import Completion, RolloutEngine, SamplingParams


@dataclass
class Action:
    """One sampled turn, as the environment sees it."""

    token_ids: list[int]
    """The tokens the engine sampled in this turn (the stop token included if one ended it)."""
    text: str
    """Their text (special tokens skipped), for environments that read text; never encoded again."""
    finish_reason: str
    """The engine's: ``stop`` or ``length`` (the turn's token limit)."""
    turn: int
    """0-based index of the turn."""


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment (a fresh one per sample)."""

    def reset(self, sample: dict[str, Any]) -> str | list[int] | None:
        """Start on a data row; the first observation is appended to the prompt's tokens as they are
        (no separators: the prompt already ends where the first assistant turn begins)."""

    def step(self, action: Action) -> tuple[str | list[int] | None, float, bool]:
        """``(observation, reward, done)`` after a sampled turn; rewards are summed over the trajectory.
        An observation is text (encoded once, on its own), token ids (used as they are) or None."""

    # Optional: ``metrics() -> dict[str, float]``, read once when the trajectory has ended: numbers about
    # the episode (tool calls, which turns were right), averaged over the batch into ``rollout/env/<key>``
    # and over an evaluation into ``eval/<mode>_env/<key>``. A ``correct`` key, when present, is what the
    # ``*accuracy`` metrics count for a multi-turn sample (see :func:`env_metrics`).


class SingleTurn:
    """Today's rollout: one sampled completion per sample, scored by the reward functions alone."""

    def reset(self, sample: dict[str, Any]) -> None:
        return None

    def step(self, action: Action) -> tuple[None, float, bool]:
        return None, 0.0, True


@dataclass
class TurnFormat:
    """The chat template's separators around an observation, as token ids encoded once."""

    before: list[int]
    """Closes the assistant turn and opens the observation's (ChatML: ``<|im_end|>\\n<|im_start|>user\\n``)."""
    after: list[int]
    """Closes the observation's turn and opens the next assistant turn (``<|im_end|>\\n<|im_start|>assistant\\n``)."""
    turn_end_ids: frozenset[int] = frozenset()
    """Tokens that end an assistant turn (eos): when a turn ended with one, ``before`` does not repeat it."""

    def wrap(self, observation: list[int], last_sampled: int | None) -> list[int]:
        before = self.before
        if before and last_sampled is not None and last_sampled in self.turn_end_ids and before[0] == last_sampled:
            before = before[1:]  # the engine sampled the turn's end token itself
        return before + observation + self.after


_MARK_A, _MARK_B = "\x00RLITE_ACTION\x00", "\x00RLITE_OBSERVATION\x00"


def turn_format(tokenizer, role: str, use_chat_template: bool, turn_end_ids: list[int]) -> TurnFormat:
    """The separators of ``tokenizer``'s chat template around a ``role`` message that follows an
    assistant message: the template is rendered once with marker contents and the text between the
    markers is encoded once (without special-token additions). No chat template (or
    ``use_chat_template`` off): no separators."""
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return TurnFormat([], [], frozenset(turn_end_ids))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK_A}, {"role": role, "content": _MARK_B}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    if _MARK_A not in text or _MARK_B not in text:
        raise ValueError(
            f"rollout.observation_role: the chat template dropped a {role!r} message after an assistant message; "
            "choose a role the template renders (user, tool, ...)"
        )
    between = text.split(_MARK_A, 1)[1].split(_MARK_B, 1)[0]
    after = text.split(_MARK_B, 1)[1]

    def encode(piece: str) -> list[int]:
        return list(tokenizer(piece, add_special_tokens=False)["input_ids"]) if piece else []

    return TurnFormat(encode(between), encode(after), frozenset(turn_end_ids))


@dataclass
class Trajectory:
    """One sample's growing response: every token after the prompt, sampled or observed."""

    prompt_index: int
    env: Any
    context: list[int]
    """Prompt (and first observation) tokens: what the first turn sees."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    """Per token, the weight version that sampled it (-1 for observation tokens)."""
    reward: float = 0.0
    turns: int = 0
    observation_tokens: int = 0
    finish_reason: str = "length"
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    """The environment's own numbers about the ended episode (:func:`env_metrics`)."""

    def add_sampled(self, completion: Completion) -> None:
        n = len(completion.token_ids)
        self.token_ids += list(completion.token_ids)
        self.loss_mask += [1] * n
        self.logprobs += [float(x) for x in completion.logprobs]
        self.weight_versions += list(completion.token_weight_versions or [int(completion.weight_version)] * n)

    def add_observed(self, tokens: list[int]) -> None:
        self.token_ids += tokens
        self.loss_mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.weight_versions += [-1] * len(tokens)
        self.observation_tokens += len(tokens)


class TurnRunner:
    """Runs the environments of a batch against the engine, turn by turn (see the module docstring)."""

    def __init__(self, make_env: Callable[[], Any], tokenizer, fmt: TurnFormat, *, max_turns: int,
                 max_response_tokens: int, workflow: str = "workflow") -> None:
        self.make_env, self.tokenizer, self.fmt = make_env, tokenizer, fmt
        self.max_turns, self.max_response_tokens, self.workflow = max_turns, max_response_tokens, workflow

    def _tokens(self, observation) -> list[int]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return list(self.tokenizer(observation, add_special_tokens=False)["input_ids"]) if observation else []
        if isinstance(observation, (list, tuple)) and all(isinstance(t, int) for t in observation):
            return list(observation)
        raise TypeError(
            f"rollout.workflow {self.workflow!r}: an observation must be text, a list of token ids or None, "
            f"got {type(observation).__name__}"
        )

    def run(self, engine: RolloutEngine, prompts: list[list[int]], samples: list[dict[str, Any]],
            params: SamplingParams, seed_of_turn: Callable[[int], int],
            between_turns: Callable[[], None] | None = None) -> list[Trajectory]:
        """``params.n`` trajectories per prompt (grouped by prompt, in order). ``between_turns()`` runs
        after every turn but the last: asynchronous rollouts let a weight sync in there, and the next
        turns sample with the new weights (each token's version is recorded)."""
        n = params.n
        trajectories = []
        for index, (prompt, sample) in enumerate(zip(prompts, samples)):
            for _ in range(n):
                env = self.make_env()
                first = self._tokens(env.reset(dict(sample)))
                trajectories.append(Trajectory(index, env, list(prompt) + first))
        for turn in range(self.max_turns):
            live = [t for t in trajectories if not t.done]
            if not live:
                break
            if turn and between_turns is not None:
                between_turns()
            turn_params = SamplingParams(**{**params.__dict__, "n": 1, "seed": seed_of_turn(turn)})
            for t, completion in self._sample(engine, live, turn, params.n, turn_params):
                self._answer(t, completion, turn)
        for t in trajectories:
            if not t.done:
                t.finish_reason, t.done = "turns", True
            t.metrics = env_metrics(t.env, self.workflow)
        return trajectories

    def _sample(self, engine, live: list[Trajectory], turn: int, n: int, turn_params: SamplingParams):
        """One turn for every live trajectory, each limited by what is left of its token budget:
        ``(trajectory, completion)`` pairs."""
        by_room: dict[int, list[Trajectory]] = {}  # one engine call per token limit
        for t in live:
            room = min(turn_params.max_new_tokens, self.max_response_tokens - len(t.token_ids))
            by_room.setdefault(room, []).append(t)
        for room, group in sorted(by_room.items(), reverse=True):
            if room <= 0:
                for t in group:
                    t.finish_reason, t.done = "length", True
                continue
            call = SamplingParams(**{**turn_params.__dict__, "max_new_tokens": room})
            if turn == 0 and uniform_groups(group, n):  # each prompt once, n samples: as a single-turn rollout
                call.n = n
                completions = engine.generate([t.context for t in group[::n]], call)
            else:
                completions = engine.generate([t.context + t.token_ids for t in group], call)
            if len(completions) != len(group):
                raise RuntimeError(f"the engine returned {len(completions)} completions for {len(group)} trajectories")
            yield from zip(group, completions)

    def _answer(self, t: Trajectory, completion: Completion, turn: int) -> None:
        t.add_sampled(completion)
        t.turns += 1
        action = Action(
            token_ids=list(completion.token_ids),
            text=self.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            finish_reason=completion.finish_reason,
            turn=turn,
        )
        answer = t.env.step(action)
        try:
            observation, reward, done = answer
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"rollout.workflow {self.workflow!r}: step() must return (observation, reward, done): {exc}"
            ) from exc
        t.reward += float(reward)
        if done:
            t.finish_reason, t.done = "stop", True
            return
        if t.turns >= self.max_turns:
            return  # run() marks it: out of turns
        last = completion.token_ids[-1] if completion.token_ids else None
        tokens = self.fmt.wrap(self._tokens(observation), last)
        if len(t.token_ids) + len(tokens) >= self.max_response_tokens:  # no room left to sample after it
            t.finish_reason, t.done = "length", True
            return
        t.add_observed(tokens)


def env_metrics(env, workflow: str = "workflow") -> dict[str, float]:
    """An ended episode's numbers from the environment's optional ``metrics()``: ``{name: number}``."""
    read = getattr(env, "metrics", None)
    if not callable(read):
        return {}
    metrics = read()
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items()
    ):
        raise TypeError(f"rollout.workflow {workflow!r}: metrics() must return a dict of names to numbers, got {metrics!r}")
    return {k: float(v) for k, v in metrics.items()}


def mean_env_metrics(per_sample: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Each key's mean over the samples that report it, as ``prefix + key``."""
    keys = sorted({k for m in per_sample for k in m})
    return {prefix + k: sum(m[k] for m in per_sample if k in m) / sum(k in m for m in per_sample) for k in keys}


def uniform_groups(group: list[Trajectory], n: int) -> bool:
    """``group`` is whole groups of ``n`` trajectories of one prompt each with the same context."""
    if n == 1 or len(group) % n:
        return False
    return all(
        group[i].prompt_index == group[i + j].prompt_index and group[i].context == group[i + j].context
        for i in range(0, len(group), n) for j in range(n)
    )


def trajectories_to_completions(trajectories: list[Trajectory]) -> tuple[list[Completion], list[list[int]]]:
    """The trajectories as completions (all response tokens; log-prob 0 on observations) and their loss
    masks. A completion's weight version is its oldest token's (the staleness bound holds for every token)."""
    completions = [
        Completion(t.prompt_index, t.token_ids, t.logprobs, t.finish_reason,
                   min((v for v in t.weight_versions if v >= 0), default=0))
        for t in trajectories
    ]  # fmt: skip
    return completions, [t.loss_mask for t in trajectories]
