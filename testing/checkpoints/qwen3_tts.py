"""Tiny Qwen3-TTS checkpoints, laid out like the released ones, with seeded random weights.

``write_qwen3_tts(folder, variant, seed)`` writes one folder that serves BOTH stages, as the hub
repos ``Qwen/Qwen3-TTS-12Hz-{0.6B,1.7B}-{CustomVoice,VoiceDesign,Base}`` do: the talker
(``Qwen3TTSTalkerForConditionalGeneration``) and the codec decoder (``Qwen3TTSCode2Wav``) are
both pointed at it, the stage chosen by ``hf_overrides={"architectures": [...]}``::

    config.json                    architectures ["Qwen3TTSForConditionalGeneration"], model_type
                                   "qwen3_tts", tts_model_type, talker_config (+ code_predictor_config),
                                   speaker_encoder_config (Base only)
    model.safetensors              talker.* (+ speaker_encoder.* for Base), bfloat16
    tokenizer.json                 text tokenizer (offline WordLevel; ids < text_vocab_size)
    tokenizer_config.json          incl. a ChatML chat_template
    speech_tokenizer/config.json   Qwen3TTSTokenizerV2 (12 Hz): Mimi encoder_config + decoder_config
    speech_tokenizer/preprocessor_config.json   the encoder's feature extractor
    speech_tokenizer/model.safetensors          encoder.* (Mimi) + decoder.* (codec decoder), float32

Sizes are the tiny ones of ``testing/real/cases/qwen3_tts_talker.py`` (talker hidden 128, one
layer; code predictor hidden 64, 4 code groups, codebook 128; codec decoder 16 samples per frame),
imported from there so the dummy-loader cases and these folders stay one shape.

Which file each stage reads, and under which names (established by reading vllm-omni 0.30's
``load_weights``, then checked by ``tests/e2e/test_checkpoints.py``, which loads these folders
through vLLM's ``DefaultModelLoader`` and compares every loaded tensor with the files):

* talker, ``qwen3_tts_talker.py:1319`` ``load_weights``: from ``model.safetensors`` it keeps
  ``talker.*`` and ``speaker_encoder.*`` and maps them with ``hf_to_vllm_mapper`` (``:348``):
  ``talker.model.layers.`` -> ``model.layers.`` (vLLM's ``Qwen3Model``, which packs
  q/k/v_proj into ``qkv_proj`` and gate/up_proj into ``gate_up_proj``), ``talker.model.norm.``,
  ``talker.model.codec_embedding.`` -> ``model.embed_tokens.``, ``talker.codec_head.`` ->
  ``lm_head.``, ``talker.model.text_embedding.``, ``talker.text_projection.`` (``linear_fc1/2``,
  with bias), ``talker.code_predictor.`` (``model.codec_embedding.{g}`` of width talker hidden,
  ``model.layers.*`` packed the same way by ``CodePredictorBaseModel.load_weights``,
  ``model.norm``, ``lm_head.{g}``, and ``small_to_mtp_projection`` when the predictor is narrower
  than the talker, as in the 1.7B release and here). When the file has no ``speaker_encoder.*``
  (CustomVoice, VoiceDesign) the class keeps its randomly initialised ECAPA-TDNN and reports it
  loaded. Then from ``speech_tokenizer/*.safetensors`` it loads ``encoder.*`` (parameters, then
  the quantizer's buffers ``initialized``/``cluster_usage``/``embed_sum`` by a second pass) and
  drops ``decoder.*``.
* code2wav, ``qwen3_tts_code2wav.py:566`` ``load_weights``: drains the top-level files unread,
  then loads ``decoder.*`` from ``speech_tokenizer/*.safetensors`` and drops ``encoder.*``.

Released-checkpoint facts mirrored (the hub files themselves are not reachable from this
machine; sources: QwenLM/Qwen3-TTS ``qwen_tts/core/models/modeling_qwen3_tts.py``, which builds
``self.talker`` and, only when ``tts_model_type == "base"``, ``self.speaker_encoder``; third-party
copies of the released ``config.json`` files; a GGUF converter's tensor table for
``Qwen3-TTS-12Hz-0.6B-Base``, which counts 478 tensors in its ``model.safetensors`` -- the count
``talker_tensor_shapes`` + ``speaker_encoder_tensor_shapes`` give for that model's sizes):

* one ``model.safetensors`` with ``talker.*`` for every variant, plus ``speaker_encoder.*`` for
  Base only; the speech tokenizer in its own ``speech_tokenizer/`` folder (``encoder.*`` = a
  transformers ``MimiModel`` without its ``upsample``/``decoder_transformer``/``decoder``, plus
  ``decoder.*``);
* ``tts_model_type`` ``custom_voice`` / ``voice_design`` / ``base``; ``speaker_encoder_config``
  only in Base (its ``enc_dim`` equals the talker hidden size); ``spk_id`` (int ids in the talker
  vocabulary) and ``spk_is_dialect`` (False or the dialect's language name) filled for
  CustomVoice, empty for the others; ``codec_language_id`` for every variant, with dialect
  languages only in CustomVoice (released: beijing_dialect, sichuan_dialect; here
  beijing_dialect, which speaker dylan maps to, as released); ``assistant_token_id``; all codec
  ids special to the talker (language, think/pad/bos/eos, speaker) lie between the codebook and the
  talker vocabulary size. Released: codebook 0..2047, languages 2050..2074, specials 2148..2157,
  speakers 2861..3066, vocab 3072. Here: codebook 0..127, beijing_dialect 145, specials 148..154,
  english/chinese 155/156 (the tiny case's ids, kept), speakers 157..159, vocab 160;
* ``speech_tokenizer/config.json`` with ``architectures ["Qwen3TTSTokenizerV2Model"]``.

Not mirrored: the tokenizer is a WordLevel one (the release ships Qwen2's BPE tokenizer), and the
``tts_pad``/``bos``/``eos`` ids are plain ids above the vocabulary, not tokens of it. Not
established here: whether the released ``tokenizer_config.json`` carries a chat template
(vllm-omni never applies one: it formats ``<|im_start|>assistant\n{text}<|im_end|>\n...`` itself,
prompt_embeds_builder.py:73-81); the ChatML template written here renders the same role layout.

Values (``testing/checkpoints/tensors.py``): every tensor is drawn from its own ``torch.Generator``
seeded with (seed, crc32(name)), so a tensor's value depends only on the seed and its name (the
talker's weights are the same in all three variants). Weights and biases ~ N(0, 0.05); norm
weights 1 + N(0, 0.05); codebook usage counts U(0.5, 1.5) (the codebooks divide by them);
``initialized`` flags 1. At 0.05 the codec decoder's output stays well inside (-1, 1) (at
N(0, 0.5) it saturates to +-1).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnigen_testing.checkpoints.tensors import write_tensors
from omnigen_testing.real.cases import qwen3_tts_talker as tiny

VARIANTS = ("custom_voice", "voice_design", "base")
ARCH = "Qwen3TTSForConditionalGeneration"
TALKER_ARCH = tiny.ARCH
CODE2WAV_ARCH = tiny.CODE2WAV_ARCH

# CustomVoice's speakers, as the release names them (lower case), ids above the language ids.
SPEAKERS = {"vivian": 157, "ryan": 158, "dylan": 159}
SPEAKER_DIALECT = {"vivian": False, "ryan": False, "dylan": "beijing_dialect"}
# CustomVoice also lists the dialect languages its dialect speakers use (the release has
# beijing_dialect and sichuan_dialect); here the one dylan needs, in the free ids below the
# codec specials, as the release's 2074 lies below its 2148.
DIALECT_LANGUAGES = {"beijing_dialect": 145}

# The case's vocabulary first (same ids), then common English words.
EXTRA_WORDS = (
    "i you he she it we they is are was be have has do not and or but if of to in on at for with "
    "from by this that my your can will good day time say one two yes no please thank"
).split()
WORDS = [*tiny.WORDS, *(w for w in dict.fromkeys(EXTRA_WORDS) if w not in tiny.WORDS)]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- configs


def qwen3_tts_config(variant: str = "custom_voice") -> dict[str, Any]:
    """``config.json`` of one variant."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown Qwen3-TTS variant {variant!r}; expected one of {VARIANTS}")
    config = copy.deepcopy(tiny.qwen3_tts_config(ARCH))
    speaker_encoder = config.pop("speaker_encoder_config")
    config["tts_model_type"] = variant
    config["assistant_token_id"] = WORDS.index("assistant")
    talker = config["talker_config"]
    talker["model_type"] = "qwen3_tts_talker"
    talker["code_predictor_config"]["model_type"] = "qwen3_tts_talker_code_predictor"
    languages = dict(tiny.LANGUAGES)
    if variant == "custom_voice":
        languages.update(DIALECT_LANGUAGES)
        talker["spk_id"] = dict(SPEAKERS)
        talker["spk_is_dialect"] = dict(SPEAKER_DIALECT)
    else:
        talker["spk_id"] = {}
        talker["spk_is_dialect"] = {}
    talker["codec_language_id"] = languages
    if variant == "base":
        # The speaker embedding takes a slot of the talker's input sequence: as wide as its hidden.
        config["speaker_encoder_config"] = {**speaker_encoder, "enc_dim": talker["hidden_size"]}
    _check_ids(config)
    return config


def speech_tokenizer_config() -> dict[str, Any]:
    """``speech_tokenizer/config.json``."""
    return {"architectures": ["Qwen3TTSTokenizerV2Model"], **tiny.speech_tokenizer_config()}


def _check_ids(config: Mapping[str, Any]) -> None:
    talker = config["talker_config"]
    codebook = talker["code_predictor_config"]["vocab_size"]
    vocab = talker["vocab_size"]
    specials = [v for k, v in talker.items() if k.startswith("codec_") and isinstance(v, int)]
    ids = [*specials, *talker["codec_language_id"].values(), *talker["spk_id"].values()]
    if len(set(ids)) != len(ids) or not all(codebook <= i < vocab for i in ids):
        raise AssertionError(
            f"codec special/language/speaker ids must be distinct and in [{codebook}, {vocab})"
        )
    text_ids = [config[k] for k in ("im_start_token_id", "im_end_token_id", "assistant_token_id")]
    text_ids += [config[k] for k in ("tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id")]
    if len(WORDS) > min(text_ids[3:]) or max(text_ids) >= talker["text_vocab_size"]:
        raise AssertionError("text ids must stay below text_vocab_size and the tts ids above the vocabulary")


# --------------------------------------------------------------------------- tensor names


Shapes = dict[str, tuple[int, ...]]


def _qwen3_layers(prefix: str, cfg: Mapping[str, Any]) -> Shapes:
    """A Qwen3 decoder stack's per-layer tensors (HF names: separate q/k/v, gate/up)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", h // heads)
    shapes: Shapes = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (heads * hd, h),
            f"{p}.self_attn.k_proj.weight": (kv * hd, h),
            f"{p}.self_attn.v_proj.weight": (kv * hd, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * hd),
            f"{p}.self_attn.q_norm.weight": (hd,),
            f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
    return shapes


def talker_tensor_shapes(talker: Mapping[str, Any]) -> Shapes:
    """``talker.*`` of the released ``model.safetensors`` (HF ``Qwen3TTSTalkerForConditionalGeneration``)."""
    h, th = talker["hidden_size"], talker["text_hidden_size"]
    cp = talker["code_predictor_config"]
    cph = cp["hidden_size"]
    shapes: Shapes = {
        "talker.model.codec_embedding.weight": (talker["vocab_size"], h),
        "talker.model.text_embedding.weight": (talker["text_vocab_size"], th),
        "talker.model.norm.weight": (h,),
        "talker.codec_head.weight": (talker["vocab_size"], h),
        "talker.text_projection.linear_fc1.weight": (th, th),
        "talker.text_projection.linear_fc1.bias": (th,),
        "talker.text_projection.linear_fc2.weight": (h, th),
        "talker.text_projection.linear_fc2.bias": (h,),
        **_qwen3_layers("talker.model", talker),
        **_qwen3_layers("talker.code_predictor.model", cp),
        "talker.code_predictor.model.norm.weight": (cph,),
    }
    for g in range(cp["num_code_groups"] - 1):
        shapes[f"talker.code_predictor.model.codec_embedding.{g}.weight"] = (cp["vocab_size"], h)
        shapes[f"talker.code_predictor.lm_head.{g}.weight"] = (cp["vocab_size"], cph)
    if cph != h:
        shapes["talker.code_predictor.small_to_mtp_projection.weight"] = (cph, h)
        shapes["talker.code_predictor.small_to_mtp_projection.bias"] = (cph,)
    return shapes


def _conv(prefix: str, out_ch: int, in_ch: int, kernel: int, bias: bool = True) -> Shapes:
    shapes: Shapes = {f"{prefix}.weight": (out_ch, in_ch, kernel)}
    if bias:
        shapes[f"{prefix}.bias"] = (out_ch,)
    return shapes


def speaker_encoder_tensor_shapes(spk: Mapping[str, Any]) -> Shapes:
    """``speaker_encoder.*`` (ECAPA-TDNN), released in the Base checkpoints only."""
    ch, ks, dil = spk["enc_channels"], spk["enc_kernel_sizes"], spk["enc_dilations"]
    if not len(ch) == len(ks) == len(dil):
        raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations differ in length")
    scale, se = spk["enc_res2net_scale"], spk["enc_se_channels"]
    p = "speaker_encoder"
    shapes = _conv(f"{p}.blocks.0.conv", ch[0], spk["mel_dim"], ks[0])
    for i in range(1, len(ch) - 1):
        b, c_in, c = f"{p}.blocks.{i}", ch[i - 1], ch[i]
        shapes |= _conv(f"{b}.tdnn1.conv", c, c_in, 1)
        for j in range(scale - 1):
            shapes |= _conv(f"{b}.res2net_block.blocks.{j}.conv", c // scale, c // scale, ks[i])
        shapes |= _conv(f"{b}.tdnn2.conv", c, c, 1)
        shapes |= _conv(f"{b}.se_block.conv1", se, c, 1)
        shapes |= _conv(f"{b}.se_block.conv2", c, se, 1)
    last = ch[-1]
    shapes |= _conv(f"{p}.mfa.conv", last, last, ks[-1])
    shapes |= _conv(f"{p}.asp.tdnn.conv", spk["enc_attention_channels"], last * 3, 1)
    shapes |= _conv(f"{p}.asp.conv", last, spk["enc_attention_channels"], 1)
    shapes |= _conv(f"{p}.fc", spk["enc_dim"], last * 2, 1)
    return shapes


def codec_encoder_tensor_shapes(encoder_config: Mapping[str, Any]) -> Shapes:
    """``encoder.*`` of ``speech_tokenizer/model.safetensors``: the state dict (parameters and
    persistent buffers) of transformers' ``MimiModel`` without the decoding half, which the
    released encoder class sets to None (``upsample``, ``decoder_transformer``, ``decoder``).
    Built on the meta device: shapes only."""
    import torch
    from transformers import MimiConfig, MimiModel

    kwargs = {k: v for k, v in encoder_config.items() if k != "model_type"}
    with torch.device("meta"):
        model = MimiModel(MimiConfig(**kwargs))
    dropped = ("upsample.", "decoder_transformer.", "decoder.")
    return {
        f"encoder.{name}": tuple(t.shape)
        for name, t in model.state_dict().items()
        if not name.startswith(dropped)
    }


def codec_decoder_tensor_shapes(dec: Mapping[str, Any]) -> Shapes:
    """``decoder.*`` of ``speech_tokenizer/model.safetensors`` (``Qwen3TTSTokenizerV2Decoder``):
    a sliding-window transformer, a split residual VQ, ConvNeXt upsampling and a SnakeBeta
    vocoder."""
    p = "decoder"
    hid, lat, dim = dec["hidden_size"], dec["latent_dim"], dec["decoder_dim"]
    cbd, cbs, nq = dec["codebook_dim"], dec["codebook_size"], dec["num_quantizers"]
    heads = dec["num_attention_heads"]
    kv = dec.get("num_key_value_heads", heads)
    hd = dec.get("head_dim", hid // heads)
    inter = dec["intermediate_size"]
    attn_bias = bool(dec.get("attention_bias", False))
    t = f"{p}.pre_transformer"
    shapes: Shapes = {
        f"{t}.input_proj.weight": (hid, lat),
        f"{t}.input_proj.bias": (hid,),
        f"{t}.output_proj.weight": (lat, hid),
        f"{t}.output_proj.bias": (lat,),
        f"{t}.norm.weight": (hid,),
    }
    for i in range(dec["num_hidden_layers"]):
        lp = f"{t}.layers.{i}"
        for name, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            shapes[f"{lp}.self_attn.{name}.weight"] = (rows, hid)
            if attn_bias:
                shapes[f"{lp}.self_attn.{name}.bias"] = (rows,)
        shapes[f"{lp}.self_attn.o_proj.weight"] = (hid, heads * hd)
        if attn_bias:
            shapes[f"{lp}.self_attn.o_proj.bias"] = (hid,)
        shapes |= {
            f"{lp}.mlp.gate_proj.weight": (inter, hid),
            f"{lp}.mlp.up_proj.weight": (inter, hid),
            f"{lp}.mlp.down_proj.weight": (hid, inter),
            f"{lp}.input_layernorm.weight": (hid,),
            f"{lp}.post_attention_layernorm.weight": (hid,),
            f"{lp}.self_attn_layer_scale.scale": (hid,),
            f"{lp}.mlp_layer_scale.scale": (hid,),
        }
    # Split RVQ: one semantic quantizer, the rest acoustic; both project codebook_dim <-> half.
    for part, n in (("rvq_first", 1), ("rvq_rest", nq - 1)):
        q = f"{p}.quantizer.{part}"
        shapes[f"{q}.input_proj.weight"] = (cbd // 2, cbd, 1)
        shapes[f"{q}.output_proj.weight"] = (cbd, cbd // 2, 1)
        for k in range(n):
            shapes[f"{q}.vq.layers.{k}._codebook.cluster_usage"] = (cbs,)
            shapes[f"{q}.vq.layers.{k}._codebook.embedding_sum"] = (cbs, cbd // 2)
    shapes |= _conv(f"{p}.pre_conv.conv", lat, cbd, 3)
    for i, factor in enumerate(dec["upsampling_ratios"]):
        u = f"{p}.upsample.{i}"
        shapes |= _conv(f"{u}.0.conv", lat, lat, factor)  # ConvTranspose1d: (in, out, k)
        shapes |= _conv(f"{u}.1.dwconv.conv", lat, 1, 7)  # depthwise
        shapes |= {
            f"{u}.1.norm.weight": (lat,),
            f"{u}.1.norm.bias": (lat,),
            f"{u}.1.pwconv1.weight": (4 * lat, lat),
            f"{u}.1.pwconv1.bias": (4 * lat,),
            f"{u}.1.pwconv2.weight": (lat, 4 * lat),
            f"{u}.1.pwconv2.bias": (lat,),
            f"{u}.1.gamma": (lat,),
        }
    shapes |= _conv(f"{p}.decoder.0.conv", dim, lat, 7)
    rates = dec["upsample_rates"]
    for i, rate in enumerate(rates):
        b, c_in, c = f"{p}.decoder.{i + 1}.block", dim >> i, dim >> (i + 1)
        shapes |= {f"{b}.0.alpha": (c_in,), f"{b}.0.beta": (c_in,)}
        shapes |= {f"{b}.1.conv.weight": (c_in, c, 2 * rate), f"{b}.1.conv.bias": (c,)}
        for j in (2, 3, 4):  # residual units, dilations 1, 3, 9
            shapes |= {f"{b}.{j}.act1.alpha": (c,), f"{b}.{j}.act1.beta": (c,)}
            shapes |= _conv(f"{b}.{j}.conv1.conv", c, c, 7)
            shapes |= {f"{b}.{j}.act2.alpha": (c,), f"{b}.{j}.act2.beta": (c,)}
            shapes |= _conv(f"{b}.{j}.conv2.conv", c, c, 1)
    out = dim >> len(rates)
    shapes |= {f"{p}.decoder.{len(rates) + 1}.alpha": (out,), f"{p}.decoder.{len(rates) + 1}.beta": (out,)}
    shapes |= _conv(f"{p}.decoder.{len(rates) + 2}.conv", 1, out, 7)
    return shapes


def model_tensor_shapes(config: Mapping[str, Any]) -> Shapes:
    """Everything in the top-level ``model.safetensors`` of a variant."""
    shapes = talker_tensor_shapes(config["talker_config"])
    if config["tts_model_type"] == "base":
        shapes |= speaker_encoder_tensor_shapes(config["speaker_encoder_config"])
    return shapes


def speech_tokenizer_tensor_shapes(config: Mapping[str, Any]) -> Shapes:
    """Everything in ``speech_tokenizer/model.safetensors``."""
    return {
        **codec_encoder_tensor_shapes(config["encoder_config"]),
        **codec_decoder_tensor_shapes(config["decoder_config"]),
    }


# --------------------------------------------------------------------------- text tokenizer


def text_tokenizer() -> Any:
    """An offline WordLevel tokenizer: the case's words first (same ids), newline a token."""
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


def _write_text_tokenizer(folder: Path) -> None:
    text_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 512,
                "unk_token": "[UNK]",
                "eos_token": "<|im_end|>",
                "pad_token": "<|im_end|>",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


# --------------------------------------------------------------------------- the folder


def write_qwen3_tts(folder: Path, variant: str = "custom_voice", seed: int = 0) -> Path:
    """Write a tiny Qwen3-TTS checkpoint of ``variant`` into ``folder``; return the folder."""
    folder = Path(folder)
    config = qwen3_tts_config(variant)
    # The tiny case's writer: config.json, speech_tokenizer/{config,preprocessor_config}.json and
    # its tokenizer, each rewritten below where this checkpoint differs.
    tiny.write_speech_checkpoint(folder, ARCH)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    speech = folder / "speech_tokenizer"
    speech_config = speech_tokenizer_config()
    (speech / "config.json").write_text(json.dumps(speech_config, indent=2))
    _write_text_tokenizer(folder)

    import torch

    write_tensors(folder / "model.safetensors", model_tensor_shapes(config), seed, torch.bfloat16)
    write_tensors(
        speech / "model.safetensors", speech_tokenizer_tensor_shapes(speech_config), seed, torch.float32
    )
    return folder
