"""Qwen3-Omni talker (``Qwen3OmniMoeForConditionalGeneration``, ``model_stage="talker"``), tiny.

Model facts this case relies on (vllm_omni 0.30, ``model_executor/models/qwen3_omni/``):

- One class serves three stages; it reads ``vllm_config.model_config.model_stage``
  (qwen3_omni.py:177, default "thinker") and builds only that stage's module (talker :205-250).
  vllm-omni runs this stage with ``hf_config_name="talker_config"`` (pipeline.py, stage 1), so
  ``model_config.hf_text_config`` is the TALKER's text config (config/model.py:225-240
  ``draw_hf_text_config``): vLLM's persistent ``inputs_embeds`` and the runner's MTP buffers
  (gpu_model_runner.py:263-291, ``hf_text_config.hidden_size``) then have the talker's width. Here
  thinker width 192, talker width 128 on purpose.
- ``compute_logits`` suppresses the last 1024 ids of the talker vocab except ``codec_eos``
  (qwen3_omni.py:385-395, :1364-1371): the vocab must be > 1024; with 1088 the talker emits codes
  0..63 (= the code predictor vocab, as 0..2047 of 3072 in the released checkpoint) or eos.
- Talker hooks: ``preprocess = talker_preprocess`` (:764; prefill builds the talker prompt from the
  payload and slices it by ``meta.num_processed_tokens``, so chunked prefill works; decode returns
  ``mtp_inputs = (last_talker_hidden, text_step)``), ``postprocess = talker_postprocess`` (:758,
  ``hidden_states.last``), ``talker_mtp`` (:812; ignores generator kwargs: residual codes come
  from the code predictor's Gumbel sampling on the GLOBAL torch RNG,
  common/qwen3_code_predictor.py:843-865, stored mode top_k 50 / top_p 0.8 :673-674, so the code
  predictor vocab must be >= 50), ``make_omni_output`` (:594, ``{"codes": {"audio": ...}}``),
  ``gpu_resident_buffer_keys`` (:243). Decode reads ``model_config.async_chunk`` (:1140; missing
  attribute -> logged ``Error in decode`` and ``mtp_inputs=(None, None)``).
- Orchestrator inputs (what ``thinker2talker_full_payload`` builds,
  stage_input_processors/qwen3_omni.py:557-573): ``embed.prefill`` [P, H_thinker],
  ``hidden_states.output`` [P, H_thinker], ``ids.all`` / ``ids.prompt`` (thinker chatml ids; the
  ids are compared against the top-level config's ``im_start/user/assistant/system`` ids, kept at
  the released values because the orchestrator hard-codes them, :79-83), ``embed.tts_bos/eos/pad``
  [1, 1, H_thinker], optional ``speaker`` (a key of ``talker_config.speaker_id``: without a map the
  speaker id falls back to ``audio_start_token_id`` = 151669, outside the codec embedding,
  qwen3_omni.py:738-746). Prompt = ``[0] * (user segment + 9)`` (``thinker2talker_token_only``,
  :616-627).
- Prefill embeddings are built in bf16 (``_get_talker_user_parts`` :1199, ``_get_talker_assistant_parts``
  :1251), so the stage runs in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnigen_testing.real.case import RealRequest, RealStageCase

THINKER_HIDDEN = 192
THINKER_VOCAB = 256
TALKER_HIDDEN = 128
TALKER_VOCAB = 1088  # > 1024: the last 1024 ids are suppressed (codec_eos excepted)
CODE_VOCAB = 64  # code predictor vocab (>= 50: its stored-mode top_k)
NUM_CODE_GROUPS = 4
# Released Qwen3-Omni special ids (top-level config defaults; the orchestrator hard-codes them).
IM_START, IM_END, SYSTEM, USER, ASSISTANT = 151644, 151645, 8948, 872, 77091
NEWLINE = 198
MROPE = {
    "rope_type": "default",
    "rope_theta": 1000000.0,
    "mrope_section": [12, 10, 10],  # sums to head_dim / 2 (released: [24, 20, 20] for 128)
    "interleaved": True,
    "mrope_interleaved": True,
}


def hf_config(
    *,
    thinker_vocab: int = THINKER_VOCAB,
    talker_vocab: int = TALKER_VOCAB,
    code_vocab: int = CODE_VOCAB,
    code_groups: int = NUM_CODE_GROUPS,
    talker: dict | None = None,
    **top_level,
):
    """The tiny ``Qwen3OmniMoeConfig`` (also used by the thinker case and by
    ``testing/checkpoints/qwen3_omni.py``); ``top_level`` overrides top-level fields (the thinker case
    moves the tts_* token ids into its tiny vocab). The vocabularies and the code groups (the
    talker's and code predictor's ``num_code_groups``, code2wav's ``num_quantizers``; the code
    predictor's vocabulary is code2wav's codebook) default to this case's; the checkpoint writer
    keeps the released ones, which the glue and code2wav's forward read. ``talker`` updates
    ``talker_config``'s top-level fields (its special ids, speakers)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig

    cfg = Qwen3OmniMoeConfig(
        **top_level,
        thinker_config={
            "audio_config": {
                "num_mel_bins": 16,
                "encoder_layers": 1,
                "encoder_attention_heads": 1,
                "encoder_ffn_dim": 128,
                "d_model": 64,
                "output_dim": THINKER_HIDDEN,
                "downsample_hidden_size": 16,
                "max_source_positions": 64,
                "n_window": 8,
                "n_window_infer": 16,
                "conv_chunksize": 8,
            },
            "vision_config": {
                "depth": 1,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 1,
                "out_hidden_size": THINKER_HIDDEN,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
                "patch_size": 4,
                "temporal_patch_size": 2,
                "spatial_merge_size": 2,
                # Not transformers fields; vLLM's vision tower reads them
                # (vllm/model_executor/models/qwen3_omni_moe_thinker.py:763, :769).
                "image_size": 32,
                "apply_vit_abs_pos_embed": True,
            },
            "text_config": {
                "vocab_size": thinker_vocab,
                "hidden_size": THINKER_HIDDEN,
                "intermediate_size": 256,
                # Two layers: the thinker captures layer 0 and accept_hidden_layer for the talker.
                "num_hidden_layers": 2,
                "num_attention_heads": 3,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "moe_intermediate_size": 64,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "max_position_embeddings": 512,
                "rope_parameters": dict(MROPE),
            },
        },
        talker_config={
            "text_config": {
                "vocab_size": talker_vocab,
                "hidden_size": TALKER_HIDDEN,
                "intermediate_size": 256,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "moe_intermediate_size": 64,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "shared_expert_intermediate_size": 128,
                "max_position_embeddings": 512,
                "rope_parameters": dict(MROPE),
            },
            "code_predictor_config": {
                "vocab_size": code_vocab,
                "hidden_size": TALKER_HIDDEN,
                "intermediate_size": 256,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "num_code_groups": code_groups,
                "max_position_embeddings": 64,
            },
            "num_code_groups": code_groups,
            "thinker_hidden_size": THINKER_HIDDEN,
            "accept_hidden_layer": 1,
            # Codec specials inside the suppressed tail, as in the released checkpoint.
            "codec_pad_id": 1060,
            "codec_bos_id": 1061,
            "codec_eos_token_id": 1062,
            "codec_nothink_id": 1063,
            "codec_think_bos_id": 1064,
            "codec_think_eos_id": 1065,
            "speaker_id": {"ethan": 1070, "chelsie": 1071},
            **(talker or {}),
        },
        code2wav_config={
            "codebook_size": code_vocab,
            "hidden_size": 64,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_quantizers": code_groups,
            "upsample_rates": [2, 2],
            "upsampling_ratios": [2],
            "decoder_dim": 64,
            "sliding_window": 8,
            "max_position_embeddings": 256,
        },
    )
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return cfg


def write_checkpoint(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_config().save_pretrained(str(path))
    return path


def _chatml(gen: torch.Generator, n_user: int, n_reply: int) -> tuple[list[int], list[int]]:
    """(ids.prompt, ids.all): one user turn, then the assistant reply the thinker produced."""
    user = torch.randint(1000, 2000, (n_user,), generator=gen).tolist()
    reply = torch.randint(1000, 2000, (n_reply,), generator=gen).tolist()
    prompt = [IM_START, USER, NEWLINE, *user, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
    return prompt, [*prompt, *reply, IM_END]


def _payload(gen: torch.Generator, n_user: int, n_reply: int, speaker: str | None) -> tuple[dict, int]:
    prompt_ids, all_ids = _chatml(gen, n_user, n_reply)
    rows = len(all_ids) - 1  # the producer drops the terminal row
    payload = {
        "embed": {
            "prefill": torch.randn(rows, THINKER_HIDDEN, generator=gen),
            "tts_bos": torch.randn(1, 1, THINKER_HIDDEN, generator=gen),
            "tts_eos": torch.randn(1, 1, THINKER_HIDDEN, generator=gen),
            "tts_pad": torch.randn(1, 1, THINKER_HIDDEN, generator=gen),
        },
        "hidden_states": {"output": torch.randn(rows, THINKER_HIDDEN, generator=gen)},
        "ids": {"all": all_ids, "prompt": prompt_ids},
    }
    if speaker is not None:
        payload["speaker"] = speaker
    # _compute_talker_prompt_ids_length: the user segment (im_start .. next im_start) + 9.
    user_segment = prompt_ids.index(IM_START, 1)
    return payload, user_segment + 9


def requests() -> list[RealRequest]:
    gen = torch.Generator().manual_seed(4321)
    out = []
    for rid, (n_user, n_reply, speaker, max_tokens) in {
        "long": (6, 7, "chelsie", 6),  # prompt 11 + 9 = 20: chunked 8 + 8 + 4
        "short": (1, 2, None, 5),  # 2-row reply: trailing text is just tts_eos
        "mid": (3, 4, "ethan", 6),
    }.items():
        payload, prompt_len = _payload(gen, n_user, n_reply, speaker)
        out.append(RealRequest(rid, [0] * prompt_len, max_tokens=max_tokens, payload=payload))
    return out


# The stage wrapper builds its stage module through vLLM's registry
# (``init_vllm_registered_model(architectures=[...])``, qwen3_omni.py:191, :228, :260): these
# architectures must be registered too, or vLLM falls back to its Transformers backend
# (``ValueError: Unrecognized configuration class ... Qwen3OmniMoeTalkerConfig``). The harness
# registers every sibling arch of the class's folder itself (``_register_sibling_archs``); this
# map states the one the stage needs, for drivers that do not.
EXTRA_ARCHS = {
    "Qwen3OmniMoeTalkerForConditionalGeneration": (
        "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_moe_talker.Qwen3OmniMoeTalkerForConditionalGeneration"
    ),
}

EXPECT = {
    # One row of NUM_CODE_GROUPS MTP codes in the buffer at every decode step.
    "decode_codes": NUM_CODE_GROUPS,
    # make_omni_output merges the codes for code2wav every step.
    "payload_keys": ["codes.audio"],
    "differ": ["long", "mid"],
}


CASE = RealStageCase(
    name="qwen3_omni_talker",
    omnigen_model="qwen3_omni",
    omnigen_stage="talker",
    arch="Qwen3OmniMoeForConditionalGeneration",
    model_class="vllm_omni.model_executor.models.qwen3_omni.qwen3_omni.Qwen3OmniMoeForConditionalGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    engine_kwargs={
        "dtype": "bfloat16",
        # The rest is the harness's ENGINE_DEFAULTS (chunked prefill, 8-token steps, 4 seqs).
        # The class is registered as multimodal (qwen3_omni.py:91): without this vLLM's renderer
        # builds Qwen3OmniMoeThinkerMultiModalProcessor, which needs a tokenizer. The talker
        # stage takes no multimodal inputs (it sets skip_mm_profiling itself, :209).
        "language_model_only": True,
    },
    omni_model_config={
        # vllm_omni/model_executor/models/qwen3_omni/pipeline.py, stage 1. hf_config_name:
        # hf_text_config (and max_model_len, model_arch_config) come from
        # hf_config.talker_config.get_text_config() (OmniModelConfig._maybe_override_text_config).
        "stage_id": 1,
        "model_stage": "talker",
        "model_arch": "Qwen3OmniMoeForConditionalGeneration",
        "worker_type": "ar",
        "engine_output_type": "latent",
        # As conf/model/qwen3_omni.yaml ships it (and omnigen's worker installs it): async chunks
        # off, the full-payload form (decode reads the trailing text from the buffer, :1140).
        "async_chunk": False,
        "hf_config_name": "talker_config",
        # Left out on purpose: requires_full_payload_input=True and
        # custom_process_next_stage_input_func (talker2code2wav_full_payload) make the runner
        # build vllm-omni's connector (needs_omni_connector); the payload arrives on the new
        # request's model_intermediate_buffer instead, and nothing is sent on.
        "requires_full_payload_input": False,
        "custom_process_next_stage_input_func": None,
    },
)
