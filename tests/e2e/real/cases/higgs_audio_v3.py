"""Higgs Audio v3 talker (``HiggsAudioV3TalkerForConditionalGeneration``), tiny and offline.

Model facts this case relies on (vllm_omni 0.30,
``model_executor/models/higgs_audio_v3/higgs_audio_v3_talker.py``):

- ``BOC_ID = 1024`` / ``EOC_ID = 1025`` are module constants (:52-53), so the codebook must be
  1026 wide (``audio_encoder_config.vocab_size``); the fused codebook embedding and head are
  ``[num_codebooks * 1026, hidden]`` (:147-150, tied).
- No ``preprocess`` / ``preprocess_decode_batch`` (``has_preprocess`` unset). The class has
  ``prefer_model_sampler = True`` (:108, ``sample`` :992), ``has_postprocess = True`` with
  ``postprocess_uses_{hidden_states,multimodal_outputs,req_infos} = False`` (:111-115;
  ``postprocess`` :1198 publishes ``{"codes": {"audio": [1, N]}}`` per row),
  ``supports_omni_query_start_loc`` / ``supports_omni_decode_step_metadata`` (:116, :189,
  ``update_decode_step_metadata`` :340), ``on_requests_finished`` (:436), ``make_omni_output``
  (:1534).
- ``<|audio|>`` (the audio continuation token) and eos are resolved from the tokenizer at the
  model path: ``HiggsAudioV3Config.resolve_special_tokens`` needs ``<|tts|>``, ``<|text|>``,
  ``<|audio|>`` as added tokens (transformers_utils/configs/higgs_audio_v3.py:26, :162); with
  ``load_format="dummy"`` ``load_weights`` never runs, so the model's lazy fallback
  ``_resolve_token_ids`` (talker :293-338) loads the tokenizer with ``AutoTokenizer`` on the first
  ``sample``. The config class registers itself with ``AutoConfig`` when its module is imported
  (configs/higgs_audio_v3.py:189; ``import vllm_omni`` imports it).
- Audio mode starts when a row's last input token is ``<|audio|>`` (``_audio_seed_mask_from_step_input``
  :909): prompts end in ``<|audio|>`` (zero-shot prompt format, higgs_audio_v3_tokenizer.py:7).
  From then on ``sample`` forces ``<|audio|>`` as the LM token and samples one delay-pattern code
  frame per step from the fused head.
- Voice clone: the payload keys ``audio_input_ids`` ([T, N] delayed codes) and
  ``audio_placeholder_positions`` ([T] prompt positions) replace the prompt embeddings at those
  positions during prefill (``_apply_ref_audio_substitution`` :643); the engine prompt holds
  ``<|tts|>`` there (``prepare_prompt_for_engine``, higgs_audio_v3_tokenizer.py:100).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.e2e.real.case import RealRequest, RealStageCase

NUM_CODEBOOKS = 4
CODEBOOK_SIZE = 1026  # BOC_ID=1024, EOC_ID=1025 are module constants of the talker
TEXT_VOCAB = 64
WORDS = [f"w{i}" for i in range(40)]
SPECIALS = ["<|endoftext|>", "<|tts|>", "<|text|>", "<|audio|>", "<|ref_audio|>", "<|ref_text|>"]
# WordLevel ids: <unk>=0, words 1..40, specials from 41 in SPECIALS order.
ID = {tok: 1 + len(WORDS) + i for i, tok in enumerate(SPECIALS)}
EOS, TTS, TEXT, AUDIO, REF_AUDIO = (
    ID["<|endoftext|>"],
    ID["<|tts|>"],
    ID["<|text|>"],
    ID["<|audio|>"],
    ID["<|ref_audio|>"],
)


def _write_tokenizer(path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "model_max_length": 256,
            }
        )
    )


def write_checkpoint(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "higgs_multimodal_qwen3",
        "architectures": ["HiggsAudioV3TalkerForConditionalGeneration"],
        "audio_encoder_config": {
            "encoder_type": "discrete",
            "num_codebooks": NUM_CODEBOOKS,
            "vocab_size": CODEBOOK_SIZE,
            "tie_word_embeddings": True,
        },
        "num_codebooks": NUM_CODEBOOKS,
        "codebook_size": CODEBOOK_SIZE,
        "audio_stream_bos_id": 1024,
        "audio_stream_eos_id": 1025,
        # The per-layer MLP CUDA graph and the FlashInfer unwrap are GPU-only paths.
        "enable_mlp_cudagraph": False,
        "enable_flashinfer_api_unwrap": False,
        "eos_token_id": EOS,
        "text_config": {
            "model_type": "qwen3",
            "vocab_size": TEXT_VOCAB,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
            "eos_token_id": EOS,
        },
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _write_tokenizer(path)
    return path


def _words(gen: torch.Generator, n: int) -> list[int]:
    return (torch.randint(1, 1 + len(WORDS), (n,), generator=gen)).tolist()


def requests() -> list[RealRequest]:
    gen = torch.Generator().manual_seed(1234)
    # Zero-shot: <|tts|> <|text|> {text} <|audio|>; 12 tokens > max_num_batched_tokens (chunked).
    zero_shot = [TTS, TEXT, *_words(gen, 9), AUDIO]
    # Short zero-shot.
    short = [TTS, TEXT, *_words(gen, 2), AUDIO]
    # Voice clone: <|tts|> <|ref_audio|> [<|tts|>]*T <|text|> {text} <|audio|>, with the delayed
    # reference codes as payload (the placeholder rows are replaced at prefill).
    n_ref = 5
    clone = [TTS, REF_AUDIO, *[TTS] * n_ref, TEXT, *_words(gen, 3), AUDIO]
    ref_codes = torch.randint(0, 1024, (n_ref, NUM_CODEBOOKS), generator=gen, dtype=torch.long)
    payload = {
        "audio_input_ids": ref_codes,
        "audio_input_ids_mask": torch.ones(n_ref, dtype=torch.bool),
        "audio_placeholder_positions": torch.arange(2, 2 + n_ref, dtype=torch.long),
    }
    return [
        RealRequest("zero_shot", zero_shot, max_tokens=8),
        RealRequest("short", short, max_tokens=6),
        RealRequest("clone", clone, max_tokens=7, payload=payload),
    ]


EXPECT = {
    # postprocess publishes one delay-pattern row of NUM_CODEBOOKS codes per request and step.
    "decode_codes": NUM_CODEBOOKS,
    # make_omni_output publishes the buffered codes every step.
    "payload_keys": ["codes.audio"],
    # The voice-clone payload (reference codes) reaches the model: clone's codes are its own.
    "differ": ["zero_shot", "clone"],
}


CASE = RealStageCase(
    name="higgs_audio_v3_talker",
    omnigen_model="higgs_audio_v3",
    omnigen_stage="talker",
    arch="HiggsAudioV3TalkerForConditionalGeneration",
    model_class="vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_talker.HiggsAudioV3TalkerForConditionalGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    engine_kwargs={
        "dtype": "float32",
        # The rest is the harness's ENGINE_DEFAULTS (chunked prefill, 8-token steps, 4 seqs).
    },
    omni_model_config={
        # vllm_omni/model_executor/models/higgs_audio_v3/pipeline.py: stage 0
        "stage_id": 0,
        "model_stage": "higgs_audio_v3",
        "model_arch": "HiggsAudioV3TalkerForConditionalGeneration",
        "worker_type": "ar",
        "engine_output_type": "latent",
        "async_chunk": False,
        "final_output": False,
        "hf_config_name": None,
    },
)
