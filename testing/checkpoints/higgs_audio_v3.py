"""Tiny Higgs Audio v3 checkpoints, laid out like the released one, with seeded random weights.

``write_higgs_audio_v3(folder, seed)`` writes one folder that serves BOTH stages, as the released
checkpoint does (``model_type`` ``higgs_multimodal_qwen3``, vllm-omni 0.30's
``model_executor/models/higgs_audio_v3/pipeline.py``): the talker
(``HiggsAudioV3TalkerForConditionalGeneration``) and the codec decoder
(``HiggsAudioV3Code2WavForConditionalGeneration``) are both pointed at it, the stage chosen by
``hf_overrides={"architectures": [...]}``::

    config.json            architectures ["HiggsMultimodalQwen3ForConditionalGeneration"],
                           model_type higgs_multimodal_qwen3, audio_encoder_config (8 codebooks of
                           1026), text_config (Qwen3), sample_rate 24000, frame_rate 25
    model.safetensors      the talker's tensors and the bundled codec, bfloat16
    tokenizer.json         text tokenizer (offline WordLevel) with the Higgs specials as added tokens
    tokenizer_config.json  eos_token <|endoftext|>

Sizes are the tiny talker case's (``testing/real/cases/higgs_audio_v3.py``: hidden 128, one
layer, 8 codebooks, text vocabulary 128), imported from there so the dummy-loader case and these
folders stay one shape.

Which tensors each stage reads (vllm-omni 0.30, established by reading its ``load_weights``, then
checked by ``tests/e2e/test_checkpoints_higgs_audio_v3.py``, which loads these folders through
vLLM's real safetensors loader and compares every loaded parameter with the file):

* talker, ``higgs_audio_v3_talker.py`` ``load_weights`` / ``_map_weight_name``:
  ``tied.embedding.text_embedding.`` -> ``model.embed_tokens.``, ``body.layers.`` ->
  ``model.layers.`` (vLLM's ``Qwen3Model``: q/k/v_proj packed into ``qkv_proj``, gate/up_proj
  into ``gate_up_proj``), ``body.norm.``, ``tied.head.text_head.`` -> ``lm_head.`` (the backbone
  does not tie its word embeddings), ``tied.embedding.modality_embeddings.0.embedding.`` -> the
  fused codebook embedding ``[8 x 1026, hidden]`` (the codebook head is tied to it). It skips the
  codec (``tied.embedding.modality_embeddings.0.model.``) and refuses any other name; it raises
  when a required key (``_build_required_keys``: every layer suffix, the text embedding, the
  norm, the codebook embedding) is missing.
* code2wav, ``higgs_audio_v3_code2wav.py`` ``load_weights`` / ``_load_from_bundled_state``: the
  codec under ``tied.embedding.modality_embeddings.0.model.``, in the layout of transformers'
  ``HiggsAudioV2TokenizerModel`` (``OmniVoice``'s): ``quantizer.quantizers.{0..7}`` (``codebook.embed``
  ``[1024, 64]`` with the training buffers ``cluster_size``/``embed_avg``/``inited``,
  ``project_in``, ``project_out`` ``[hidden, 64]``), ``fc2`` ``[256, hidden]`` and
  ``acoustic_decoder.*``, transformers' ``DacModel`` decoder under the fixed configuration the class
  builds (``decoder_hidden_size`` 1024, upsampling 8 x 5 x 4 x 2 x 3 = 960 samples a frame, 24 kHz at
  25 frames a second). Missing or unexpected decoder-side keys are errors there.

So the codec cannot be tiny everywhere: vllm-omni's code2wav builds its acoustic decoder with
fixed sizes (``build_higgs_audio_acoustic_decoder``'s configuration, 20.2 M parameters, 40 MB in
bfloat16); only the quantizer's hidden size (here 64; released 1024, the acoustic 256 plus the
semantic model's 768) is read from the tensors. Not mirrored: the codec's encoder half
(``acoustic_encoder.*``, ``encoder_semantic.*``, ``decoder_semantic.*``, ``semantic_model.*``, ``fc.*``,
``fc1.*``), which both stages skip (voice cloning encodes reference audio in the serving process,
with transformers' ``HiggsAudioV2TokenizerModel``, not from these tensors); the tokenizer is a
WordLevel one, not the release's Qwen BPE tokenizer; ids differ (the release's eos 151643,
``<|audio_end|>`` 151671).

Values: ``omnigen_testing.checkpoints.tensors.draw`` (a function of the seed and the tensor's name), except
where the codec needs its own: the Snake activations' ``alpha`` is 1 + N(0, 0.05) (DAC's snake
divides by it), codebook ``cluster_size`` 1, ``inited`` 1, and the codec's convolutions and linear
layers are N(0, (CODEC_GAIN / sqrt(fan_in))^2): at 0.7 the decoder's output of random codes has a
standard deviation of about 0.1 and peaks near 0.35 (at 1.0 it is about 6, saturated; at 0.5,
0.02).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnigen_testing.checkpoints.qwen3_tts import _qwen3_layers
from omnigen_testing.checkpoints.tensors import draw
from omnigen_testing.real.cases import higgs_audio_v3 as tiny

ARCH = "HiggsMultimodalQwen3ForConditionalGeneration"
TALKER_ARCH = tiny.ARCH
CODE2WAV_ARCH = tiny.CODE2WAV_ARCH
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
CODEC_HIDDEN = 64
CODEC_GAIN = 0.7
CODEBOOK_DIM = 64  # fixed in the code2wav class (codebook_dim = 64)
CODEBOOK_ENTRIES = 1024  # real codes 0..1023
# The acoustic decoder's configuration, as vllm-omni's code2wav builds it for this layout
# (higgs_audio_v3_code2wav.py, _load_from_bundled_state: the OmniVoice DacConfig).
DAC_DECODER = {
    "codebook_dim": 8,
    "codebook_size": 1024,
    "decoder_hidden_size": 1024,
    "downsampling_ratios": [8, 5, 4, 2, 3],
    "encoder_hidden_size": 64,
    "hidden_size": 256,
    "hop_length": 960,
    "n_codebooks": 9,
    "sampling_rate": 16000,
    "upsampling_ratios": [8, 5, 4, 2, 3],
}

Shapes = dict[str, tuple[int, ...]]


def higgs_audio_v3_config() -> dict[str, Any]:
    """``config.json``: the case's config under the released architecture name, bfloat16."""
    config = tiny.higgs_config(ARCH)
    config["torch_dtype"] = "bfloat16"
    return config


def talker_tensor_shapes(config: Mapping[str, Any]) -> Shapes:
    """The talker's tensors under the released names."""
    text = config["text_config"]
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    audio = config["audio_encoder_config"]
    shapes: Shapes = {
        "tied.embedding.text_embedding.weight": (vocab, hidden),
        "body.norm.weight": (hidden,),
        "tied.embedding.modality_embeddings.0.embedding.weight": (
            audio["num_codebooks"] * audio["vocab_size"],
            hidden,
        ),
        **_qwen3_layers("body", text),
    }
    if not text.get("tie_word_embeddings", False):
        shapes["tied.head.text_head.weight"] = (vocab, hidden)
    return shapes


def codec_tensor_shapes(num_quantizers: int) -> Shapes:
    """The bundled codec's decoding half (names without ``CODEC_PREFIX``): the residual VQ, fc2
    and transformers' DAC decoder (built on the meta device: shapes only)."""
    import torch
    from transformers import DacConfig, DacModel

    shapes: Shapes = {}
    for i in range(num_quantizers):
        q = f"quantizer.quantizers.{i}"
        shapes |= {
            f"{q}.codebook.inited": (1,),
            f"{q}.codebook.cluster_size": (CODEBOOK_ENTRIES,),
            f"{q}.codebook.embed": (CODEBOOK_ENTRIES, CODEBOOK_DIM),
            f"{q}.codebook.embed_avg": (CODEBOOK_ENTRIES, CODEBOOK_DIM),
            f"{q}.project_in.weight": (CODEBOOK_DIM, CODEC_HIDDEN),
            f"{q}.project_in.bias": (CODEBOOK_DIM,),
            f"{q}.project_out.weight": (CODEC_HIDDEN, CODEBOOK_DIM),
            f"{q}.project_out.bias": (CODEC_HIDDEN,),
        }
    shapes |= {
        "fc2.weight": (DAC_DECODER["hidden_size"], CODEC_HIDDEN),
        "fc2.bias": (DAC_DECODER["hidden_size"],),
    }
    with torch.device("meta"):
        decoder = DacModel(DacConfig(**DAC_DECODER)).decoder
    shapes |= {f"acoustic_decoder.{name}": tuple(t.shape) for name, t in decoder.state_dict().items()}
    return shapes


def model_tensor_shapes(config: Mapping[str, Any]) -> Shapes:
    """Everything in ``model.safetensors``."""
    codec = codec_tensor_shapes(config["audio_encoder_config"]["num_codebooks"])
    return {**talker_tensor_shapes(config), **{CODEC_PREFIX + name: shape for name, shape in codec.items()}}


def _codec_value(name: str, shape: tuple[int, ...], seed: int) -> Any:
    """A codec tensor's value (see the module's docstring)."""
    import torch

    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("inited", "cluster_size"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    noise = torch.randn(shape, generator=generator)
    if leaf == "alpha":
        return 1.0 + noise * 0.05
    if leaf == "weight" and len(shape) >= 2 and "codebook" not in name:
        # (out, in, k) for Conv1d, (in, out, k) for ConvTranspose1d (conv_t*), (out, in) for Linear.
        fan_in = shape[0 if ".conv_t" in name else 1] * (shape[2] if len(shape) > 2 else 1)
        return noise * CODEC_GAIN / math.sqrt(fan_in)
    return noise * 0.05


def write_higgs_audio_v3(folder: Path, seed: int = 0) -> Path:
    """Write a tiny Higgs Audio v3 checkpoint into ``folder``; return the folder."""
    import torch
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = higgs_audio_v3_config()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tiny.write_tokenizer(folder)
    tensors = {}
    for name, shape in sorted(model_tensor_shapes(config).items()):
        if name.startswith(CODEC_PREFIX):
            value = _codec_value(name, shape, seed).to(torch.bfloat16).contiguous()
        else:
            value = draw(name, shape, seed, torch.bfloat16)
        tensors[name] = value
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
