"""``OmniRunnerV2``: what a generated V2 runner adds to vLLM's Model Runner V2.

Only what no model-state hook sees (docs/model-runner-v2.md, sections 2 and 3): building the
stage's model state, releasing finished requests (V2's ``remove_request`` hook cannot tell a
finished request from a preempted or re-admitted one), cached requests' payloads, the close of
the model's decode step around the forward, and the step's payloads after sampling. Every
override calls ``super()``; none copies a V2 method body.
"""

from __future__ import annotations

from typing import Any, ClassVar

from omnigen.runtime import vllm_api, vllm_api_v2


class OmniRunnerV2:
    """Mixin placed before vLLM's V2 ``GPUModelRunner`` in each generated V2 runner."""

    MODEL_STATE: ClassVar[type]
    """The stage's generated model state (an ``OmniModelStateV2``)."""

    def __init__(self, vllm_config: Any, device: Any) -> None:
        super().__init__(vllm_config, device)  # type: ignore[call-arg]
        if self.MODEL_STATE.USES_INPUTS_EMBEDS:
            # preprocess.hook: V2 calls the state's prepare_inputs_embeds on every real step (its
            # rows' hooks run there) and dummy_inputs_embeds in dummy runs.
            self.uses_inputs_embeds = True

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's model loading, with the stage's model state built where V2 builds its own."""
        with vllm_api_v2.building_model_state(self.MODEL_STATE):
            super().load_model(*args, **kwargs)  # type: ignore[misc]
        state = self.model_state  # type: ignore[attr-defined]
        if not isinstance(state, self.MODEL_STATE):
            raise RuntimeError(
                f"{type(self).__name__}: vLLM built a {type(state).__name__} as the model state, not the "
                f"stage's {self.MODEL_STATE.__name__} (vllm.v1.worker.gpu.model_runner.init_model_state moved?)"
            )

    def finish_requests(self, scheduler_output: Any) -> None:
        """vLLM's release of finished and preempted requests, then omnigen's release of the
        finished ones' buffers, generators, payloads and records (6). A preempted request keeps
        them, as on V1."""
        super().finish_requests(scheduler_output)  # type: ignore[misc]
        finished = scheduler_output.finished_req_ids
        preempted = getattr(scheduler_output, "preempted_req_ids", None)
        if preempted:
            self.model_state._note_preempted(preempted, finished)  # type: ignore[attr-defined]
        if finished:
            self.model_state._release_finished_requests(finished)  # type: ignore[attr-defined]
            self._on_requests_finished(finished)

    def _on_requests_finished(self, finished_req_ids: Any) -> None:
        """The model's own per-request state of finished requests (generated where it has one)."""

    def update_requests(self, scheduler_output: Any) -> None:
        """vLLM's update of cached requests, then the payloads the scheduler sends them (4.2)."""
        super().update_requests(scheduler_output)  # type: ignore[misc]
        self.model_state._merge_cached_payloads(scheduler_output)  # type: ignore[attr-defined]

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        try:
            return super().execute_model(scheduler_output, intermediate_tensors, *args, **kwargs)  # type: ignore[misc]
        finally:
            # 1.2: the model's decode step ends however the forward ended, a full graph replay
            # (no Python ran in it) included.
            self.model_state._omni_close_decode_step()  # type: ignore[attr-defined]

    def sample_tokens(self, grammar_output: Any = None) -> Any:
        """vLLM's sampling, then what this stage does with the step's outputs (7.1, 7.2, 5.1, 8.1)."""
        state = self.model_state  # type: ignore[attr-defined]
        step = state._omni_take_step(self.execute_model_state)  # type: ignore[attr-defined]
        output = super().sample_tokens(grammar_output)  # type: ignore[misc]
        if step is None:
            return output
        state._finish_step(step)
        return vllm_api.attach_step_payloads(output, state.published_step_payloads())

    def _generation_sample_tokens(self, grammar_output: Any) -> Any:
        """A generation step samples nothing (7.3): vLLM's step bookkeeping without its sampler
        (what V2's own ``pool`` does: the computed tokens advance, the KV connector finishes),
        each request's output published, and a request whose prompt is in finishes."""
        state = self.model_state  # type: ignore[attr-defined]
        executed = self.execute_model_state  # type: ignore[attr-defined]
        step = state._omni_take_step(executed)
        if step is None or executed is None:
            return super().sample_tokens(grammar_output)  # type: ignore[misc]
        self.execute_model_state = None
        self.postprocess_num_computed_tokens(executed.input_batch)  # type: ignore[attr-defined]
        kv_connector_output = self.kv_connector.post_forward(executed.finished_req_ids)  # type: ignore[attr-defined]
        state._finish_generation_step(step)
        return vllm_api_v2.generation_step_output(self, executed.input_batch, kv_connector_output)
