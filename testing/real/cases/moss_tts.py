"""MOSS-TTS-Local talker (``MossTTSLocalTalkerForGeneration``, arch ``MossTTSLocalModel``), tiny.

Model facts this case relies on (vllm_omni 0.30, ``model_executor/models/moss_tts/``):

- Config ``MossTTSLocalConfig`` (configuration_moss_tts.py:239; ``model_type="moss_tts_local"``,
  registered with ``AutoConfig`` when that module is imported, :306-308, which importing the model
  class does). ``qwen3_config`` is the backbone (``get_text_config``, :302), ``gpt2_config`` the
  1-layer local depth transformer (``n_head``, ``n_inner``; its width is the backbone's,
  modeling_moss_tts_talker.py:1350). Token ids (``im_end``, ``audio_assistant_slot``, ...) are
  config fields and must lie inside ``qwen3_config.vocab_size``: ``compute_logits`` writes one-hot
  rows at those ids (:1398-1472). ``audio_pad_token_id`` == ``audio_vocab_size`` (outside the
  codebook; masked in ``_audio_embed`` :1478).
- Hooks (talker :1270-1745): ``has_preprocess`` / ``has_postprocess``; ``preprocess`` (:1498;
  prefill adds the payload's ``codes.ref`` rows at ``ref_offset``, which it advances per chunk, so
  chunked prefill works; decode returns ``mtp_inputs=(hidden_states.last, control)``),
  ``preprocess_decode_batch`` (:1554, 5-tuple), ``postprocess`` (:1607, ``hidden_states.last``;
  ``postprocess_uses_multimodal_outputs = postprocess_uses_req_infos = False`` :1366-1367, hidden
  slice still used), ``talker_mtp`` (:1613; the local depth transformer samples the binary
  continue gate and every codebook with fixed temperature 1.7 / top_k 25 / top_p 0.8 and the
  ``generator`` kwarg, modeling_moss_tts_local_depth.py:262-355, so ``audio_vocab_size`` must be
  >= 25; ``talker_mtp_output_key = ("audio_codes", "current")`` :1358), ``make_omni_output``
  (:1673; pops ``audio_codes.current`` per row, publishes ``{"codes": {"audio": [...]}}`` and
  caches the continue mask that the NEXT ``compute_logits`` turns into ``audio_assistant_slot`` vs
  ``im_end``; it reads ``request_token_spans`` for mixed prefill/decode batches :1694),
  ``gpu_resident_buffer_keys`` (:1370), ``mtp_hidden_size`` (:1356).
- Every request carries ``codes.ref`` [L, n_vq] aligned with the prompt (audio_pad outside a
  reference block), as the serving adapter builds it (entrypoints/openai/tts_adapters/moss_tts.py:
  369-388); the prompt ends at ``audio_start`` (generation mode).
- All requests are seeded (``tts_local_seed``): vllm-omni's runner then hands each row its own
  generator (a multi-row batch with seeded rows is split into single-row ``talker_mtp`` calls,
  gpu_model_runner.py:1997-2020), so the sampled codes do not depend on batching.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnigen_testing.real.case import RealRequest, RealStageCase

N_VQ = 4
AUDIO_VOCAB = 32  # >= 25 (the depth transformer's top_k)
AUDIO_PAD = AUDIO_VOCAB
TEXT_VOCAB = 160
PAD, IM_START, IM_END, AUDIO_START, AUDIO_END, USER_SLOT, ASSISTANT_SLOT = 150, 151, 152, 153, 154, 155, 156
USER, ASSISTANT, NEWLINE = 140, 141, 142


def write_checkpoint(path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "moss_tts_local",
        "architectures": ["MossTTSLocalModel"],
        "n_vq": N_VQ,
        "audio_vocab_size": AUDIO_VOCAB,
        "audio_pad_token_id": AUDIO_PAD,
        "pad_token_id": PAD,
        "im_start_token_id": IM_START,
        "im_end_token_id": IM_END,
        "audio_start_token_id": AUDIO_START,
        "audio_end_token_id": AUDIO_END,
        "audio_user_slot_token_id": USER_SLOT,
        "audio_assistant_slot_token_id": ASSISTANT_SLOT,
        "local_text_head_mode": "binary",
        "qwen3_config": {
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
        },
        "gpt2_config": {
            "n_embd": 128,
            "n_head": 2,
            "n_inner": 256,
            "n_layer": 1,
            "layer_norm_epsilon": 1e-5,
            "rope_base": 1000000.0,
        },
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _request(
    gen: torch.Generator, rid: str, n_text: int, n_ref: int, max_tokens: int, seed: int
) -> RealRequest:
    """``<im_start> user \\n [slot]*n_ref {text} <im_end> \\n <im_start> assistant \\n <audio_start>``
    with ``codes.ref`` carrying reference codes at the slot rows and audio_pad elsewhere."""
    text = torch.randint(1, 130, (n_text,), generator=gen).tolist()
    head = [IM_START, USER, NEWLINE]
    ids = [*head, *[USER_SLOT] * n_ref, *text, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE, AUDIO_START]
    ref = torch.full((len(ids), N_VQ), AUDIO_PAD, dtype=torch.long)
    if n_ref:
        ref[len(head) : len(head) + n_ref] = torch.randint(0, AUDIO_VOCAB, (n_ref, N_VQ), generator=gen)
    return RealRequest(rid, ids, max_tokens=max_tokens, payload={"codes": {"ref": ref}}, seed=seed)


def requests() -> list[RealRequest]:
    gen = torch.Generator().manual_seed(2024)
    return [
        _request(gen, "clone", n_text=4, n_ref=5, max_tokens=6, seed=11),  # 18 tokens: chunked 8 + 8 + 2
        _request(gen, "plain", n_text=2, n_ref=0, max_tokens=5, seed=12),
        _request(gen, "short_clone", n_text=1, n_ref=2, max_tokens=6, seed=13),
    ]


EXPECT = {
    # make_omni_output publishes each request's codes row (the MTP's audio_codes.current).
    "payload_keys": ["codes.audio"],
    "differ": ["clone", "short_clone"],
}


CASE = RealStageCase(
    name="moss_tts_local_talker",
    omnigen_model="moss_tts_local",
    omnigen_stage="talker",
    arch="MossTTSLocalModel",
    model_class="vllm_omni.model_executor.models.moss_tts.modeling_moss_tts_talker.MossTTSLocalTalkerForGeneration",
    oracle_runner="vllm_omni.worker.gpu_ar_model_runner.GPUARModelRunner",
    write_checkpoint=write_checkpoint,
    requests=requests,
    engine_kwargs={
        "dtype": "float32",
        # The rest is the harness's ENGINE_DEFAULTS (chunked prefill, 8-token steps, 4 seqs).
    },
    # With N(0, 0.5) weights the binary continue gate stops almost every frame (all-pad codes);
    # N(0, 0.1) keeps a mix of emitted frames and stops.
    redraw_weights_std=0.1,
    omni_model_config={
        # vllm_omni/model_executor/models/moss_tts/pipeline.py: MOSS_TTS_LOCAL_PIPELINE stage 0
        # (deploy/moss_tts_local.yaml ships async_chunk: true; the sync path is tested here).
        "stage_id": 0,
        "model_stage": "moss_tts_local",
        "model_arch": "MossTTSLocalModel",
        "worker_type": "ar",
        "engine_output_type": "latent",
        "async_chunk": False,
        "hf_config_name": None,
    },
)
