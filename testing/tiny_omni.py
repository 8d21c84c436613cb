"""Tiny, real vLLM models shaped like omni stages, for end-to-end engine tests.

Three architectures, registered out of tree by :func:`omnigen.plugin.register` (the
``vllm.general_plugins`` entry point), served by the generated workers of
``conf/model/omnigen_tiny.yaml`` (talker -> code2wav) and ``conf/model/omnigen_tiny_omni.yaml``
(thinker -> talker -> code2wav):

* ``OmnigenTinyThinkerForConditionalGeneration`` (:class:`OmnigenTinyThinker`): a text
  stage. Llama trunk, vLLM's sampler, and a real tokenizer (:func:`write_tiny_tokenizer`, one
  printable character per token for the first ids, short words after), so it publishes text;
  its forward emits one hidden row per token (``multimodal_outputs["hidden"]``), the full
  payload :func:`omnigen_testing.tiny_glue.thinker2talker` hands the talker (which records
  what it received: ``OmniRecord.thinker_payloads``).

* ``OmnigenTinyTalkerForConditionalGeneration`` (:class:`OmnigenTinyTalker`): an
  autoregressive talker. Llama trunk (vLLM's own ``LlamaModel``: real paged
  attention, KV cache, chunked prefill), vLLM logits/sampler on the text hidden
  states, and the talker hooks of docs/contract.md sections 2-3: ``preprocess``,
  ``preprocess_decode_batch`` (5-tuple with MTP, 3-tuple without) and a
  ``talker_mtp`` code predictor. Its forward emits one row of codes per token
  (``multimodal_outputs["codes.audio"]``: the codes the predictor wrote into the
  row's buffer this step, ``-1`` placeholders for prefill tokens), which the
  generated runner accumulates per request as the full payload for the next stage;
  :func:`talker_to_code2wav` (the stage's declared ``next_stage_input``) turns that
  payload into the code2wav prompt.
* ``OmnigenTinyCode2Wav`` (:class:`OmnigenTinyCode2Wav`): a generation stage. The
  prompt is a sequence of codec codes; every forward turns each scheduled code
  into ``hop_length`` audio samples (``multimodal_outputs["audio"]``: one entry per
  request, as the real code2wav classes return it, of one row per scheduled code). Run it with ``max_tokens=1``: the prompt (chunked or not) is the work,
  the one sampled token is only what lets vLLM's scheduler finish the request.

Which hooks exist and which variant they follow is read from the HF config that
:func:`write_tiny_config` writes at test time (``omnigen_*`` keys), so one class
covers every talker flavour; :data:`VARIANT_OVERRIDES` pairs each variant with the
omnigen overrides that generate the matching runner (:func:`worker_cls`). Weights
are random (``load_format="dummy"``) and there is no tokenizer
(``skip_tokenizer_init=True``; prompts are token ids), except the thinker's.

Like a real talker, ``preprocess`` builds a row's embeddings from its ``input_ids``
(``embed_input_ids``): the runner hands it the persistent ``inputs_embeds`` buffer,
which vLLM does not fill for a text-only model.

Every model keeps an :class:`OmniRecord` at ``model.omni_record``: each forward
(tokens, positions, phase), each hook call (rows, request ids, spans, prefill
flags, computed counts), each code-predictor call (batch size, the rows' request
ids, generators, codes), the codes emitted per request, and any call to a hook the
config disabled. Read it through the engine with
``llm.collective_rpc(lambda w: w.model_runner.model.omni_record.snapshot())``.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from omnigen.runtime.outputs import OmniOutput

THINKER_ARCH = "OmnigenTinyThinkerForConditionalGeneration"
TALKER_ARCH = "OmnigenTinyTalkerForConditionalGeneration"
CODE2WAV_ARCH = "OmnigenTinyCode2Wav"
TINY_ARCHS: dict[str, str] = {
    THINKER_ARCH: "omnigen_testing.tiny_omni:OmnigenTinyThinker",
    TALKER_ARCH: "omnigen_testing.tiny_omni:OmnigenTinyTalker",
    CODE2WAV_ARCH: "omnigen_testing.tiny_omni:OmnigenTinyCode2Wav",
}

# Llama shape that vLLM's CPU attention accepts (head_dim 16 is rejected).
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Knob presets, by the stage they imitate (docs/models.md "Per-stage policies").
VARIANTS: dict[str, dict[str, Any]] = {
    # qwen3_tts / moss_tts_local: per-row hook, MTP, batched decode (5-tuple hook),
    # a predictor taking per-row generators. conf/model/omnigen_tiny.yaml as committed.
    "mtp_batched": dict(
        omnigen_stage="talker",
        omnigen_preprocess=True,
        omnigen_mtp=True,
        omnigen_decode_batch="mtp",
        omnigen_mtp_per_row_generators=True,
    ),
    # qwen3_omni talker: per-row hook, MTP, no batched decode hook, one shared generator.
    "mtp_per_row": dict(
        omnigen_stage="talker",
        omnigen_preprocess=True,
        omnigen_mtp=True,
        omnigen_decode_batch="none",
        omnigen_mtp_per_row_generators=False,
    ),
    # higgs_audio_v3 talker: per-row hook, no MTP, batched decode (3-tuple hook).
    "batched_plain": dict(
        omnigen_stage="talker",
        omnigen_preprocess=True,
        omnigen_mtp=False,
        omnigen_decode_batch="plain",
        omnigen_mtp_per_row_generators=False,
    ),
    # a thinker: text out, hidden rows for the talker, no talker hooks.
    "thinker": dict(
        omnigen_stage="thinker",
        omnigen_preprocess=False,
        omnigen_mtp=False,
        omnigen_decode_batch="none",
        omnigen_mtp_per_row_generators=False,
    ),
    # a code2wav / codec decoder: no talker hooks at all.
    "code2wav": dict(
        omnigen_stage="code2wav",
        omnigen_preprocess=False,
        omnigen_mtp=False,
        omnigen_decode_batch="none",
        omnigen_mtp_per_row_generators=False,
    ),
}

KNOB_DEFAULTS: dict[str, Any] = dict(
    VARIANTS["mtp_batched"],
    omnigen_num_codebooks=4,
    omnigen_codebook_size=32,
    omnigen_hop_length=4,
)

_DECODE_BATCH_MODES = ("none", "mtp", "plain")

TINY_MODEL = "omnigen_tiny"
"""The omnigen model config (``conf/model/omnigen_tiny.yaml``) whose runners serve these models."""

TINY_OMNI_MODEL = "omnigen_tiny_omni"
"""The three-stage config (``conf/model/omnigen_tiny_omni.yaml``): thinker -> talker -> code2wav."""

_TALKER = "model.stages.talker"
VARIANT_OVERRIDES: dict[str, tuple[str, ...]] = {
    # The committed config: per-row hook + decode_batch=mtp + MTP, per_row_generators=always.
    "mtp_batched": (),
    "mtp_per_row": (
        f"{_TALKER}.preprocess.decode_batch=none",
        f"{_TALKER}.mtp.per_row_generators=never",
    ),
    "batched_plain": (
        f"{_TALKER}.preprocess.decode_batch=plain",
        f"{_TALKER}.mtp.enabled=false",
        f"{_TALKER}.mtp.per_row_generators=never",
    ),
    "code2wav": (),
}
"""Each variant's omnigen overrides of ``conf/model/omnigen_tiny.yaml``: the generated runner
whose policies match the hooks that variant's HF config turns on."""

VARIANT_STAGES: dict[str, str] = {
    "mtp_batched": "talker",
    "mtp_per_row": "talker",
    "batched_plain": "talker",
    "code2wav": "code2wav",
}

VARIANT_ARCHS: dict[str, str] = {
    "mtp_batched": TALKER_ARCH,
    "mtp_per_row": TALKER_ARCH,
    "batched_plain": TALKER_ARCH,
    "thinker": THINKER_ARCH,
    "code2wav": CODE2WAV_ARCH,
}
"""The architecture each variant's HF config names."""

ARCH_DEFAULT_VARIANTS: dict[str, str] = {
    THINKER_ARCH: "thinker",
    TALKER_ARCH: "mtp_batched",
    CODE2WAV_ARCH: "code2wav",
}

PLACEHOLDER_CODE = -1
"""A prefill token's row in the talker's ``codes.audio`` payload (the consumer crops it)."""

CODE2WAV_TOKEN_BASE = 16
"""Code2wav prompt id of code ``c`` of codebook ``k``: ``CODE2WAV_TOKEN_BASE + k * codebook_size + c``."""


def worker_cls(variant: str) -> str:
    """The ``worker_cls`` vLLM loads for ``variant``: the committed generated worker for the
    committed config, else an in-memory variant from :func:`omnigen.api.worker_cls_name`
    (which needs the worker built in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from omnigen import api

    if variant not in VARIANT_OVERRIDES:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANT_OVERRIDES)}")
    return api.worker_cls_name(TINY_MODEL, VARIANT_STAGES[variant], VARIANT_OVERRIDES[variant])


TALKER_TEXT_BASE = 10
"""Talker prompt id of thinker token ``t``: ``TALKER_TEXT_BASE + t % TALKER_TEXT_IDS``."""
TALKER_TEXT_IDS = 400


def thinker_to_talker(token_ids: Iterable[int]) -> list[int]:
    """The thinker's output token ids -> the talker's prompt ids (the range the tests' talker
    prompts use: ``[TALKER_TEXT_BASE, TALKER_TEXT_BASE + TALKER_TEXT_IDS)``)."""
    return [TALKER_TEXT_BASE + int(t) % TALKER_TEXT_IDS for t in token_ids]


def talker_to_code2wav(payload: dict[str, Any], request: Any = None) -> list[int]:
    """The talker's full payload -> the code2wav stage's prompt token ids (``next_stage_input``).

    ``payload`` is what the talker runner accumulated for one request
    (``_materialize_full_payload_entry``): ``codes.audio`` (or nested ``codes``/``audio``), one
    row of ``num_codebooks`` codes per scheduled token. Placeholder rows (prefill tokens, any
    negative code) are cropped here, as a real consumer crops; each remaining frame becomes
    ``num_codebooks`` prompt ids, frame by frame, codebook ``k`` offset by ``k * codebook_size``.
    """
    del request
    codes = payload.get("codes.audio")
    if codes is None and isinstance(payload.get("codes"), dict):
        codes = payload["codes"].get("audio")
    if not isinstance(codes, torch.Tensor) or codes.dim() != 2:
        raise ValueError(
            f"talker_to_code2wav: expected codes.audio as a (frames, codebooks) tensor, got "
            f"{type(codes).__name__}{'' if codes is None else getattr(codes, 'shape', '')}"
        )
    codes = codes.detach().to("cpu", torch.long)
    frames = codes[(codes >= 0).all(dim=-1)]
    codebook_size = int(KNOB_DEFAULTS["omnigen_codebook_size"])
    if frames.numel() and int(frames.max()) >= codebook_size:
        raise ValueError(f"talker_to_code2wav: code {int(frames.max())} >= codebook size {codebook_size}")
    offsets = torch.arange(frames.shape[1], dtype=torch.long) * codebook_size
    return (frames + offsets + CODE2WAV_TOKEN_BASE).reshape(-1).tolist()


@dataclass(frozen=True)
class TalkerVariant:
    """The hooks one tiny model exposes, as read from its HF config."""

    stage: str
    preprocess: bool
    mtp: bool
    decode_batch: str  # "none" | "mtp" (5-tuple hook) | "plain" (3-tuple hook)
    mtp_per_row_generators: bool
    num_codebooks: int
    codebook_size: int
    hop_length: int

    @classmethod
    def from_config(cls, config: Any) -> TalkerVariant:
        def knob(name: str) -> Any:
            return getattr(config, name, KNOB_DEFAULTS[name])

        variant = cls(
            stage=str(knob("omnigen_stage")),
            preprocess=bool(knob("omnigen_preprocess")),
            mtp=bool(knob("omnigen_mtp")),
            decode_batch=str(knob("omnigen_decode_batch")),
            mtp_per_row_generators=bool(knob("omnigen_mtp_per_row_generators")),
            num_codebooks=int(knob("omnigen_num_codebooks")),
            codebook_size=int(knob("omnigen_codebook_size")),
            hop_length=int(knob("omnigen_hop_length")),
        )
        variant.validate()
        return variant

    def validate(self) -> None:
        if self.stage not in ("thinker", "talker", "code2wav"):
            raise ValueError(f"omnigen_stage must be 'thinker', 'talker' or 'code2wav', got {self.stage!r}")
        if self.decode_batch not in _DECODE_BATCH_MODES:
            raise ValueError(
                f"omnigen_decode_batch must be one of {_DECODE_BATCH_MODES}, got {self.decode_batch!r}"
            )
        if self.decode_batch == "mtp" and not self.mtp:
            raise ValueError("omnigen_decode_batch='mtp' needs omnigen_mtp=True")
        if self.decode_batch == "plain" and self.mtp:
            raise ValueError("omnigen_decode_batch='plain' needs omnigen_mtp=False")
        if self.mtp_per_row_generators and not self.mtp:
            raise ValueError("omnigen_mtp_per_row_generators needs omnigen_mtp=True")


def write_synthetic(folder: str | os.PathLike[str], variant: str) -> str:
    """The tiny models' synthetic checkpoint writer (``checkpoint.synthetic`` of
    ``conf/model/omnigen_tiny*.yaml``): ``serve.models.STAGE=synthetic:VARIANT`` writes the
    variant's config (the thinker's with its tokenizer) into ``folder``."""
    if variant not in VARIANTS:
        raise ValueError(f"no tiny variant {variant!r}; choose one of: {', '.join(sorted(VARIANTS))}")
    return write_tiny_config(folder, arch=VARIANT_ARCHS[variant], variant=variant)


def write_tiny_config(
    tmpdir: str | os.PathLike[str],
    arch: str = TALKER_ARCH,
    variant: str | None = None,
    **knobs: Any,
) -> str:
    """Write a tiny Llama-shaped HF config for ``arch`` into ``tmpdir``; return the dir.

    ``variant`` picks a preset from :data:`VARIANTS` (default: ``"thinker"`` for the
    thinker, ``"mtp_batched"`` for the talker, ``"code2wav"`` for the code2wav arch);
    ``knobs`` override single ``omnigen_*`` keys or the Llama shape (``hidden_size``,
    ``vocab_size``, ...). Load it with ``load_format="dummy"``. The talker and code2wav get
    ``config.json`` only (``skip_tokenizer_init=True``); the thinker also gets its tokenizer
    (:func:`write_tiny_tokenizer`, ``vocab_size`` tokens) and no BOS/EOS ids, so it writes text
    for its whole token budget (``skip_tokenizer_init=False``).
    """
    from transformers import LlamaConfig

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    if variant is None:
        variant = ARCH_DEFAULT_VARIANTS[arch]
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {sorted(VARIANTS)}")
    if VARIANT_ARCHS[variant] != arch:
        raise ValueError(f"variant {variant!r} is for {VARIANT_ARCHS[variant]}, not {arch}")
    values: dict[str, Any] = {**TINY_SHAPE, **KNOB_DEFAULTS, **VARIANTS[variant], **knobs}
    unknown = [k for k in knobs if k not in TINY_SHAPE and k not in KNOB_DEFAULTS]
    if unknown:
        raise ValueError(f"unknown knobs {unknown}")
    # Fail here, not inside the engine, on an inconsistent set of knobs.
    TalkerVariant.from_config(_Namespace(values))

    path = os.fspath(tmpdir)
    os.makedirs(path, exist_ok=True)
    special: dict[str, Any] = {}
    if arch == THINKER_ARCH:
        # No BOS/EOS: vLLM would take LlamaConfig's defaults (1, 2) as stop tokens.
        special = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config = LlamaConfig(architectures=[arch], dtype="float32", **values, **special)
    config.save_pretrained(path)
    if arch == THINKER_ARCH:
        write_tiny_tokenizer(path, int(values["vocab_size"]))
    return path


TOKENIZER_CHARS = "".join(chr(c) for c in range(32, 127))
"""Ids ``1..95`` of the tiny tokenizer: the printable ASCII characters (id 0 is ``<unk>``)."""


def tiny_vocab(vocab_size: int) -> list[str]:
    """The tiny tokenizer's tokens by id: ``<unk>``, the printable ASCII characters, then
    distinct short words (``" ban"``, ``" ben"``, ...) up to ``vocab_size``. ASCII only, so any
    id sequence decodes to the concatenation of its tokens, incrementally or at once."""
    consonants, vowels, ends = "bcdfghjklmnpqrstvwxz", "aeiou", "nrstlkm"
    words = [f" {c}{v}{e}" for c in consonants for v in vowels for e in ends]
    vocab = ["<unk>", *TOKENIZER_CHARS, *words]
    if vocab_size > len(vocab):
        raise ValueError(f"the tiny tokenizer has at most {len(vocab)} tokens, vocab_size is {vocab_size}")
    if vocab_size <= len(TOKENIZER_CHARS):
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the printable characters")
    return vocab[:vocab_size]


def write_tiny_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> str:
    """Write a ``tokenizers`` tokenizer of ``vocab_size`` tokens (:func:`tiny_vocab`) into
    ``path`` as ``tokenizer.json`` + ``tokenizer_config.json``, which transformers (and so
    vLLM) load as a ``PreTrainedTokenizerFast``. Text is encoded one character per token
    (``<unk>`` for anything else); ids decode by concatenation, no special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tiny_vocab(vocab_size))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(TINY_SHAPE["max_position_embeddings"]),
        "clean_up_tokenization_spaces": False,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return folder


class _Namespace:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


# --------------------------------------------------------------------------- record


class OmniRecord:
    """What a tiny model saw, step by step. Plain Python values only.

    A *step* is one forward of the model; hooks and predictor calls made before a
    forward belong to that forward's step (they run in the runner's ``_preprocess``).
    Calls made with no forward following them yet stay in ``pending``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = 0
        self.forwards: list[dict[str, Any]] = []
        self.hook_calls: list[dict[str, Any]] = []
        self.mtp_calls: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.request_ids: list[str] = []
        self.codes: dict[str, list[list[int]]] = {}
        """Talker: the codes the forward emitted per request, one frame per decode step."""
        self.payload_tokens_checked = 0
        """Code2wav: scheduled tokens checked against the codes the request's payload carried."""
        self.thinker_payloads: dict[str, dict[str, Any]] = {}
        """Talker: per request, the thinker payload its buffer held (``thinker.hidden``:
        shape, dtype, checksum), as first seen; a later step that sees another is an error."""

    def thinker_payload(self, req_id: Any, hidden: Any) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
            self.error(f"{req_id}: thinker.hidden is {type(hidden).__name__}, not a (rows, hidden) tensor")
            return
        seen = _describe(hidden)
        held = self.thinker_payloads.setdefault(str(req_id), seen)
        if held != seen:
            self.error(f"{req_id}: thinker.hidden changed from {held} to {seen}")

    def _see(self, req_ids: Iterable[Any]) -> None:
        for rid in req_ids:
            if rid is not None and rid not in self.request_ids:
                self.request_ids.append(str(rid))

    def error(self, msg: str) -> None:
        self.errors.append(f"step {self.step}: {msg}")

    def hook(self, name: str, spans: list[int], infos: list[dict[str, Any]]) -> None:
        req_ids = [info.get("request_id") for info in infos]
        self._see(req_ids)
        self.hook_calls.append(
            {
                "step": self.step,
                "hook": name,
                "rows": len(infos),
                "req_ids": req_ids,
                "spans": list(spans),
                "is_prefill": [_as_bool(i.get("_omni_is_prefill")) for i in infos],
                "computed": [_as_int(i.get("_omni_num_computed_tokens")) for i in infos],
                "prompt_len": [_as_int(i.get("_omni_prompt_len")) for i in infos],
                "hook_calls_seen": [int((i.get("meta") or {}).get("hook_calls", 0)) for i in infos],
            }
        )

    def step_rows(self) -> list[tuple[Any, int, bool | None]]:
        """``(request_id, span, is_prefill)`` of each row the hooks saw this step, in call order."""
        return [
            (rid, span, pre)
            for call in self.hook_calls
            if call["step"] == self.step
            for rid, span, pre in zip(call["req_ids"], call["spans"], call["is_prefill"], strict=True)
        ]

    def mtp(
        self,
        batch: int,
        req_ids: list[Any],
        generator: Any,
        generators: Any,
        sampling: dict[str, Any],
        codes: torch.Tensor,
    ) -> None:
        self.mtp_calls.append(
            {
                "step": self.step,
                "batch": batch,
                "req_ids": list(req_ids),
                "generator": generator is not None,
                "generators": None if generators is None else [g is not None for g in generators],
                "sampling": dict(sampling),
                "codes": codes.tolist(),
            }
        )

    def step_mtp_codes(self) -> dict[Any, list[int]]:
        """This step's predictor codes by request id (the rows' ids as :meth:`mtp` mapped them)."""
        found: dict[Any, list[int]] = {}
        for call in self.mtp_calls:
            if call["step"] == self.step:
                found.update(zip(call["req_ids"], call["codes"], strict=False))
        return found

    def forward(
        self,
        num_tokens: int,
        positions: torch.Tensor | None,
        used_embeds: bool,
        extra_kwargs: list[str],
        tokens: torch.Tensor | None = None,
        payload: dict[str, Any] | None = None,
    ) -> None:
        hooks = [c for c in self.hook_calls if c["step"] == self.step]
        flags = [f for c in hooks for f in c["is_prefill"]]
        if not hooks:
            phase = "unhooked"
        elif all(flags):
            phase = "prefill"
        elif not any(flags):
            phase = "decode"
        else:
            phase = "mixed"
        pos = [] if positions is None else positions.reshape(-1)[:num_tokens].tolist()
        self.forwards.append(
            {
                "step": self.step,
                "num_tokens": int(num_tokens),
                "positions": pos,
                "tokens": None if tokens is None else tokens.reshape(-1)[:num_tokens].tolist(),
                "used_embeds": used_embeds,
                "phase": phase,
                "hook_rows": sum(c["rows"] for c in hooks),
                "mtp_rows": sum(c["batch"] for c in self.mtp_calls if c["step"] == self.step),
                "extra_kwargs": sorted(extra_kwargs),
                "payload": {k: _describe(v) for k, v in (payload or {}).items()},
            }
        )
        self.step += 1

    def misuse(self, what: str) -> RuntimeError:
        msg = f"{what} is disabled by this model's config"
        self.error(msg)
        return RuntimeError(msg)

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(
            {
                "steps": self.step,
                "forwards": self.forwards,
                "hook_calls": self.hook_calls,
                "mtp_calls": self.mtp_calls,
                "errors": self.errors,
                "request_ids": self.request_ids,
                "codes": self.codes,
                "payload_tokens_checked": self.payload_tokens_checked,
                "thinker_payloads": self.thinker_payloads,
                "pending_hook_calls": [c for c in self.hook_calls if c["step"] == self.step],
            }
        )


def _describe(value: Any) -> Any:
    """A payload entry as plain values: shape, dtype and a checksum for a tensor."""
    if isinstance(value, torch.Tensor):
        return {
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
            "abs_sum": float(value.detach().abs().sum().item()),
            "nonzero_rows": int((value.detach().reshape(value.shape[0], -1) != 0).any(dim=-1).sum().item())
            if value.dim() >= 1 and value.shape[0]
            else 0,
        }
    return repr(value)


def _as_bool(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


# ---------------------------------------------------------------- code predictor


def _sample_rows(
    logits: torch.Tensor,
    do_sample: bool | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    generators: list[torch.Generator | None] | None,
) -> torch.Tensor:
    """Sample one code per row of ``logits`` (B, V); greedy when ``do_sample`` is false."""
    if do_sample is False:
        return logits.argmax(dim=-1)
    logits = logits.float() / max(float(temperature if temperature is not None else 1.0), 1e-5)
    if top_k is not None and 0 < int(top_k) < logits.shape[-1]:
        kth = torch.topk(logits, int(top_k), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and 0.0 < float(top_p) < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) - sorted_probs < float(top_p)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if generators is not None:
        rows = [
            torch.multinomial(probs[i : i + 1], 1, generator=generators[i]).view(1)
            for i in range(probs.shape[0])
        ]
        return torch.cat(rows)
    return torch.multinomial(probs, 1, generator=generator).view(-1)


class TinyCodePredictor(nn.Module):
    """A talker MTP code predictor: one head and one code embedding per codebook.

    ``forward(input_ids, inputs_embeds, last_talker_hidden, text_step, ...)`` returns
    ``(embeds (B, H), codes (B, num_codebooks))``. With ``generators`` (one per row,
    None for an unseeded row) each row samples from its own generator, so a seeded
    request reproduces its codes whatever else shares the batch.
    """

    def __init__(
        self,
        hidden_size: int,
        num_codebooks: int,
        codebook_size: int,
        record: OmniRecord,
        row_ids: Callable[[int], list[Any]] | None = None,
    ) -> None:
        super().__init__()
        self.num_codebooks = num_codebooks
        self.heads = nn.ModuleList(
            nn.Linear(hidden_size, codebook_size, bias=False) for _ in range(num_codebooks)
        )
        self.code_embeds = nn.ModuleList(
            nn.Embedding(codebook_size, hidden_size) for _ in range(num_codebooks)
        )
        self._record = record
        # Which requests the rows of a call are (for the record): the talker knows its
        # step's MTP-routed rows; the predictor itself sees only tensors.
        self._row_ids = row_ids if row_ids is not None else (lambda batch: [None] * batch)

    def forward(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        generators: list[torch.Generator | None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._predict(
            input_ids,
            inputs_embeds,
            last_talker_hidden,
            text_step,
            do_sample,
            temperature,
            top_k,
            top_p,
            generator,
            generators,
        )

    def _predict(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        do_sample: bool | None,
        temperature: float | None,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
        generators: list[torch.Generator | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = int(inputs_embeds.shape[0])
        for name, t in (
            ("input_ids", input_ids),
            ("last_talker_hidden", last_talker_hidden),
            ("text_step", text_step),
        ):
            if int(t.shape[0]) != batch:
                raise ValueError(f"talker_mtp: {name} has {t.shape[0]} rows, inputs_embeds has {batch}")
        if generators is not None:
            if generator is not None:
                raise ValueError("talker_mtp: pass generator or generators, not both")
            if len(generators) != batch:
                raise ValueError(f"talker_mtp: {len(generators)} generators for {batch} rows")
        hidden = inputs_embeds + last_talker_hidden + text_step
        codes = []
        for head, embed in zip(self.heads, self.code_embeds, strict=True):
            code = _sample_rows(head(hidden), do_sample, temperature, top_k, top_p, generator, generators)
            codes.append(code)
            hidden = hidden + embed(code)
        codes_t = torch.stack(codes, dim=-1)
        self._record.mtp(
            batch,
            self._row_ids(batch),
            generator,
            generators,
            {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p},
            codes_t,
        )
        return hidden, codes_t


class TinyCodePredictorSharedGenerator(TinyCodePredictor):
    """A code predictor that takes one ``generator`` only (no per-row ``generators``)."""

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._predict(
            input_ids,
            inputs_embeds,
            last_talker_hidden,
            text_step,
            do_sample,
            temperature,
            top_k,
            top_p,
            generator,
            None,
        )


# ------------------------------------------------------------------------- models


class _TinyLlamaStage(nn.Module):
    """Shared trunk: vLLM's LlamaModel + LM head, and the record."""

    STAGE = ""
    """The ``omnigen_stage`` the HF config must name for this class."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.model_executor.models.llama import LlamaModel
        from vllm.model_executor.models.utils import maybe_prefix

        config = vllm_config.model_config.hf_config
        self.config = config
        self.variant = TalkerVariant.from_config(config)
        if self.variant.stage != self.STAGE:
            raise ValueError(
                f"{type(self).__name__} needs omnigen_stage={self.STAGE!r}, got {self.variant.stage!r}"
            )
        self.omni_record = OmniRecord()
        self.model = LlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def _trunk(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any,
        inputs_embeds: torch.Tensor | None,
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, intermediate_tensors, inputs_embeds)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"tiny omni models run on one pipeline rank; trunk gave {type(hidden).__name__}")
        return hidden

    def _finish_forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        extra_kwargs: dict[str, Any],
        payload: dict[str, Any],
    ) -> OmniOutput:
        self.omni_record.forward(
            num_tokens=hidden.shape[0],
            positions=positions,
            used_embeds=inputs_embeds is not None,
            extra_kwargs=list(extra_kwargs),
            tokens=input_ids,
            payload=payload,
        )
        return OmniOutput(text_hidden_states=hidden, multimodal_outputs=payload)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.models.utils import AutoWeightsLoader

        return AutoWeightsLoader(self).load_weights(weights)


class OmnigenTinyThinker(_TinyLlamaStage):
    """A thinker stage: text from vLLM's sampler, one hidden row per token for the talker."""

    STAGE = "thinker"

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> OmniOutput:
        hidden = self._trunk(input_ids, positions, intermediate_tensors, inputs_embeds)
        return self._finish_forward(
            hidden, input_ids, positions, inputs_embeds, kwargs, {"hidden": hidden.clone()}
        )


class OmnigenTinyTalker(_TinyLlamaStage):
    """A talker stage: hooks and code predictor chosen by the config knobs."""

    STAGE = "talker"

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        v = self.variant
        if v.mtp:
            predictor_cls = (
                TinyCodePredictor if v.mtp_per_row_generators else TinyCodePredictorSharedGenerator
            )
            self.talker_mtp = predictor_cls(
                self.config.hidden_size,
                v.num_codebooks,
                v.codebook_size,
                self.omni_record,
                row_ids=self._mtp_row_ids,
            )

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> OmniOutput:
        hidden = self._trunk(input_ids, positions, intermediate_tensors, inputs_embeds)
        self._note_thinker_payload(kwargs.get("model_intermediate_buffer"))
        codes = self._step_codes(int(hidden.shape[0]), hidden.device, kwargs.get("model_intermediate_buffer"))
        return self._finish_forward(
            hidden, input_ids, positions, inputs_embeds, kwargs, {"codes.audio": codes}
        )

    def _note_thinker_payload(self, buffers: Any) -> None:
        """Like a real talker reading the thinker's hidden states from its buffer (CONTRACT 4.2):
        record each request's ``thinker.hidden`` (what the glue function sent it)."""
        if not isinstance(buffers, (list, tuple)):
            return
        for buffer in buffers:
            if not isinstance(buffer, dict):
                continue
            thinker = buffer.get("thinker")
            if isinstance(thinker, dict) and "hidden" in thinker:
                self.omni_record.thinker_payload(buffer.get("request_id"), thinker["hidden"])

    def _mtp_routed(self, span: int, is_prefill: bool | None) -> bool:
        return self.variant.mtp and span == 1 and is_prefill is False

    def _mtp_row_ids(self, batch: int) -> list[Any]:
        """The request ids of the next ``batch`` MTP rows of this step (row order, CONTRACT 3.4)."""
        record = self.omni_record
        routed = [rid for rid, span, pre in record.step_rows() if self._mtp_routed(span, pre)]
        done = sum(len(call["req_ids"]) for call in record.mtp_calls if call["step"] == record.step)
        ids = routed[done : done + batch]
        return ids + [None] * (batch - len(ids))

    def _step_codes(self, num_tokens: int, device: torch.device, buffers: Any) -> torch.Tensor:
        """One row of codes per token: an MTP row's codes from its buffer, else placeholders.

        The runner hands the rows' buffers in batch order (``model_intermediate_buffer``);
        the codes there must be the ones the predictor produced this step for that request.
        """
        record = self.omni_record
        codes = torch.full((num_tokens, self.variant.num_codebooks), PLACEHOLDER_CODE, dtype=torch.long)
        rows = record.step_rows()
        if not rows:  # vLLM's dummy/profile runs call the model without the runner's preprocess
            return codes.to(device)
        if not isinstance(buffers, (list, tuple)) or len(buffers) != len(rows):
            record.error(
                f"forward got {type(buffers).__name__} buffers for {len(rows)} rows "
                f"({0 if not isinstance(buffers, (list, tuple)) else len(buffers)} given)"
            )
            return codes.to(device)
        predicted = record.step_mtp_codes()
        offset = 0
        for (req_id, span, is_prefill), buffer in zip(rows, buffers, strict=True):
            if buffer.get("request_id") != req_id:
                record.error(f"row buffer of {buffer.get('request_id')!r} where the hooks saw {req_id!r}")
            elif self._mtp_routed(span, is_prefill):
                held = (buffer.get("codes") or {}).get("audio")
                frame = None if held is None else held.reshape(-1).tolist()
                if frame is None or frame != predicted.get(req_id):
                    record.error(
                        f"{req_id}: buffer codes {frame} are not this step's {predicted.get(req_id)}"
                    )
                elif offset < num_tokens:
                    codes[offset] = torch.tensor(frame, dtype=torch.long)
                    record.codes.setdefault(req_id, []).append(frame)
            offset += span
        if offset > num_tokens:
            record.error(f"rows span {offset} tokens, the forward has {num_tokens}")
        return codes.to(device)

    # -- hooks (docs/contract.md 3) -------------------------------------------------

    def _text_step(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Stand-in for the trailing text embedding a real talker adds per step.
        return 0.5 * self.embed_input_ids(input_ids)

    def preprocess(
        self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **req_infos: Any
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if not self.variant.preprocess:
            raise self.omni_record.misuse("preprocess")
        span = int(input_ids.shape[0])
        if int(input_embeds.shape[0]) != span:
            raise ValueError(f"preprocess: {span} ids but {input_embeds.shape[0]} embeddings")
        self.omni_record.hook("preprocess", [span], [req_infos])
        # The runner passes its persistent inputs_embeds rows, which vLLM leaves unfilled for a
        # text-only model: like a real talker, build this row's embeddings from its ids.
        embeds = self.embed_input_ids(input_ids)
        seen = int((req_infos.get("meta") or {}).get("hook_calls", 0))
        update: dict[str, Any] = {"meta": {"hook_calls": seen + 1, "last_span": span}}
        if self._mtp_routed(span, _as_bool(req_infos.get("_omni_is_prefill"))):
            update["mtp_inputs"] = (embeds[-1:].clone(), self._text_step(input_ids[-1:]))
        return input_ids, embeds, update

    def preprocess_decode_batch(self, input_ids: torch.Tensor, req_infos: list[dict[str, Any]]) -> tuple:
        mode = self.variant.decode_batch
        if mode == "none":
            raise self.omni_record.misuse("preprocess_decode_batch")
        rows = len(req_infos)
        if int(input_ids.shape[0]) != rows:
            raise ValueError(f"preprocess_decode_batch: {input_ids.shape[0]} ids for {rows} rows")
        self.omni_record.hook("preprocess_decode_batch", [1] * rows, req_infos)
        embeds = self.embed_input_ids(input_ids)
        updates = [
            {"meta": {"hook_calls": int((info.get("meta") or {}).get("hook_calls", 0)) + 1, "last_span": 1}}
            for info in req_infos
        ]
        if mode == "mtp":
            return input_ids, embeds, embeds.clone(), self._text_step(input_ids), updates
        return input_ids, embeds, updates


class OmnigenTinyCode2Wav(_TinyLlamaStage):
    """A generation stage: each scheduled code becomes ``hop_length`` audio samples."""

    STAGE = "code2wav"

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.vocoder = nn.Linear(self.config.hidden_size, self.variant.hop_length, bias=True)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> OmniOutput:
        hidden = self._trunk(input_ids, positions, intermediate_tensors, inputs_embeds)
        self._check_payload_codes(input_ids, positions, kwargs)
        # Dummy weights are ~1e-3: scale so the samples are not all ~0.
        audio = torch.tanh(1e3 * self.vocoder(hidden))
        output = self._finish_forward(hidden, input_ids, positions, inputs_embeds, kwargs, {"audio": audio})
        counts = kwargs.get("seq_token_counts")
        if counts:
            # Like the real code2wav classes (CONTRACT 7.3): one entry per request, its own rows.
            output = output._replace(multimodal_outputs={"audio": list(torch.split(audio, list(counts)))})
        return output

    def _check_payload_codes(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, kwargs: dict[str, Any]
    ) -> None:
        """Like a real code2wav reading its codes from the request's buffer (CONTRACT 4.2): where a
        request's payload carried ``codes.audio``, each scheduled token must be that code."""
        buffers = kwargs.get("model_intermediate_buffer")
        counts = kwargs.get("seq_token_counts")
        if input_ids is None or not isinstance(buffers, (list, tuple)) or not counts:
            return
        tokens, places = input_ids.reshape(-1).tolist(), positions.reshape(-1).tolist()
        start = 0
        for buffer, count in zip(buffers, counts, strict=False):
            codes = (buffer.get("codes") or {}).get("audio") if isinstance(buffer, dict) else None
            if isinstance(codes, torch.Tensor):
                expected = talker_to_code2wav({"codes.audio": codes})
                for token, place in zip(
                    tokens[start : start + count], places[start : start + count], strict=True
                ):
                    if place >= len(expected) or expected[place] != token:
                        self.omni_record.error(f"token {token} at {place} is not the payload's code")
                self.omni_record.payload_tokens_checked += count
            start += count
