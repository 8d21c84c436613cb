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

The sizes, the config and the tokenizer are shared with ``testing/checkpoints/higgs_audio_v3.py``
(the same shapes with weights in safetensors and the bundled codec, for whole pipelines).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnigen_testing.real.case import RealRequest, RealStageCase

ARCH = "HiggsAudioV3TalkerForConditionalGeneration"
CODE2WAV_ARCH = "HiggsAudioV3Code2WavForConditionalGeneration"
NUM_CODEBOOKS = 8  # the released count, which code2wav's glue and decoder also assume (8 quantizers)
CODEBOOK_SIZE = 1026  # BOC_ID=1024, EOC_ID=1025 are module constants of the talker
HIDDEN = 128
MAX_POSITIONS = 40960  # Qwen3-4B's (the released backbone); the stage cases run at max_model_len 128
# The case's words (w0..w39, the requests draw from them) and some English ones for the
# checkpoints of testing/checkpoints, whose users type text.
WORDS = [f"w{i}" for i in range(40)] + (
    "hello world the quick brown fox jumps over lazy dog a good day to you and thank this is my voice "
    "it one please say"
).split()
SPECIALS = [
    "<|endoftext|>",
    "<|tts|>",
    "<|text|>",
    "<|audio|>",
    "<|ref_audio|>",
    "<|ref_text|>",
    "<|audio_end|>",
]
TEXT_VOCAB = 128
# WordLevel ids: <unk>=0, the words from 1, the specials after them in SPECIALS order.
ID = {tok: 1 + len(WORDS) + i for i, tok in enumerate(SPECIALS)}
EOS, TTS, TEXT, AUDIO, REF_AUDIO, AUDIO_END = (
    ID["<|endoftext|>"],
    ID["<|tts|>"],
    ID["<|text|>"],
    ID["<|audio|>"],
    ID["<|ref_audio|>"],
    ID["<|audio_end|>"],
)
assert max(ID.values()) < TEXT_VOCAB


def write_tokenizer(path: Path) -> None:
    """An offline WordLevel tokenizer with the Higgs specials as added tokens (the talker's
    config class resolves ``<|tts|>``, ``<|text|>``, ``<|audio|>`` and eos from it)."""
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
                "model_max_length": MAX_POSITIONS,
            }
        )
    )


def higgs_config(arch: str) -> dict:
    """``config.json`` (model_type ``higgs_multimodal_qwen3``) with the tiny sizes."""
    return {
        "model_type": "higgs_multimodal_qwen3",
        "architectures": [arch],
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
        "sample_rate": 24000,
        "frame_rate": 25,
        # The per-layer MLP CUDA graph and the FlashInfer unwrap are GPU-only paths.
        "enable_mlp_cudagraph": False,
        "enable_flashinfer_api_unwrap": False,
        "eos_token_id": EOS,
        "text_config": {
            "model_type": "qwen3",
            "vocab_size": TEXT_VOCAB,
            "hidden_size": HIDDEN,
            "intermediate_size": 256,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "max_position_embeddings": MAX_POSITIONS,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
            "eos_token_id": EOS,
        },
    }


def write_checkpoint(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(higgs_config(ARCH), indent=1))
    write_tokenizer(path)
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
        # Sampled as deployed (temperature 1.0), seeded: the LM token and the codes draw from the
        # request's generator in the order the model's sampler and the runner call them.
        RealRequest("sampled", short, max_tokens=12, temperature=1.0, sampling_seed=3),
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
    arch=ARCH,
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
