"""A deterministic dummy talker model for differential runner tests.

The model is torch-only and tiny (hidden size 8). Everything it computes is a pure
function of what the runner hands it (token ids, the request's phase facts, the
request's buffer, the embeddings it is given) plus, for the code predictor, the
random generator the runner passes. Arithmetic is integer hashing followed by
elementwise float ops that IEEE rounds exactly (``+``, ``*``, ``/``), never
transcendental functions or reductions over a batch dimension, so a row's result
does not depend on how many rows share a call or on SIMD tails.

What the runner does to the model is recorded in ``model.calls`` (one dict per
hook call). The harness slices that log per scheduler step.

Policy flags live on the *instance* and are only set when on: the oracle runner
probes several of them with ``hasattr``/``getattr``, so an attribute that exists
with a falsy value is not the same as an absent one (``has_preprocess`` is the
case that matters). ``ModelFlags`` is the one place that says which attribute
each flag becomes; see ``ModelFlags.apply``.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass, fields
from typing import Any

import torch

HIDDEN = 8
NUM_CODES = 4
CODEBOOK = 64
ID_REWRITE_MOD = 5  # ids divisible by this are rewritten by the hooks (+7)

# Request-info keys the dummy reads. Everything else a runner puts into the infos
# is only listed (by name) in the call log, never used for a value.
CONTRACT_INFO_KEYS = ("request_id", "_omni_prompt_len", "_omni_num_computed_tokens", "_omni_is_prefill")


def stable_code(text: str) -> int:
    """A process-independent small integer for a string (``hash`` is salted)."""
    return zlib.crc32(text.encode()) % 997


def _int_features(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """(n,) int64 -> (n, HIDDEN) float32 in [0, 1), exact and batch-independent."""
    cols = torch.arange(1, HIDDEN + 1, dtype=torch.int64)
    mixed = (keys.to(torch.int64)[:, None] * (31 * cols[None, :] + 7) + salt * cols[None, :]) % 1009
    return mixed.to(torch.float32) / 1009.0


@dataclass(frozen=True)
class ModelFlags:
    """The model-side switches the oracle runner probes at run time.

    Field -> instance attribute it becomes (only set when on / not None):
      has_preprocess               -> has_preprocess = True (absent otherwise)
      refresh_buffers              -> enable_update_additional_information = True
      mtp                          -> talker_mtp = <DummyCodePredictor> (absent otherwise)
      separate_talker              -> talker = object()  (legacy "auto" graph policy input)
      mtp_graph_safe (None/bool)   -> talker_mtp_graph_safe
      per_row_generators           -> talker_mtp_accepts_per_row_generators = True
      mtp_output_key               -> talker_mtp_output_key (set always when mtp)
      mtp_hidden_size (0 = unset)  -> mtp_hidden_size
      mtp_validity_key             -> talker_mtp_validity_key
      mtp_accepts_req_infos        -> talker_mtp_accepts_req_infos = True
      gpu_resident_keys            -> gpu_resident_buffer_keys (set when non-empty)
      decode_batching none|mtp|plain -> preprocess_decode_batch = 5-tuple / 3-tuple hook
      batch_hook                   -> preprocess_batch (one call per step before the rows; the
                                      oracle probes it, line 1602; qwen3_tts has one)
      replace_snapshots            -> replace_runtime_additional_information = True
      multimodal_outputs           -> have_multimodal_outputs = True
      decode_step_metadata         -> supports_omni_decode_step_metadata = True plus the
                                      update_decode_step_metadata / finish_decode_step_forward hooks
      attach_request_features      -> the instance's class is named
                                      "MiMoAudioForConditionalGeneration" (the oracle checks the
                                      class name, nothing else)
      multimodal_inputs            -> requires_raw_input_tokens = False and embed_input_ids
                                      (used by vLLM's multimodal path)
      make_omni_output             -> make_omni_output (a forward result that is not an
                                      OmniOutput goes through it, CONTRACT 7.2)
      set_batch_req_ids            -> set_batch_req_ids (logged; called after the forward)
      query_start_loc              -> supports_omni_query_start_loc = True (the oracle then
                                      passes omni_query_start_loc to the forward and the
                                      decode-step metadata, CONTRACT 7.7)

    One switch is the dummy's own behaviour, not something a runner probes:
      empty_first_update           -> the hooks may return an empty update for a request whose
                                      infos carry no ``meta`` yet (no buffer content so far); with
                                      False, an empty update comes only once the request's infos
                                      have a ``meta`` (the rule of which steps are empty is
                                      otherwise the same)
    """

    has_preprocess: bool = True
    refresh_buffers: bool = False
    mtp: bool = True
    separate_talker: bool = False
    mtp_graph_safe: bool | None = None
    per_row_generators: bool = False
    mtp_output_key: tuple[str, str] = ("codes", "audio")
    mtp_hidden_size: int = 0
    mtp_validity_key: tuple[str, str] | None = None
    mtp_accepts_req_infos: bool = False
    gpu_resident_keys: frozenset = frozenset()
    decode_batching: str = "none"
    batch_hook: bool = False
    replace_snapshots: bool = False
    multimodal_outputs: bool = True
    decode_step_metadata: bool = False
    attach_request_features: bool = False
    multimodal_inputs: bool = False
    make_omni_output: bool = False
    set_batch_req_ids: bool = False
    query_start_loc: bool = False
    empty_first_update: bool = True

    def __post_init__(self) -> None:
        if self.decode_batching not in ("none", "mtp", "plain"):
            raise ValueError(f"decode_batching must be none|mtp|plain, got {self.decode_batching!r}")
        if self.decode_batching == "mtp" and not self.mtp:
            raise ValueError("decode_batching='mtp' (5-tuple hook) needs mtp=True")
        if self.decode_batching == "plain" and self.mtp:
            raise ValueError("decode_batching='plain' (3-tuple hook) needs mtp=False")
        if len(self.mtp_output_key) != 2:
            raise ValueError("mtp_output_key must have two parts")


class DummyCodePredictor:
    """The ``talker_mtp`` callable: ``(ids, embeds, last_hidden, text_step, **kw) -> (embeds, codes)``."""

    def __init__(self, owner: DummyTalkerModel) -> None:
        self.owner = owner

    # The keyword arguments a runner may pass; the call log lists which ones it did pass
    # (``kwargs``), so ``generator=None`` passed explicitly differs from no ``generator``.
    KEYWORDS = (
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "generator",
        "generators",
        "req_ids",
        "req_infos",
    )

    def __call__(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        unknown = sorted(set(kwargs) - set(self.KEYWORDS))
        if unknown:
            raise TypeError(f"talker_mtp() got unexpected keyword arguments {unknown}")
        do_sample = kwargs.get("do_sample")
        temperature = kwargs.get("temperature")
        top_k = kwargs.get("top_k")
        top_p = kwargs.get("top_p")
        generator: torch.Generator | None = kwargs.get("generator")
        generators: list[torch.Generator | None] | None = kwargs.get("generators")
        req_ids: list[str] | None = kwargs.get("req_ids")
        req_infos: list[dict] | None = kwargs.get("req_infos")
        model = self.owner
        rows = int(input_ids.shape[0])
        ids = input_ids.reshape(-1).to(torch.int64)
        limit = int(top_k) if isinstance(top_k, int) and top_k > 0 else CODEBOOK
        codes = torch.empty((rows, NUM_CODES), dtype=torch.int64)
        for row in range(rows):
            if do_sample is False:
                codes[row] = (ids[row] * 13 + torch.arange(NUM_CODES)) % limit
                continue
            # A graph-wrapped predictor is handed a batch padded past the real rows; the
            # padding rows have no entry in ``generators``.
            if generators is not None and row < len(generators) and generators[row] is not None:
                gen = generators[row]
            elif generator is not None:
                gen = generator
            else:
                gen = model.default_generator
            draws = torch.randint(0, limit, (NUM_CODES,), generator=gen, dtype=torch.int64)
            codes[row] = (draws + ids[row]) % limit
        code_term = (codes.sum(dim=1, keepdim=True) % 97).to(torch.float32) / 128.0
        embeds = inputs_embeds.to(torch.float32) + last_talker_hidden * 0.5 + text_step * 0.25 + code_term
        model._log(
            "talker_mtp",
            rows=rows,
            req_ids=list(req_ids) if req_ids is not None else None,
            ids=ids.tolist(),
            generator=generator is not None,
            generators=None if generators is None else [g is not None for g in generators],
            sampling=(do_sample, temperature, top_k, top_p),
            forward_context=model.forward_context_stack[-1] if model.forward_context_stack else None,
            req_info_keys=None if req_infos is None else [sorted(i) for i in req_infos],
            kwargs=sorted(kwargs),
            codes=codes.tolist(),
        )
        return embeds.to(inputs_embeds.dtype), codes


class DummyTalkerModel:
    """Deterministic stand-in for a talker stage model (see module docstring)."""

    def __init__(self, flags: ModelFlags | None = None, *, seed: int = 0) -> None:
        self.flags = flags or ModelFlags()
        self.seed = seed
        self.calls: list[dict[str, Any]] = []
        self.default_generator = torch.Generator().manual_seed(seed)
        # Set by the harness: the OmniOutput class the runner under test recognizes,
        # and what kind of object the next forward returns.
        self.omni_output_cls: type | None = None
        self.forward_output_kind = "omni"
        self.last_forward_output: Any = None
        # The harness points this at its stack of (cudagraph mode, padded tokens) entries
        # for the platform forward context the runner is inside; the predictor logs the top.
        self.forward_context_stack: list = []
        self.flags_apply()

    # ----------------------------------------------------------------- flags
    def flags_apply(self) -> None:
        f = self.flags
        if f.has_preprocess:
            self.has_preprocess = True
        if f.refresh_buffers:
            self.enable_update_additional_information = True
        if f.mtp:
            self.talker_mtp = DummyCodePredictor(self)
            self.talker_mtp_output_key = tuple(f.mtp_output_key)
            if f.mtp_graph_safe is not None:
                self.talker_mtp_graph_safe = f.mtp_graph_safe
            if f.per_row_generators:
                self.talker_mtp_accepts_per_row_generators = True
            if f.mtp_hidden_size:
                self.mtp_hidden_size = f.mtp_hidden_size
            if f.mtp_validity_key is not None:
                self.talker_mtp_validity_key = tuple(f.mtp_validity_key)
            if f.mtp_accepts_req_infos:
                self.talker_mtp_accepts_req_infos = True
        if f.separate_talker:
            self.talker = object()
        if f.gpu_resident_keys:
            self.gpu_resident_buffer_keys = set(f.gpu_resident_keys)
        if f.decode_batching == "mtp":
            self.preprocess_decode_batch = self._preprocess_decode_batch_mtp
        elif f.decode_batching == "plain":
            self.preprocess_decode_batch = self._preprocess_decode_batch_plain
        if f.batch_hook:
            self.preprocess_batch = self._preprocess_batch
        if f.replace_snapshots:
            self.replace_runtime_additional_information = True
        if f.multimodal_outputs:
            self.have_multimodal_outputs = True
        if f.decode_step_metadata:
            self.supports_omni_decode_step_metadata = True
            self.update_decode_step_metadata = self._update_decode_step_metadata
            self.finish_decode_step_forward = self._finish_decode_step_forward
        if f.multimodal_inputs:
            self.requires_raw_input_tokens = False
            self.embed_input_ids = self._embed_input_ids
        if f.make_omni_output:
            self.make_omni_output = self._make_omni_output
        if f.query_start_loc:
            self.supports_omni_query_start_loc = True
        if f.set_batch_req_ids:
            self.set_batch_req_ids = self._set_batch_req_ids

    # ------------------------------------------------------- state handling
    def reset(self) -> None:
        """Back to the state right after construction (log empty, generator reseeded)."""
        self.calls.clear()
        self.default_generator = torch.Generator().manual_seed(self.seed)
        self.forward_output_kind = "omni"
        self.last_forward_output = None

    def clone(self) -> DummyTalkerModel:
        """A fresh instance with the same flags and the same *current* state."""
        other = make_model(self.flags, seed=self.seed)
        other.calls = copy.deepcopy(self.calls)
        other.default_generator.set_state(self.default_generator.get_state())
        other.omni_output_cls = self.omni_output_cls
        other.forward_output_kind = self.forward_output_kind
        other.forward_context_stack = self.forward_context_stack
        return other

    def _log(self, hook: str, **entry: Any) -> None:
        self.calls.append({"hook": hook, **entry})

    # -------------------------------------------------------------- helpers
    @staticmethod
    def _buffer_scalar(infos: dict) -> int:
        """An int summarizing what the request's buffer holds (so buffer bugs show)."""
        total = 0
        meta = infos.get("meta")
        if isinstance(meta, dict):
            total += int(meta.get("steps_seen", 0) or 0) * 3
            total += int(meta.get("bias", 0) or 0)
        codes = infos.get("codes")
        if isinstance(codes, dict):
            audio = codes.get("audio")
            if isinstance(audio, torch.Tensor) and audio.numel():
                total += int(audio.to(torch.int64).sum()) % 101
        alt = infos.get("audio_codes")
        if isinstance(alt, dict) and isinstance(alt.get("current"), torch.Tensor):
            total += int(alt["current"].to(torch.int64).sum()) % 89
        if "note" in infos:
            total += 5
        return total % 1000

    def _phase(self, infos: dict) -> tuple[str, int, int, bool]:
        return (
            str(infos["request_id"]),
            int(infos["_omni_prompt_len"]),
            int(infos["_omni_num_computed_tokens"]),
            bool(infos["_omni_is_prefill"]),
        )

    def _rows_embed(self, ids: torch.Tensor, infos: dict, input_embeds: torch.Tensor | None) -> torch.Tensor:
        rid, prompt_len, computed, is_prefill = self._phase(infos)
        n = int(ids.numel())
        positions = torch.arange(computed, computed + n, dtype=torch.int64)
        salt = stable_code(rid) + 3 * self._buffer_scalar(infos) + (11 if is_prefill else 0) + prompt_len
        emb = _int_features(ids.reshape(-1) * 17 + positions, salt)
        if input_embeds is not None and tuple(input_embeds.shape) == (n, HIDDEN):
            emb = emb + input_embeds.to(torch.float32) * 0.125
        return emb

    @staticmethod
    def _rewrite_ids(ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids % ID_REWRITE_MOD == 0, ids + 7, ids)

    def _mtp_inputs(self, ids: torch.Tensor, infos: dict) -> tuple[torch.Tensor, torch.Tensor]:
        rid, _, computed, _ = self._phase(infos)
        key = ids.reshape(-1).to(torch.int64) + computed
        return _int_features(key, stable_code(rid) + 1), _int_features(key, stable_code(rid) + 2)

    def _update(self, infos: dict, emb: torch.Tensor, span: int) -> dict:
        rid, _, computed, _ = self._phase(infos)
        meta = infos.get("meta") if isinstance(infos.get("meta"), dict) else None
        if (stable_code(rid) + computed) % 7 == 0 and (self.flags.empty_first_update or meta is not None):
            return {}  # an empty update: the runner must cope (and write nothing)
        meta = meta or {}
        return {
            "meta": {"steps_seen": int(meta.get("steps_seen", 0) or 0) + 1, "last_span": span},
            "hidden_states": {"last": emb[-1:].clone()},
        }

    def _info_log(self, infos: dict) -> dict:
        rid, prompt_len, computed, is_prefill = self._phase(infos)
        mm = infos.get("mm_features")
        return {
            "req_id": rid,
            "phase": (prompt_len, computed, is_prefill),
            "keys": sorted(infos),
            "mm_features": list(mm) if isinstance(mm, (list, tuple)) else mm,
        }

    # ---------------------------------------------------------------- hooks
    def preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None, **req_infos: Any):
        span = int(input_ids.numel())
        emb = self._rows_embed(input_ids, req_infos, input_embeds)
        ids_out = self._rewrite_ids(input_ids)
        update = self._update(req_infos, emb, span)
        _, _, _, is_prefill = self._phase(req_infos)
        if self.flags.mtp and span == 1 and not is_prefill:
            update["mtp_inputs"] = self._mtp_inputs(input_ids, req_infos)
        info = self._info_log(req_infos)
        self._log(
            "preprocess",
            rows=1,
            span=span,
            req_ids=[info["req_id"]],
            phases=[info["phase"]],
            keys=[info["keys"]],
            mm_features=[info["mm_features"]],
            ids=input_ids.reshape(-1).tolist(),
            embeds_given=None if input_embeds is None else tuple(input_embeds.shape),
        )
        return ids_out, emb.to(torch.float32), update

    def _preprocess_batch(self, req_ids: list[str], model_intermediate_buffer: dict, device=None) -> None:
        """Whole-step hook: counts its calls in each existing buffer's meta (so timing shows)."""
        touched = []
        for rid in req_ids:
            buf = model_intermediate_buffer.get(rid)
            if isinstance(buf, dict):
                meta = buf.setdefault("meta", {})
                meta["batch_hook_calls"] = int(meta.get("batch_hook_calls", 0) or 0) + 1
                touched.append(rid)
        self._log("preprocess_batch", rows=len(req_ids), req_ids=list(req_ids), touched=touched)

    def _decode_rows(self, input_ids: torch.Tensor, req_infos: list[dict]):
        ids = input_ids.reshape(-1)
        embs, updates, hiddens, texts = [], [], [], []
        for row, infos in enumerate(req_infos):
            emb = self._rows_embed(ids[row : row + 1], infos, None)
            embs.append(emb)
            updates.append(self._update(infos, emb, 1))
            if self.flags.mtp:
                h, t = self._mtp_inputs(ids[row : row + 1], infos)
                hiddens.append(h)
                texts.append(t)
        infos_log = [self._info_log(i) for i in req_infos]
        self._log(
            "preprocess_decode_batch",
            rows=len(req_infos),
            span=1,
            req_ids=[i["req_id"] for i in infos_log],
            phases=[i["phase"] for i in infos_log],
            keys=[i["keys"] for i in infos_log],
            mm_features=[i["mm_features"] for i in infos_log],
            ids=ids.tolist(),
            embeds_given=None,
        )
        emb = torch.cat(embs) if embs else torch.empty((0, HIDDEN))
        return ids, emb, updates, hiddens, texts

    def _preprocess_decode_batch_mtp(self, input_ids: torch.Tensor, req_infos: list[dict]):
        ids, emb, updates, hiddens, texts = self._decode_rows(input_ids, req_infos)
        return self._rewrite_ids(ids), emb, torch.cat(hiddens), torch.cat(texts), updates

    def _preprocess_decode_batch_plain(self, input_ids: torch.Tensor, req_infos: list[dict]):
        ids, emb, updates, _, _ = self._decode_rows(input_ids, req_infos)
        # Hand back the very same tensor when nothing is rewritten (the runner must
        # then not copy), a new one otherwise.
        rewritten = bool((ids % ID_REWRITE_MOD == 0).any())
        return (self._rewrite_ids(ids) if rewritten else input_ids), emb, updates

    def _embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, is_multimodal=None):
        ids = input_ids.reshape(-1)
        self._log("embed_input_ids", rows=int(ids.numel()), ids=ids.tolist())
        return _int_features(ids, 5)

    # -------------------------------------------------------------- forward
    def __call__(
        self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        if inputs_embeds is not None:
            hidden = inputs_embeds.to(torch.float32) + 0.0
        else:
            hidden = _int_features(input_ids.reshape(-1), 9)
        codes = (hidden * 8).to(torch.int64) % CODEBOOK
        kind = self.forward_output_kind
        self._log(
            "forward",
            rows=int(hidden.shape[0]),
            kind=kind,
            ids_given=input_ids is not None,
            embeds_given=inputs_embeds is not None,
            kwargs=sorted(kwargs),
        )
        if kind == "tensor":
            out: Any = hidden
        elif kind == "aux_tuple":
            out = (hidden, hidden * 0.5)
        else:
            if self.omni_output_cls is None:
                raise RuntimeError("harness must set model.omni_output_cls before a forward")
            out = self.omni_output_cls(hidden, {"codes": {"audio": codes}}, None, None)
            if kind == "flat_tuple":
                out = tuple(out)  # what CUDA-graph weak-referencing makes of a NamedTuple
        self.last_forward_output = out
        return out

    def _make_omni_output(self, output: Any, **kwargs: Any) -> Any:
        # Wraps whatever the forward returned; the log lists the kwargs it was given.
        hidden = output[0] if isinstance(output, tuple) else output
        self._log("make_omni_output", rows=int(hidden.shape[0]), kwargs=sorted(kwargs))
        codes = (hidden.to(torch.float32) * 8).to(torch.int64) % CODEBOOK
        return self.omni_output_cls(hidden, {"codes": {"audio": codes}}, None, None)

    def _set_batch_req_ids(self, req_ids: Any) -> None:
        self._log("set_batch_req_ids", rows=len(req_ids), req_ids=list(req_ids))

    def _update_decode_step_metadata(self, **kwargs):
        # Keyword-only, as both runners call it; the log lists the names passed.
        req_ids = kwargs.get("req_ids")
        self._log(
            "update_decode_step_metadata",
            rows=len(req_ids or ()),
            req_ids=list(req_ids or ()),
            kwargs=sorted(kwargs),
        )

    def _finish_decode_step_forward(self) -> None:
        self._log("finish_decode_step_forward", rows=0)


def make_model(flags: ModelFlags | None = None, *, seed: int = 0) -> DummyTalkerModel:
    """Build a dummy model; with ``attach_request_features`` its class carries MiMo's name."""
    flags = flags or ModelFlags()
    cls: type[DummyTalkerModel] = DummyTalkerModel
    if flags.attach_request_features:
        cls = _MIMO_CLASS
    return cls(flags, seed=seed)


# The oracle recognizes MiMo-Audio's fused stage by class name only.
_MIMO_CLASS = type("MiMoAudioForConditionalGeneration", (DummyTalkerModel,), {})


def flag_fields() -> list[str]:
    return [f.name for f in fields(ModelFlags)]


__all__ = [
    "CODEBOOK",
    "CONTRACT_INFO_KEYS",
    "HIDDEN",
    "NUM_CODES",
    "DummyCodePredictor",
    "DummyTalkerModel",
    "ModelFlags",
    "flag_fields",
    "make_model",
    "stable_code",
]
