"""Qwen3-Omni thinker (``Qwen3OmniMoeForConditionalGeneration``, ``model_stage="thinker"``), tiny,
TEXT-ONLY.

Model facts this case relies on (vllm_omni 0.30, ``model_executor/models/qwen3_omni/``):

- With ``model_stage`` set (a staged run, qwen3_omni.py:181) the thinker captures layer 0 and
  ``talker_config.accept_hidden_layer`` (:288-290) and its forward returns
  ``(text_hidden, {"hidden_states": {"layers": {0: ..., k: ...}}})``
  (qwen3_omni_moe_thinker.py:552-619, :1383); ``make_omni_output`` (qwen3_omni.py:564-593) turns
  that into an ``OmniOutput`` whose multimodal payload also carries ``embed.tts_bos/eos/pad``
  (the thinker embeddings of the top-level ``tts_*_token_id``, :200-204, :574-584; an id outside
  the thinker vocab is swallowed by its ``try``, so here those ids sit inside the tiny vocab).
  That payload is what ``thinker2talker_full_payload`` turns into the talker's inputs. A runner
  that hands the tuple to vLLM's sampler path crashes; one that does not call
  ``make_omni_output`` publishes no ``embed.tts_*``.
- ``get_mrope_input_positions`` for the thinker needs ``mm_features`` (not None; empty for text,
  qwen3_omni.py:397-407); the thinker uses interleaved M-RoPE.
- Not covered on CPU: multimodal inputs. vLLM's renderer builds
  ``Qwen3OmniMoeThinkerMultiModalProcessor`` for this class (registered at qwen3_omni.py:91),
  which needs a tokenizer (``ValueError: Qwen3OmniMoeThinkerMultiModalProcessor requires a
  tokenizer and cannot be initialized when skip_tokenizer_init=True``,
  vllm/multimodal/processing/processor.py:1049) and transformers' ``Qwen3OmniMoeProcessor``
  (image/video processors need torchvision, not installable in the CPU lock). The case runs
  ``language_model_only=True``: vLLM skips the audio and vision towers
  (``_mark_tower_model``, qwen3_omni_moe_thinker.py:1120, :1134) and the MM processor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnigen_testing.real.case import RealRequest, RealStageCase
from omnigen_testing.real.cases.qwen3_omni_talker import EXTRA_ARCHS as _TALKER_ARCHS
from omnigen_testing.real.cases.qwen3_omni_talker import THINKER_VOCAB, hf_config

# Tiny-vocab stand-ins for the released chatml / tts ids (151644, 872, 77091, 151671-151673).
IM_START, IM_END, USER, ASSISTANT, NEWLINE = 240, 241, 242, 243, 244
TTS_PAD, TTS_BOS, TTS_EOS = 250, 251, 252
TOP_LEVEL = {
    "im_start_token_id": IM_START,
    "im_end_token_id": IM_END,
    "user_token_id": USER,
    "assistant_token_id": ASSISTANT,
    "system_token_id": 245,
    "tts_pad_token_id": TTS_PAD,
    "tts_bos_token_id": TTS_BOS,
    "tts_eos_token_id": TTS_EOS,
}


def write_checkpoint(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config(**TOP_LEVEL).save_pretrained(str(path))
    return path


def requests() -> list[RealRequest]:
    gen = torch.Generator().manual_seed(99)

    def chat(n: int) -> list[int]:
        user = torch.randint(1, 200, (n,), generator=gen).tolist()
        return [IM_START, USER, NEWLINE, *user, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]

    return [
        RealRequest("long", chat(6), max_tokens=5),  # 14 tokens: chunked 8 + 6
        RealRequest("short", chat(1), max_tokens=4),
        RealRequest("mid", chat(3), max_tokens=5),
    ]


# Same wrapper; its thinker module is built through vLLM's registry (qwen3_omni.py:191).
EXTRA_ARCHS = {
    **_TALKER_ARCHS,
    "Qwen3OmniMoeThinkerForConditionalGeneration": (
        "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_thinker.Qwen3OmniMoeThinkerForConditionalGeneration"
    ),
}

assert THINKER_VOCAB > max(TOP_LEVEL.values())

EXPECT = {
    # What thinker2talker_full_payload reads: the thinker's hidden rows, the captured layers and
    # the TTS special-token embeddings (make_omni_output, qwen3_omni.py:564-592).
    "payload_keys": ["hidden", "hidden_states.layer_0", "embed.tts_bos", "embed.tts_eos", "embed.tts_pad"],
    "differ": ["long", "short"],
}


CASE = RealStageCase(
    name="qwen3_omni_thinker",
    omnigen_model="qwen3_omni",
    omnigen_stage="thinker",
    arch="Qwen3OmniMoeForConditionalGeneration",
    model_class="vllm_omni.model_executor.models.qwen3_omni.qwen3_omni.Qwen3OmniMoeForConditionalGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    engine_kwargs={
        "dtype": "bfloat16",
        # The rest is the harness's ENGINE_DEFAULTS (chunked prefill, 8-token steps, 4 seqs).
        "language_model_only": True,
    },
    omni_model_config={
        # vllm_omni/model_executor/models/qwen3_omni/pipeline.py, stage 0.
        "stage_id": 0,
        "model_stage": "thinker",
        "model_arch": "Qwen3OmniMoeForConditionalGeneration",
        "worker_type": "ar",
        "engine_output_type": "latent",
        "final_output": True,
        # As conf/model/qwen3_omni.yaml ships it (and omnigen's worker installs it): async chunks
        # off, the full-payload form.
        "async_chunk": False,
        "hf_config_name": "thinker_config",
        # Left out: custom_process_next_stage_input_func (thinker2talker_full_payload) makes the
        # runner build vllm-omni's connector; the step payloads are read off the runner output.
        "custom_process_next_stage_input_func": None,
    },
)
