"""A step's preprocessing (the generated ``_preprocess_rows``) holds the garbage collector off
until the step ends, and puts it back as it found it, when a hook raises too: the step keeps what
its rows make alive to its end, so collections inside it would scan all of it for nothing."""

from __future__ import annotations

import gc

import pytest

from omnigen_testing.contract_support import HOOK_VARIANTS, Step, ids, rig, rows_of

KINDS = ["decode", "prefill", "decode", "decode"]


def watching(model_class: type, seen: list[bool], raises: bool) -> type:
    """``model_class`` whose hooks note whether the collector is on, and raise if asked."""

    class Watching(model_class):
        def preprocess(self, *args, **kwargs):
            seen.append(gc.isenabled())
            if raises:
                raise RuntimeError("hook failed")
            return super().preprocess(*args, **kwargs)

        def preprocess_decode_batch(self, *args, **kwargs):
            seen.append(gc.isenabled())
            if raises:
                raise RuntimeError("hook failed")
            return super().preprocess_decode_batch(*args, **kwargs)

    return Watching


@pytest.mark.parametrize("variant", HOOK_VARIANTS, ids=ids(HOOK_VARIANTS))
@pytest.mark.parametrize("raises", [False, True], ids=["step", "failed step"])
@pytest.mark.parametrize("enabled", [True, False], ids=["collector on", "collector off"])
def test_collector_is_held_off_in_the_hooks_and_left_as_found(variant, recorder, ctx, graph, enabled, raises):
    graph.for_policy(variant.caps["mtp_graph"] or "unsafe")
    step = Step(rows_of(KINDS))
    r = rig(variant, step, recorder, ctx)
    seen: list[bool] = []
    r.runner.model.__class__ = watching(type(r.runner.model), seen, raises)
    if enabled:
        gc.enable()
    else:
        gc.disable()
    try:
        if raises:
            with pytest.raises(RuntimeError, match="hook failed"):
                r.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
        else:
            r.runner._preprocess_rows(step.sched, step.ids(), step.embeds())
        after = gc.isenabled()
    finally:
        gc.enable()
    assert seen, "the step called a hook"
    assert not any(seen), "no hook ran with the collector on"
    assert after is enabled, "the collector as the step found it"
