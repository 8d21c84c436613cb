"""Fish Speech S2 Pro slow AR (``FishSpeechSlowARForConditionalGeneration`` + its Fast AR).

Plain TTS needs no payload: the prompt is the tokenized text, so the requests are plain text ids
(below the semantic range). The Slow AR samples semantic tokens only (``compute_logits`` masks
everything else; ``<|im_end|>`` = 151645 lies outside this tiny vocabulary), and from the first
decode step the Fast AR (``talker_mtp``) writes one row of ``num_codebooks`` codes per step into
``codes.audio``, fed by ``hidden_states.last`` from the previous step's ``postprocess``.

Tiny config: 1 layer each, head_dim 64, hidden 128 (Slow AR) / 64 (Fast AR, so the
``fast_project_in`` projection exists), 4 codebooks of 64 codes.
"""

from __future__ import annotations

import json
from pathlib import Path

from omnigen_testing.real.case import RealRequest, RealStageCase

ARCH = "FishSpeechSlowARForConditionalGeneration"
VOCAB = 320
SEMANTIC_BEGIN = 200
CODEBOOK = 64
SEMANTIC_END = SEMANTIC_BEGIN + CODEBOOK - 1  # inclusive
AUDIO_PAD = 199
NUM_CODEBOOKS = 4


def write_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [ARCH],
        "model_type": "fish_qwen3_omni",
        "torch_dtype": "bfloat16",
        "semantic_start_token_id": SEMANTIC_BEGIN,
        "semantic_end_token_id": SEMANTIC_END,
        "audio_pad_token_id": AUDIO_PAD,
        "text_config": {
            "model_type": "fish_qwen3",
            "vocab_size": VOCAB,
            "dim": 128,
            "n_head": 2,
            "n_local_heads": 1,
            "head_dim": 64,
            "n_layer": 1,
            "intermediate_size": 256,
            "attention_qk_norm": True,
            "rope_base": 1000000.0,
            "max_seq_len": 512,
            "tie_word_embeddings": True,
            "codebook_size": CODEBOOK,
            "num_codebooks": NUM_CODEBOOKS,
        },
        "audio_decoder_config": {
            "model_type": "fish_qwen3_audio_decoder",
            "vocab_size": CODEBOOK,
            "num_codebooks": NUM_CODEBOOKS,
            "dim": 64,
            "n_head": 1,
            "n_local_heads": 1,
            "head_dim": 64,
            "n_layer": 1,
            "intermediate_size": 128,
            "max_seq_len": NUM_CODEBOOKS + 1,
            "text_dim": 128,
            "audio_hidden_dim": 128,
            "attention_qk_norm": False,
            "rope_base": 1000000.0,
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def _text(length: int, start: int) -> list[int]:
    return [(start + 7 * i) % (AUDIO_PAD - 10) + 5 for i in range(length)]


EXPECT = {
    # One row of NUM_CODEBOOKS codes in every request's buffer at every decode step.
    "decode_codes": NUM_CODEBOOKS,
    # Published by make_omni_output every step (plus the step's hidden states).
    "payload_keys": ["audio_codes"],
    # Same prompt, different tts_local_seed: their codes must differ (the seed reaches the Fast AR).
    "differ": ["fish-a", "fish-d"],
}


def requests() -> list[RealRequest]:
    # 11 tokens: chunked over two steps at max_num_batched_tokens=8, sharing steps with the
    # others' prefill chunks; MTP seeded, seeded differently, unseeded. Semantic tokens are
    # greedy: a vLLM-seeded sampler (SamplingParams.seed) cannot run a chunked prefill on CPU
    # (vLLM's _bookkeeping_sync rewinds the generator: "CPU Generator does not use offset").
    return [
        RealRequest("fish-a", _text(11, 3), max_tokens=5, seed=7),
        RealRequest("fish-b", _text(5, 40), max_tokens=4, seed=8),
        RealRequest("fish-c", _text(3, 90), max_tokens=6),
        RealRequest("fish-d", _text(11, 3), max_tokens=4, seed=9),
    ]


CASE = RealStageCase(
    name="fish_speech_slow_ar",
    omnigen_model="fish_speech",
    omnigen_stage="slow_ar",
    arch=ARCH,
    model_class="vllm_omni.model_executor.models.fish_speech.fish_speech_slow_ar.FishSpeechSlowARForConditionalGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    # The model computes in bf16 (embeddings and Fast AR inputs are cast to bfloat16).
    engine_kwargs={"dtype": "bfloat16"},
    # vllm-omni's pipeline for this stage (fish_speech/pipeline.py): stage 0, "latent" output.
    omni_model_config={
        "stage_id": 0,
        "model_stage": "fish_speech_slow_ar",
        "model_arch": ARCH,
        "worker_type": "ar",
        "engine_output_type": "latent",
        "async_chunk": False,
    },
)
