"""A request checked against the whole pipeline before its first stage runs.

Every stage's limits come from its started engine: the vocabulary, the context
(``max_model_len``) and, where the engine cannot split a prompt over steps (a stage without a KV
cache runs without chunked prefill), the step's token budget. A request's first prompt is checked
against the first stage; what each later stage will receive is bounded by the glue function of
the edge before it (``omnigen.glue.types.bounds_next_prompt``) from the producer's token budget,
so a request whose codes would not fit the vocoder is refused before the talker runs. A refusal
is a ``RequestError`` naming the field and the allowed range.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omnigen.glue.types import min_producer_tokens, next_prompt_bound, reads_producer_prompt
from omnigen.requests.base import BuiltRequest, RequestError

log = logging.getLogger("omnigen.serving")


@dataclass(frozen=True)
class StageLimits:
    stage: str
    generation: bool
    vocab_size: int | None
    max_model_len: int
    max_prompt_tokens: int
    """The longest prompt the stage takes: its context less one sampled token, and no more than
    a step's tokens where its prompts are not chunked."""
    prompt_bound: Any = None
    """The glue bound of the edge into this stage (None: the first stage, or a glue without one)."""
    min_producer_tokens: int = 1
    """The fewest tokens the previous stage must sample for this stage's prompt not to be empty."""
    bound_reads_producer_prompt: bool = False
    """The bound also takes the previous stage's prompt ids (None where they are not known)."""


def stage_limits(stages: list[Any], kv_cache_groups: list[int | None]) -> list[StageLimits]:
    """Each started stage's limits (``kv_cache_groups``: what each engine's runner allocated)."""
    found = []
    for index, (runtime, groups) in enumerate(zip(stages, kv_cache_groups, strict=True)):
        vllm_config = _vllm_config(runtime.engine)
        model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
        longest = int(model_config.max_model_len) - 1
        if not scheduler.enable_chunked_prefill or groups == 0:
            # vLLM's engine core turns chunked prefill off for a model without a KV cache.
            longest = min(longest, int(scheduler.max_num_batched_tokens))
        previous = stages[index - 1] if index else None
        found.append(
            StageLimits(
                stage=runtime.plan.stage,
                generation=runtime.plan.is_generation,
                vocab_size=_vocab_size(model_config),
                max_model_len=int(model_config.max_model_len),
                max_prompt_tokens=longest,
                prompt_bound=next_prompt_bound(previous.glue) if previous is not None else None,
                min_producer_tokens=min_producer_tokens(previous.glue) if previous is not None else 1,
                bound_reads_producer_prompt=previous is not None and reads_producer_prompt(previous.glue),
            )
        )
    for earlier, limits in zip(stages, found[1:], strict=False):
        if limits.prompt_bound is None:
            log.warning(
                "%s -> %s: the glue %s declares no prompt bound; requests are not checked against "
                "%s's context before they start",
                earlier.plan.stage,
                limits.stage,
                earlier.glue_name,
                limits.stage,
            )
    return found


def check_request(
    limits: list[StageLimits],
    stages: list[Any],
    built: BuiltRequest,
    sampling: Mapping[str, Any],
    *,
    prompt_field: str = "input",
) -> None:
    """Refuse ``built`` (with ``sampling``, stage -> SamplingParams) if any stage could not take it;
    ``prompt_field``: the request field a too-long prompt is blamed on (``messages`` for a chat)."""
    first = limits[0]
    ids = built.prompt.get("prompt_token_ids")
    if ids is not None:
        if not ids:
            raise RequestError("prompt_token_ids", f"empty; stage {first.stage!r} needs at least one token")
        _check_ids(ids, first)
        if len(ids) > first.max_prompt_tokens:
            raise RequestError(
                prompt_field,
                f"the prompt is {len(ids)} tokens; stage {first.stage!r} takes at most {first.max_prompt_tokens}",
            )
    prompt_len = len(ids) if ids is not None else None
    for index, (stage, runtime) in enumerate(zip(limits[:-1], stages[:-1], strict=True)):
        following = limits[index + 1]
        if following.prompt_bound is None:
            return  # beyond here nothing is known before the stage runs (logged at start)
        params = sampling.get(stage.stage)
        asked = 1 if stage.generation or params is None else int(params.max_tokens)
        budget = asked
        if prompt_len is not None and not stage.generation:
            budget = min(budget, stage.max_model_len - prompt_len)  # vLLM stops at the context
        if budget < following.min_producer_tokens:
            least = following.min_producer_tokens
            if asked < least:
                raise RequestError(
                    "max_tokens",
                    f"stage {stage.stage!r} needs at least {least} tokens to give stage "
                    f"{following.stage!r} any input; send max_tokens of at least {least}",
                )
            raise RequestError(
                prompt_field,
                f"the prompt leaves stage {stage.stage!r} room for {budget} of the {least} tokens "
                f"stage {following.stage!r} needs; shorten it to at most {stage.max_model_len - least} tokens",
            )

        def longest(
            tokens: int,
            bound: Any = following.prompt_bound,
            hf_config: Any = runtime.hf_config,
            reads_prompt: bool = following.bound_reads_producer_prompt,
            producer_prompt: Any = ids if index == 0 else None,
        ) -> int | None:
            if reads_prompt:
                found = bound(tokens, built.payload, hf_config, producer_prompt)
                return None if found is None else int(found)
            return int(bound(tokens, built.payload, hf_config))

        if longest(budget) is None:
            return  # the bound needs the producer's prompt ids, which are not known here
        shortest = longest(following.min_producer_tokens)
        if shortest is not None and shortest > following.max_prompt_tokens:
            raise RequestError(
                prompt_field,
                f"the request becomes at least {shortest} prompt tokens of stage {following.stage!r}, "
                f"which takes at most {following.max_prompt_tokens} whatever max_tokens says; shorten it",
            )
        if longest(budget) > following.max_prompt_tokens:
            fits = _largest_budget(longest, budget, following.max_prompt_tokens)
            raise RequestError(
                "max_tokens",
                f"stage {stage.stage!r} may write {budget} tokens, which become up to "
                f"{longest(budget)} prompt tokens of stage {following.stage!r}, which takes at most "
                f"{following.max_prompt_tokens}; send max_tokens of at most {fits}",
            )
        prompt_len = longest(budget)


def _check_ids(ids: Any, stage: StageLimits) -> None:
    top = stage.vocab_size
    for position, token in enumerate(ids):
        if (
            isinstance(token, bool)
            or not isinstance(token, int)
            or token < 0
            or (top is not None and token >= top)
        ):
            allowed = f"0..{top - 1}" if top is not None else "non-negative integers"
            raise RequestError(
                f"prompt_token_ids[{position}]",
                f"{token!r} is not a token id of stage {stage.stage!r} (allowed: {allowed})",
            )


def _largest_budget(longest: Any, budget: int, room: int) -> int:
    low, high = 0, budget  # longest(low) fits or low == 0; longest(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        if longest(middle) <= room:
            low = middle
        else:
            high = middle
    return low


def _vllm_config(engine: Any) -> Any:
    return getattr(engine, "vllm_config", None) or engine.llm_engine.vllm_config


def _vocab_size(model_config: Any) -> int | None:
    try:
        return int(model_config.get_vocab_size())
    except Exception:  # a config without a flat vocabulary (a codec decoder's)
        return None
