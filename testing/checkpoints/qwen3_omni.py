"""A tiny Qwen3-Omni checkpoint, laid out like the released one, with seeded random weights.

``write_qwen3_omni(folder, seed)`` writes ONE folder that serves all three stages, as the hub
repos ``Qwen/Qwen3-Omni-30B-A3B-Instruct`` do: each stage's engine loads the same folder and the
same class (``Qwen3OmniMoeForConditionalGeneration``), which builds the stage that
``model_config.model_stage`` names and loads only that stage's tensors::

    config.json             Qwen3OmniMoeConfig: thinker_config (audio, vision, text), talker_config
                            (text, code predictor, speaker_id), code2wav_config, the released
                            chat/tts special ids
    generation_config.json  the thinker's stop ids (<|im_end|>, <|endoftext|>)
    model.safetensors       thinker.* (text model, lm_head, audio_tower, visual), talker.*,
                            code2wav.*, bfloat16
    tokenizer.json          a WordLevel tokenizer over the thinker's whole vocabulary
    tokenizer_config.json   incl. the chat template (content parts: text, audio, image, video)

Sizes are the tiny ones of ``testing/real/cases/qwen3_omni_talker.py`` (``hf_config``: thinker
hidden 192, two MoE layers of 4 experts; talker hidden 128, one MoE layer; code predictor one
layer; code2wav hidden 64, 8 samples a frame), imported from there so the dummy-loader cases and
this folder stay one shape. What differs from those stage cases is the token layout, which here is
the released one, because the pipeline's own code reads it:

* the thinker's vocabulary (152064) with the released chat ids (``<|im_start|>`` 151644, ``user``
  872, ``assistant`` 77091, ``system`` 8948: vllm-omni's ``_compute_talker_prompt_ids_length``
  and omnigen's ``omnigen.glue.qwen3_omni`` hard-code them) and TTS ids (151671-151673, which the
  thinker embeds for the talker);
* the talker: vocabulary 3072 whose last 1024 ids are suppressed but the codec EOS (so layer-0
  codes are 0-2047), codec specials 2148-2157 (EOS 2150, the stop id vllm-omni's pipeline
  hard-codes), speakers ``chelsie``/``ethan``/``aiden`` at 2301-2303; 16 code groups of 2048 codes
  (code2wav's forward reshapes its input to 16 rows, and the glue keeps codes below 2048).

Tensor names: the state dict of transformers' own ``Qwen3OmniMoeForConditionalGeneration`` for
this config (built on the meta device), reverted to the on-disk layout the way
``save_pretrained`` reverts it (``revert_weight_conversion``: the MoE experts one tensor per
expert, ``experts.{e}.{gate,up,down}_proj.weight``), which is the released files' layout.
Values: ``testing/checkpoints/tensors.py`` (a function of seed and name).

Tokenizer: the release ships Qwen2's byte-level BPE (151643 tokens plus specials); here every id
below 151676 is a word of a WordLevel vocabulary, so that any id the random thinker samples
decodes to text, and the ids the glue and the talker read are the released ones: ``\\n`` 198,
``user`` 872, ``system`` 8948, ``assistant`` 77091, the specials 151643-151675 (``<|im_start|>``,
``<|im_end|>``, ``<|audio_start|>``, ``<|audio_pad|>``, ``<|vision_start|>``, ``<|image_pad|>``,
``<tts_pad>``, ...). Words are separated by spaces; a word outside the vocabulary is ``[UNK]``.
The chat template is written here (not the release's): ChatML turns, a message's content either
a string or a list of parts (text, audio, image, video: the latter three as the release's
placeholder tokens), and ``<|im_start|>assistant\\n`` as the generation prompt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnigen_testing.checkpoints.tensors import write_tensors
from omnigen_testing.real.cases import qwen3_omni_talker as tiny

ARCH = "Qwen3OmniMoeForConditionalGeneration"
THINKER_VOCAB = 152064
"""The released thinker vocabulary (Qwen3-Omni-30B-A3B: text_config.vocab_size)."""
TALKER_VOCAB = 3072
CODEBOOK = 2048
CODE_GROUPS = 16
TALKER_SPECIALS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
"""talker_config.speaker_id: the release's three voices and ids."""

# The released token ids the model and the glue read (Qwen2 tokenizer of Qwen3-Omni).
NEWLINE, USER, SYSTEM, ASSISTANT = 198, 872, 8948, 77091
SPECIAL_TOKENS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
    "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}
FIRST_WORD = 1000
"""Where the plain words start (after them, filler words up to the specials)."""
WORDS = (
    "hello world the quick brown fox jumps over lazy dog what is your name please tell me a short "
    "story about sea and sky i you we they it this that is are was be have has do not yes no good "
    "day time say one two three thank answer question speak voice sing song"
).split()
UNK = "[UNK]"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] in ('audio', 'audio_url', 'input_audio') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def qwen3_omni_hf_config() -> Any:
    """The folder's ``Qwen3OmniMoeConfig``: the tiny shapes, the released vocabulary and ids."""
    cfg = tiny.hf_config(
        thinker_vocab=THINKER_VOCAB,
        talker_vocab=TALKER_VOCAB,
        code_vocab=CODEBOOK,
        code_groups=CODE_GROUPS,
        # spatial_merge_size: in the released talker_config (transformers' talker class reads it).
        talker={**TALKER_SPECIALS, "speaker_id": dict(SPEAKERS), "spatial_merge_size": 2},
    )
    if max(SPECIAL_TOKENS.values()) >= THINKER_VOCAB:
        raise AssertionError("the special tokens must lie inside the thinker's vocabulary")
    return cfg


def tensor_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the released ``model.safetensors`` for ``cfg``: transformers' own model's
    state dict, in the on-disk layout ``save_pretrained`` writes."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeForConditionalGeneration,
    )

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(cfg)
    on_disk = revert_weight_conversion(model, dict(model.state_dict()))
    return {name: tuple(tensor.shape) for name, tensor in on_disk.items()}


def vocabulary() -> dict[str, int]:
    """Every id below the last special: the released ids the model reads, the plain words, fillers."""
    fixed = {"\n": NEWLINE, "user": USER, "system": SYSTEM, "assistant": ASSISTANT, UNK: 0}
    fixed |= {word: FIRST_WORD + i for i, word in enumerate(w for w in WORDS if w not in fixed)}
    fixed |= SPECIAL_TOKENS
    taken = {i: word for word, i in fixed.items()}
    return {taken.get(i, f"w{i}"): i for i in range(max(SPECIAL_TOKENS.values()) + 1)}


def text_tokenizer() -> Any:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
            pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        ]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _write_tokenizer(folder: Path) -> None:
    text_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 32768,
                "unk_token": UNK,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    stops = [SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}, indent=2))


def write_qwen3_omni(folder: Path, seed: int = 0, *, weights: bool = True) -> Path:
    """Write the tiny Qwen3-Omni checkpoint into ``folder``; return the folder. ``weights=False``
    writes the configs and the tokenizer only (what the request builder reads)."""
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = qwen3_omni_hf_config()
    cfg.save_pretrained(str(folder))
    _write_tokenizer(folder)
    if weights:
        write_tensors(folder / "model.safetensors", tensor_shapes(cfg), seed, torch.bfloat16)
    return folder
