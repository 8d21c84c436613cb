"""Qwen3-TTS talker (``Qwen3TTSTalkerForConditionalGeneration``), VoiceDesign requests.

The talker builds its prefill embeddings itself from the request's payload (text conditioning,
language, optional instruct) through its prompt builder; the prompt is placeholder ids of the
length ``estimate_prompt_len_from_additional_information`` computes (the real estimator is
called here). From the first decode step its code predictor (``talker_mtp``) writes one row of
``num_code_groups`` codes per step into ``codes.audio``; the next step's MTP input needs
``hidden_states.last`` from ``postprocess``. The non-streaming request consumes its text at
prefill; the streaming one feeds it from ``hidden_states.trailing_text`` one row per decode step.

Tiny checkpoint, shaped like the released one: M-RoPE (interleaved, ``mrope_section`` scaled to
head_dim 64), bf16 (the embeddings are hard-coded bf16, ``_embedding_dtype``), plus what the
class builds at init: ``speech_tokenizer/config.json`` (Mimi encoder + codec decoder config),
``speech_tokenizer/preprocessor_config.json`` (feature extractor) and an offline WordLevel
tokenizer at the model path. ``write_speech_checkpoint`` is shared with the code2wav case.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from omnigen_testing.real.case import RealRequest, RealStageCase

ARCH = "Qwen3TTSTalkerForConditionalGeneration"
CODE2WAV_ARCH = "Qwen3TTSCode2Wav"

NUM_CODE_GROUPS = 4
CODEBOOK = 128  # code predictor vocab = codec decoder codebook
TALKER_VOCAB = 160  # codebook ids + the codec specials below
CODEC = {
    "codec_pad_id": 148,
    "codec_bos_id": 149,
    "codec_eos_token_id": 150,
    "codec_think_id": 151,
    "codec_nothink_id": 152,
    "codec_think_bos_id": 153,
    "codec_think_eos_id": 154,
}
LANGUAGES = {"english": 155, "chinese": 156}

WORDS = [
    "<|im_start|>",
    "<|im_end|>",
    "[UNK]",
    "\n",
    "assistant",
    "user",
    *"hello world a calm voice quick brown fox jumps over the lazy dog bright slow speaker low deep".split(),
]
TEXT_VOCAB = 96
TTS_PAD, TTS_BOS, TTS_EOS = 93, 94, 95
DECODER_UPSAMPLE = {"upsample_rates": [2, 2], "upsampling_ratios": [2, 2]}  # 16 samples per frame


@cache
def _tokenizer() -> Any:
    """An offline WordLevel tokenizer (newline is a token, so the chat-template slices line up)."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in WORDS[:2]])
    return tok


def tokenize(text: str) -> list[int]:
    return list(_tokenizer().encode(text).ids)


def qwen3_tts_config(arch: str) -> dict[str, Any]:
    return {
        "architectures": [arch],
        "model_type": "qwen3_tts",
        "torch_dtype": "bfloat16",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "tts_model_type": "voice_design",
        "im_start_token_id": 0,
        "im_end_token_id": 1,
        "tts_pad_token_id": TTS_PAD,
        "tts_bos_token_id": TTS_BOS,
        "tts_eos_token_id": TTS_EOS,
        "talker_config": {
            "vocab_size": TALKER_VOCAB,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "hidden_act": "silu",
            "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            # As the released checkpoints (mrope_section [24, 20, 20] for head_dim 128).
            "rope_scaling": {
                "interleaved": True,
                "mrope_section": [12, 10, 10],
                "rope_type": "default",
                "type": "default",
            },
            "position_id_per_seconds": 13,
            "num_code_groups": NUM_CODE_GROUPS,
            "text_hidden_size": 64,
            "text_vocab_size": TEXT_VOCAB,
            **CODEC,
            "codec_language_id": LANGUAGES,
            "spk_id": {"alice": 157},
            "spk_is_dialect": {"alice": False},
            "code_predictor_config": {
                "vocab_size": CODEBOOK,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 1,
                "num_attention_heads": 1,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "max_position_embeddings": 64,
                "rope_theta": 1000000,
                "num_code_groups": NUM_CODE_GROUPS,
            },
        },
        "speaker_encoder_config": {
            "mel_dim": 16,
            "enc_dim": 128,
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_kernel_sizes": [5, 3, 3, 3, 1],
            "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 16,
            "enc_res2net_scale": 4,
            "enc_se_channels": 16,
            "sample_rate": 24000,
        },
    }


def speech_tokenizer_config() -> dict[str, Any]:
    return {
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": NUM_CODE_GROUPS,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 16,
        "encode_downsample_rate": 16,
        "encoder_config": {
            "model_type": "mimi",
            "sampling_rate": 24000,
            "frame_rate": 12.5,
            "audio_channels": 1,
            "hidden_size": 32,
            "num_filters": 4,
            "num_residual_layers": 1,
            "upsampling_ratios": [4, 4],
            "upsample_groups": 32,
            "kernel_size": 3,
            "last_kernel_size": 3,
            "residual_kernel_size": 3,
            "dilation_growth_rate": 2,
            "compress": 2,
            "codebook_size": 16,
            "codebook_dim": 16,
            "num_quantizers": NUM_CODE_GROUPS,
            "num_semantic_quantizers": 1,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "intermediate_size": 64,
            "sliding_window": 16,
            "max_position_embeddings": 256,
        },
        "decoder_config": {
            "codebook_size": CODEBOOK,
            "codebook_dim": 32,
            "hidden_size": 64,
            "latent_dim": 32,
            "max_position_embeddings": 512,
            "rope_theta": 10000,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "sliding_window": 8,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_quantizers": NUM_CODE_GROUPS,
            "decoder_dim": 32,
            **DECODER_UPSAMPLE,
        },
    }


def write_speech_checkpoint(folder: Path, arch: str) -> Path:
    """config.json, speech_tokenizer/{config,preprocessor_config}.json and the tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(qwen3_tts_config(arch), indent=2))
    speech = folder / "speech_tokenizer"
    speech.mkdir(exist_ok=True)
    (speech / "config.json").write_text(json.dumps(speech_tokenizer_config(), indent=2))
    (speech / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_extractor_type": "EncodecFeatureExtractor",
                "feature_size": 1,
                "sampling_rate": 24000,
                "padding_side": "right",
                "padding_value": 0.0,
                "return_attention_mask": True,
                "chunk_length_s": None,
                "overlap": None,
            },
            indent=2,
        )
    )
    _tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "unk_token": "[UNK]"}
        )
    )
    return folder


def prompt_len(payload: dict[str, Any]) -> int:
    """vllm-omni's own estimator (prompt_embeds_builder.py:1508), with this tokenizer."""
    from vllm_omni.model_executor.models.qwen3_tts.prompt_embeds_builder import Qwen3TTSPromptEmbedsBuilder

    return Qwen3TTSPromptEmbedsBuilder.estimate_prompt_len_from_additional_information(
        payload,
        task_type=payload["task_type"][0],
        tokenize_prompt=tokenize,
        codec_language_id=LANGUAGES,
        spk_is_dialect={"alice": False},
    )


def _request(rid: str, max_tokens: int, seed: int | None, **payload: Any) -> RealRequest:
    payload = {"task_type": ["VoiceDesign"], **{k: [v] for k, v in payload.items()}}
    n = prompt_len(payload)
    # Placeholder ids (vllm-omni 0.30's adapter sends [1] * n); the talker replaces them.
    return RealRequest(rid, [CODEC["codec_pad_id"]] * n, max_tokens=max_tokens, payload=payload, seed=seed)


EXPECT = {
    # One row of NUM_CODE_GROUPS codes in every request's buffer at every decode step.
    "decode_codes": NUM_CODE_GROUPS,
    # Published by make_omni_output every step.
    "payload_keys": ["codes.audio"],
    # Same payload, different tts_local_seed: their codes must differ (the seed reaches the MTP).
    "differ": ["tts-a", "tts-d"],
}


def requests() -> list[RealRequest]:
    voice_design = {
        "text": "the quick brown fox jumps",
        "language": "English",
        "instruct": "a calm voice",
        "non_streaming_mode": True,
    }
    return [
        # Non-streaming, English, with an instruct: prompt 8 (instruct) + 3 (role) + 5 (codec
        # prefix) + 7 (text) = 23, chunked over three steps at max_num_batched_tokens=8.
        _request("tts-a", 6, seed=7, **voice_design),
        # Streaming (text fed from hidden_states.trailing_text each decode step): prompt 8.
        _request("tts-b", 6, seed=8, text="hello world the lazy dog over", non_streaming_mode=False),
        # Non-streaming, Auto language, unseeded MTP (the global torch RNG, reset per case).
        _request("tts-c", 5, seed=None, text="bright slow voice", non_streaming_mode=True),
        _request("tts-d", 4, seed=11, **voice_design),
    ]


def write_checkpoint(folder: Path) -> Path:
    return write_speech_checkpoint(folder, ARCH)


CASE = RealStageCase(
    name="qwen3_tts_talker",
    omnigen_model="qwen3_tts",
    omnigen_stage="qwen3_tts",
    arch=ARCH,
    model_class="vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker.Qwen3TTSTalkerForConditionalGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    # The talker's embeddings are hard-coded bf16 (_embedding_dtype): float32 fails in index_copy_.
    engine_kwargs={"dtype": "bfloat16"},
    # vllm-omni's pipeline for the talker (qwen3_tts/pipeline.py): stage 0, "latent" output,
    # model_stage "qwen3_tts". async_chunk as omnigen's conf/model/qwen3_tts.yaml builds it (the
    # full-payload form its driver runs; vllm-omni's deployment ships it on), so both sides run
    # the same mode.
    omni_model_config={
        "stage_id": 0,
        "model_stage": "qwen3_tts",
        "model_arch": ARCH,
        "worker_type": "ar",
        "engine_output_type": "latent",
        "async_chunk": False,
    },
)
