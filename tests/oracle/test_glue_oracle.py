"""Differential test: omnigen's glue functions against vllm-omni 0.30's stage input processors.

For each function of ``omnigen.glue`` and several seeded random inputs, the same finished
producer request is given to vllm-omni's functions in the shapes they read (the runner's
accumulated payload and a worker-side request for the ``*_full_payload`` builders, a
``RequestOutput``-like object and the caller's prompt for the orchestrator-side prompt
builders) and to omnigen's, and the results must be equal: tensors by dtype, shape and
values, lists, dicts and scalars exactly.

Where vllm-omni splits an edge in two (a producer-side payload builder and a consumer-side
prompt builder whose ``additional_information`` lands in the consumer's buffer first), the
expected payload is what the consumer ends up with: the prompt builder's information merged
one level deep with the payload over it (CONTRACT 4.1).

Where omnigen deliberately differs, the test says so by name (``DIFFERENCES``) and checks the
difference itself; nothing is compared loosely.

vllm-omni is imported only inside these tests: its import patches vLLM process-wide, so the
oracle group runs in a pytest process of its own (``-m oracle``).
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnigen.glue import GLUE, VLLM_OMNI_EQUIVALENTS, GlueError, NextStageInput, StageResult

if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

SEEDS = range(24)
P = "vllm_omni.model_executor.stage_input_processors"

DIFFERENCES = {
    "error_instead_of_none": (
        "where vllm-omni's builder returns None (its log: 'consumer wait gate may hang') or an empty "
        "prompt, omnigen raises GlueError naming the function and request"
    ),
    "no_none_entries": (
        "qwen3_omni.thinker2talker_full_payload stores embed.tts_bos/eos/pad = None when the thinker "
        "did not publish them; omnigen leaves them out (the talker reads them with .get)"
    ),
    "degenerate_prompt_matches_payload": (
        "qwen3_tts: for a take without a usable frame vllm-omni's payload is one placeholder frame but "
        "its prompt builder sizes the prompt from the (absent) frames, Q * ref_frames, and adds "
        "meta.left_context_size for a reference the payload does not prepend; omnigen's prompt has one "
        "position per placeholder code and no left context"
    ),
    "moss_multi_modal_data": (
        "moss_tts.talker2codec also returns multi_modal_data={'codes': {'audio': codes}}; the codec "
        "decodes its prompt ids only, and plain vLLM refuses an unregistered modality, so omnigen sends none"
    ),
}


@pytest.fixture(autouse=True)
def _vllm_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    # vllm-omni's general plugin must not load into any vLLM started here.
    monkeypatch.setenv("VLLM_PLUGINS", "omnigen")


def oracle(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


# -- comparison ---------------------------------------------------------------------------------


def assert_same(ours: Any, theirs: Any, where: str = "") -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), (
            f"{where}: omnigen has {type(ours).__name__}, vllm-omni a tensor"
        )
        assert ours.dtype == theirs.dtype, f"{where}: dtype {ours.dtype} != {theirs.dtype}"
        assert ours.device == theirs.device, f"{where}: device {ours.device} != {theirs.device}"
        assert tuple(ours.shape) == tuple(theirs.shape), (
            f"{where}: shape {tuple(ours.shape)} != {tuple(theirs.shape)}"
        )
        assert torch.equal(ours, theirs), f"{where}: values differ"
    elif isinstance(theirs, Mapping):
        assert isinstance(ours, Mapping), f"{where}: omnigen has {type(ours).__name__}, vllm-omni a dict"
        assert set(ours) == set(theirs), (
            f"{where}: keys {sorted(map(str, ours))} != {sorted(map(str, theirs))}"
        )
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}" if where else str(key))
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)), (
            f"{where}: omnigen has {type(ours).__name__}, vllm-omni a list"
        )
        assert len(ours) == len(theirs), f"{where}: length {len(ours)} != {len(theirs)}"
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert type(ours) is type(theirs) and ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def merged(first: Mapping[str, Any] | None, then: Mapping[str, Any] | None) -> dict[str, Any]:
    """The consumer's buffer after two merges (CONTRACT 4.1: one level deep)."""
    buffer: dict[str, Any] = {}
    for update in (first or {}, then or {}):
        for key, value in update.items():
            if isinstance(value, Mapping) and isinstance(buffer.get(key), dict):
                buffer[key].update(value)
            else:
                buffer[key] = dict(value) if isinstance(value, Mapping) else value
    return buffer


def plain(payload: Any) -> Any:
    """A vllm-omni payload struct as the dict its consumer gets (``to_dict``)."""
    if payload is None or isinstance(payload, dict):
        return payload
    return oracle("vllm_omni.data_entry_keys.to_dict")(payload)


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A dotted payload in the nested form a ``RequestOutput.multimodal_output`` has."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if "." in key:
            kind, qualifier = key.split(".", 1)
            out.setdefault(kind, {})[qualifier] = value
        else:
            out[key] = value
    return out


def entries(info: Mapping[str, list[Any]]) -> SimpleNamespace:
    """A request's ``additional_information`` as vllm-omni's serialized payload (entries with list_data)."""
    return SimpleNamespace(
        entries={key: SimpleNamespace(list_data=list(value)) for key, value in info.items()}
    )


def request_output(source: StageResult, multimodal_output: Any = None) -> SimpleNamespace:
    """What vllm-omni's orchestrator hands a prompt builder for a finished request."""
    completion = SimpleNamespace(
        token_ids=list(source.output_token_ids),
        cumulative_token_ids=list(source.output_token_ids),
        text=source.text,
        multimodal_output=multimodal_output,
    )
    return SimpleNamespace(
        request_id=source.request_id,
        finished=True,
        prompt_token_ids=list(source.prompt_token_ids),
        outputs=[completion],
    )


def worker_request(source: StageResult, **extra: Any) -> SimpleNamespace:
    """The worker-side request a ``*_full_payload`` builder is given."""
    fields = {
        "request_id": source.request_id,
        "external_req_id": source.request_id,
        "prompt_token_ids": list(source.prompt_token_ids),
        "output_token_ids": list(source.output_token_ids),
        "sampling_params": SimpleNamespace(seed=source.seed),
    }
    fields.update(extra)
    return SimpleNamespace(**fields)


def test_every_glue_function_has_its_oracle_named():
    assert set(VLLM_OMNI_EQUIVALENTS) == set(GLUE)
    for name, theirs in VLLM_OMNI_EQUIVALENTS.items():
        assert theirs, name
        for path in theirs:
            assert callable(oracle(path)), path


# -- qwen3_tts ----------------------------------------------------------------------------------


def qwen3_tts_case(rng: random.Random) -> StageResult:
    q = rng.choice([4, 8, 16])
    rows = []
    for _ in range(rng.randint(0, 24)):
        kind = rng.random()
        if kind < 0.15:
            rows.append([-1] * q)  # prefill placeholder
        elif kind < 0.25:
            rows.append([0] * q)  # padding
        elif kind < 0.3:
            rows.append([rng.randrange(2048) for _ in range(q - 1)] + [2048 + rng.randrange(5)])
        else:
            rows.append([rng.randrange(2048) for _ in range(q)])
    payload: dict[str, Any] = {"codes.audio": torch.tensor(rows, dtype=torch.long).reshape(-1, q)}
    if rng.random() < 0.5:
        ref_frames = rng.randint(1, 6)
        ref = torch.randint(0, 2048, (ref_frames, q))
        payload["codes.ref"] = [ref.reshape(-1) if rng.random() < 0.5 else ref]
        if rng.random() < 0.6:
            cut = rng.randint(0, ref_frames + 2)
            payload["meta.ref_code_len"] = torch.tensor([cut]) if rng.random() < 0.5 else cut
    valid = sum(1 for row in rows if min(row) >= 0 and any(row) and max(row) < 2048)
    n_out = max(0, valid + 1 + rng.choice([0, 0, -2, -5, 3]))
    info: dict[str, Any] = {}
    if rng.random() < 0.5:
        info["speaker"] = [rng.choice(["Vivian", "ryan"])]
    if rng.random() < 0.5:
        info["language"] = [rng.choice(["English", "Chinese"])]
    return StageResult(
        request_id=f"tts-{rng.randrange(10**6)}",
        prompt_token_ids=[rng.randrange(1000) for _ in range(rng.randint(1, 9))],
        output_token_ids=[rng.randrange(2048) for _ in range(n_out)],
        payload=payload,
        user_prompt={"prompt_token_ids": [1, 2], "additional_information": info},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_qwen3_tts_talker2code2wav(seed: int):
    from omnigen.glue import qwen3_tts

    source = qwen3_tts_case(random.Random(seed))
    ours = qwen3_tts.talker2code2wav(source)
    payload = oracle(f"{P}.qwen3_tts.talker2code2wav_full_payload")(
        None, dict(source.payload), worker_request(source)
    )
    (prompt,) = oracle(f"{P}.qwen3_tts.talker2code2wav_token_only")(
        [request_output(source, nested(source.payload))], source.user_prompt
    )
    info = prompt["additional_information"] or {}
    if not qwen3_tts.valid_frames(source.payload["codes.audio"]).numel():
        # DIFFERENCES["degenerate_prompt_matches_payload"]
        assert_same(ours.payload, merged({k: v for k, v in info.items() if k != "meta"}, payload))
        assert ours.prompt_token_ids == [0] * payload["codes"]["audio"].numel()
        return
    assert_same(ours.payload, merged(info, payload))
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])
    assert len(ours.prompt_token_ids) == ours.payload["codes"]["audio"].numel()


# -- qwen3_omni ---------------------------------------------------------------------------------

IM_START, SYSTEM, USER, ASSISTANT = 151644, 8948, 872, 77091


def chat_prompt(rng: random.Random) -> list[int]:
    ids: list[int] = []
    turns = [SYSTEM] * rng.randint(0, 1) + [
        rng.choice([USER, USER, ASSISTANT]) for _ in range(rng.randint(1, 3))
    ]
    if rng.random() < 0.8:
        turns.append(ASSISTANT)
    for role in turns:
        ids += [IM_START, role] + [rng.randrange(1000, 5000) for _ in range(rng.randint(0, 6))]
    if ids[-1] == IM_START:  # pragma: no cover - the role always follows
        ids.append(USER)
    return ids


def qwen3_omni_thinker_case(rng: random.Random) -> tuple[StageResult, int]:
    prompt = chat_prompt(rng)
    output = [rng.randrange(1000, 5000) for _ in range(rng.randint(1, 8))]
    rows = len(prompt) + len(output) - 1 + rng.choice([0, 0, 1])
    hidden = 6
    layer = rng.choice([12, 18, 24])
    payload: dict[str, Any] = {f"hidden_states.layer_{layer}": torch.randn(rows, hidden)}
    if rng.random() < 0.8:
        payload["hidden_states.layer_0"] = torch.randn(rows, hidden)
    else:
        payload["hidden"] = torch.randn(rows, hidden)
    for name in ("tts_bos", "tts_eos", "tts_pad"):
        roll = rng.random()
        if roll < 0.4:
            payload[f"embed.{name}"] = torch.randn(1, hidden)
        elif roll < 0.7:
            payload[f"embed.{name}"] = [torch.randn(1, hidden)]
    given: dict[str, list[str]] = {}
    if rng.random() < 0.5:
        given["speaker"] = [rng.choice(["Ethan ", "CHELSIE"])]
    if rng.random() < 0.5:
        given["language"] = [rng.choice(["English", "Auto"])]
    prompt_info: dict[str, list[str]] = {}
    if rng.random() < 0.5:
        prompt_info["speaker"] = ["Aiden"]
    if rng.random() < 0.5:
        prompt_info["language"] = ["Chinese"]
    source = StageResult(
        request_id=f"omni-{rng.randrange(10**6)}",
        prompt_token_ids=prompt,
        output_token_ids=output,
        payload=payload,
        input_payload=given,
        user_prompt={"prompt_token_ids": prompt, "additional_information": prompt_info},
        hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=layer)),
    )
    return source, layer


@pytest.mark.parametrize("seed", SEEDS)
def test_qwen3_omni_thinker2talker(seed: int):
    from omnigen.glue import qwen3_omni

    source, _ = qwen3_omni_thinker_case(random.Random(seed))
    ours = qwen3_omni.thinker2talker(source)
    manager = SimpleNamespace(_get_model_config=lambda: SimpleNamespace(hf_config=source.hf_config))
    request = worker_request(source, additional_information=entries(dict(source.input_payload)))
    payload = oracle(f"{P}.qwen3_omni.thinker2talker_full_payload")(manager, dict(source.payload), request)
    (prompt,) = oracle(f"{P}.qwen3_omni.thinker2talker_token_only")(
        [request_output(source)], source.user_prompt
    )
    # DIFFERENCES["no_none_entries"]
    payload["embed"] = {key: value for key, value in payload["embed"].items() if value is not None}
    assert_same(ours.payload, merged(prompt["additional_information"], payload))
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])


def test_qwen3_omni_thinker2talker_missing_layer_is_an_error():
    from omnigen.glue import qwen3_omni

    source, layer = qwen3_omni_thinker_case(random.Random(1))
    payload = {k: v for k, v in source.payload.items() if k != f"hidden_states.layer_{layer}"}
    broken = StageResult(**{**source.__dict__, "payload": payload})
    manager = SimpleNamespace(_get_model_config=lambda: SimpleNamespace(hf_config=source.hf_config))
    theirs = oracle(f"{P}.qwen3_omni.thinker2talker_full_payload")(manager, payload, worker_request(broken))
    assert theirs is None  # DIFFERENCES["error_instead_of_none"]
    with pytest.raises(GlueError, match=f"hidden_states.layer_{layer}"):
        qwen3_omni.thinker2talker(broken)


def qwen3_omni_talker_case(rng: random.Random) -> StageResult:
    rows = rng.randint(1, 20)
    codes = torch.randint(0, 2048, (rows, 16))
    for row in rng.sample(range(rows), k=rng.randint(0, min(3, rows))):
        codes[row, rng.randrange(16)] = rng.choice([-1, 2048, 4196])
    n_out = max(1, rows + rng.choice([0, -1, -3, 2]))
    output = [rng.choice([rng.randrange(2048)] * 6 + [4196, 4197, 4198, 2150, -1]) for _ in range(n_out)]
    return StageResult(
        request_id=f"talker-{rng.randrange(10**6)}",
        prompt_token_ids=[0] * rng.randint(1, 9),
        output_token_ids=output,
        payload={"codes.audio": codes} if rng.random() < 0.7 else {"codes": {"audio": codes}},
        user_prompt={"prompt_token_ids": [1]},
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_qwen3_omni_talker2code2wav(seed: int):
    from omnigen.glue import qwen3_omni

    source = qwen3_omni_talker_case(random.Random(seed))
    payload = oracle(f"{P}.qwen3_omni.talker2code2wav_full_payload")(
        None, dict(source.payload), worker_request(source)
    )
    if payload is None:  # DIFFERENCES["error_instead_of_none"]
        with pytest.raises(GlueError):
            qwen3_omni.talker2code2wav(source)
        return
    # The code2wav stage has no input function; the orchestrator's default prompt (the talker's
    # output ids) is replaced in code2wav's scheduler when the payload arrives: the connector
    # extracts its codes.audio as scheduling metadata and the coordinator makes them the prompt
    # (generation mode), which the model decodes as the codes.
    transport = oracle(
        "vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport."
        "_OmniConnectorPayloadTransportMixin"
    )
    coordinator = oracle("vllm_omni.core.sched.omni_scheduling_coordinator.OmniSchedulingCoordinator")
    request = SimpleNamespace(
        prompt_token_ids=list(request_output(source).outputs[0].token_ids),
        num_prompt_tokens=0,
        _all_token_ids=[],
        _output_token_ids=[],
        num_computed_tokens=0,
    )
    metadata = transport._extract_scheduling_metadata(payload)
    coordinator.update_request_metadata(
        SimpleNamespace(
            input_terminal_req_ids=set(),
            _stage_id=2,
            _flatten_prompt_token_ids=coordinator._flatten_prompt_token_ids,
        ),
        {"r": request},
        {"r": metadata},
        "generation",
    )
    ours = qwen3_omni.talker2code2wav(source)
    assert_same(ours.payload, payload)
    assert_same(ours.prompt_token_ids, request.prompt_token_ids)
    assert ours.multi_modal_data is None


# -- qwen2_5_omni -------------------------------------------------------------------------------


def qwen2_5_thinker_case(rng: random.Random) -> tuple[StageResult, SimpleNamespace]:
    prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 10))]
    stop_id = 151645
    stopped = rng.random() < 0.6
    output = [rng.randrange(100, 5000) for _ in range(rng.randint(0 if not stopped else 0, 8))]
    if stopped:
        output.append(stop_id)
    rows = len(prompt) + len(output) - 1 + rng.choice([0, 0, 2, -len(prompt) - 3])
    source = StageResult(
        request_id=f"thinker-{rng.randrange(10**6)}",
        prompt_token_ids=prompt,
        output_token_ids=output,
        payload={"hidden": torch.randn(max(rows, 0), 5, dtype=rng.choice([torch.float32, torch.bfloat16]))},
        finish_reason="stop" if stopped else "length",
        stop_reason=None,
        user_prompt={"prompt_token_ids": prompt, "multi_modal_data": {"audio": [torch.zeros(3)]}},
    )
    status = SimpleNamespace(name="FINISHED_STOPPED" if stopped else "FINISHED_LENGTH_CAPPED")
    return source, status


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("request_kind", ["status", "worker"])
def test_qwen2_5_omni_thinker2talker(seed: int, request_kind: str):
    from omnigen.glue import qwen2_5_omni

    rng = random.Random(seed)
    source, status = qwen2_5_thinker_case(rng)
    if request_kind == "status":  # the scheduler's request: its status says how it finished
        request = worker_request(source, status=status)
    else:  # the runner's request state has no status: the last token is checked against the stop ids
        request = worker_request(
            source,
            sampling_params=SimpleNamespace(stop_token_ids=[], ignore_eos=False, eos_token_id=151645),
        )
    payload = oracle(f"{P}.qwen2_5_omni.thinker2talker_full_payload")(None, dict(source.payload), request)
    requires_mm = rng.random() < 0.5
    (prompt,) = oracle(f"{P}.qwen2_5_omni.thinker2talker_token_only")(
        [request_output(source)], source.user_prompt, requires_mm
    )
    if payload is None:  # DIFFERENCES["error_instead_of_none"]
        with pytest.raises(GlueError):
            qwen2_5_omni.thinker2talker(source, requires_multimodal_data=requires_mm)
        return
    ours = qwen2_5_omni.thinker2talker(source, requires_multimodal_data=requires_mm)
    assert_same(ours.payload, merged(prompt["additional_information"], payload))
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])
    assert ours.multi_modal_data is prompt["multi_modal_data"]


@pytest.mark.parametrize("seed", SEEDS)
def test_qwen2_5_omni_talker2code2wav(seed: int):
    from omnigen.glue import qwen2_5_omni

    rng = random.Random(seed)
    output = [
        rng.choice([rng.randrange(8292)] * 5 + [8292, 8293, 8294, 9000]) for _ in range(rng.randint(0, 14))
    ]
    if rng.random() < 0.4:
        output.append(8294)
    if rng.random() < 0.3:
        output += [-1] * rng.randint(1, 3)
    source = StageResult(request_id=f"t-{seed}", prompt_token_ids=[8293, 8292, 8294], output_token_ids=output)
    payload = oracle(f"{P}.qwen2_5_omni.talker2code2wav_full_payload")(None, {}, worker_request(source))
    prompts = oracle(f"{P}.qwen2_5_omni.talker2code2wav_token_only")([request_output(source)])
    if payload is None:  # DIFFERENCES["error_instead_of_none"]; the prompt builder drops the request
        assert prompts == []
        with pytest.raises(GlueError):
            qwen2_5_omni.talker2code2wav(source)
        return
    ours = qwen2_5_omni.talker2code2wav(source)
    assert_same(ours.payload, payload)
    assert_same(ours.prompt_token_ids, prompts[0]["prompt_token_ids"])


# -- mimo_audio ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_mimo_audio_llm2code2wav(seed: int):
    from omnigen.glue import mimo_audio

    rng = random.Random(seed)
    groups = rng.choice([rng.randint(1, 12), 510])  # 510 groups pass the code2wav cap
    codes = torch.randint(0, 1024, (groups, 1, 8, 4))
    for group in rng.sample(range(groups), k=rng.randint(0, min(4, groups))):
        codes[group] = 0
    source = StageResult(
        request_id=f"mimo-{seed}",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[5] * groups,
        payload={"codes.audio": codes},
    )
    payload = oracle(f"{P}.mimo_audio.llm2code2wav_full_payload")(
        None, dict(source.payload), worker_request(source)
    )
    (prompt,) = oracle(f"{P}.mimo_audio.llm2code2wav_token_only")(
        [request_output(source, nested(source.payload))]
    )
    if payload is None:  # DIFFERENCES["error_instead_of_none"]
        with pytest.raises(GlueError):
            mimo_audio.llm2code2wav(source)
        return
    ours = mimo_audio.llm2code2wav(source)
    assert_same(ours.payload, payload)
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])


# -- minicpmo_4_5 -------------------------------------------------------------------------------


def minicpmo_llm_case(rng: random.Random) -> StageResult:
    prompt = [rng.randrange(100, 5000) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.4:
        prompt += [151703]  # <|tts_bos|> at the end of the template
    output = [rng.randrange(100, 5000) for _ in range(rng.randint(0, 8))]
    if output and rng.random() < 0.5:
        output.insert(rng.randrange(len(output)), rng.choice([151704, 151645]))
    rows = max(len(prompt) + len(output) - 1, 0)
    latent = torch.randn(rows, 4, dtype=rng.choice([torch.float32, torch.bfloat16]))
    payload: dict[str, Any] = {"latent": latent.unsqueeze(0) if rng.random() < 0.3 else latent}
    if rng.random() < 0.3:
        payload["meta"] = {
            "tts_bos_token_id": torch.tensor([prompt[0]]),
            "tts_eos_token_id": output[-1] if output else 7,
        }
    user: dict[str, Any] = {"prompt_token_ids": prompt}
    roll = rng.random()
    if roll < 0.3:
        user["multi_modal_data"] = {"audio": [(torch.randn(2, 6), 16000)]}
    elif roll < 0.5:
        user["multi_modal_data"] = {"audio": {"array": torch.randn(6, 2).tolist(), "sampling_rate": 24000}}
    elif roll < 0.6:
        user["_minicpmo45_reference_audio"] = (torch.randn(5), 22050)
    return StageResult(
        request_id=f"llm-{rng.randrange(10**6)}",
        prompt_token_ids=prompt,
        output_token_ids=output,
        payload=payload,
        text=rng.choice(["", "hello"]),
        user_prompt=user,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_minicpmo_4_5_llm2tts(seed: int):
    from omnigen.glue import minicpmo_4_5

    rng = random.Random(seed)
    source = minicpmo_llm_case(rng)
    requires_mm = rng.random() < 0.5
    output = request_output(source, multimodal_output=dict(source.payload))
    try:
        (prompt,) = oracle(f"{P}.minicpmo_4_5_omni.llm2tts")([output], source.user_prompt, requires_mm)
    except ValueError as error:  # no prompt token at all
        with pytest.raises(GlueError):
            minicpmo_4_5.llm2tts(source, requires_multimodal_data=requires_mm)
        assert "at least one" in str(error)
        return
    ours = minicpmo_4_5.llm2tts(source, requires_multimodal_data=requires_mm)
    assert_same(ours.payload, prompt["model_intermediate_buffer"])
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])
    assert ours.multi_modal_data is prompt["multi_modal_data"]


def test_minicpmo_4_5_llm2tts_refuses_duplex():
    from omnigen.glue import minicpmo_4_5

    source = minicpmo_llm_case(random.Random(3))
    duplex = StageResult(
        **{**source.__dict__, "payload": {**source.payload, "duplex_prompt_token_ids": [1, 2]}}
    )
    with pytest.raises(GlueError, match="full-duplex"):
        minicpmo_4_5.llm2tts(duplex)


@pytest.mark.parametrize("seed", SEEDS)
def test_minicpmo_4_5_tts2code2wav(seed: int):
    from omnigen.glue import minicpmo_4_5

    rng = random.Random(seed)
    steps = [torch.randint(0, 6561, (rng.randint(0, 3), 1)) for _ in range(rng.randint(1, 6))]
    given: dict[str, Any] = {}
    if rng.random() < 0.5:
        given["codes"] = {"ref": torch.randn(7).tolist()}
        given["meta"] = {"ref_audio_sr": 16000, "segment_end": rng.random() < 0.5}
    if rng.random() < 0.3:
        given["duplex"] = {"turn_id": 2, "epoch": torch.tensor([1])}
    source = StageResult(
        request_id=f"tts-{seed}",
        prompt_token_ids=[0] * 5,
        output_token_ids=[1] * len(steps),
        payload={"codes.audio": torch.cat(steps)},
        input_payload=given,
    )
    left = rng.choice([0, 3, 5])
    manager = SimpleNamespace(
        connector=SimpleNamespace(config={"extra": {"codec_left_context_frames": left}})
    )
    request = worker_request(source, additional_information=given, model_intermediate_buffer=None)
    payload = plain(
        oracle(f"{P}.minicpmo_4_5_omni.tts2code2wav_full_payload")(manager, dict(source.payload), request)
    )
    prompts = oracle(f"{P}.minicpmo_4_5_omni.tts2code2wav_token_only")(
        [request_output(source, nested(source.payload))]
    )
    if not prompts:  # no code: the prompt builder drops the request. DIFFERENCES["error_instead_of_none"]
        assert payload["codes"]["audio"].numel() == 0
        with pytest.raises(GlueError):
            minicpmo_4_5.tts2code2wav(source, left_context_frames=left)
        return
    ours = minicpmo_4_5.tts2code2wav(source, left_context_frames=left)
    assert_same(ours.payload, payload)
    assert_same(ours.prompt_token_ids, prompts[0]["prompt_token_ids"])


# -- indextts2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_indextts2_talker2s2mel(seed: int):
    from omnigen.glue import indextts2

    rng = random.Random(seed)
    length = rng.randint(1, 12)
    mel = [rng.randrange(8192) for _ in range(length)]
    if rng.random() < 0.6:
        mel[rng.randrange(length)] = 8193
    use_latent = rng.random() < 0.5
    payload: dict[str, Any] = {
        "meta.use_gpt_latent": torch.tensor(use_latent) if rng.random() < 0.5 else use_latent,
        "meta.S_ref": torch.randn(1, 3, 4),
        "meta.ref_mel": torch.randn(1, 5, 2),
        "meta.style": torch.randn(1, 6),
    }
    if rng.random() < 0.5:
        payload["meta.duration_factor"] = rng.choice([1.25, torch.tensor(0.8)])
    if use_latent:
        payload["codes.mel"] = torch.tensor(mel).reshape(1, -1) if rng.random() < 0.5 else torch.tensor(mel)
        latent = torch.randn(length, 3)
        payload["hidden_states.latent"] = latent.unsqueeze(0) if rng.random() < 0.5 else latent
    source = StageResult(
        request_id=f"idx-{seed}",
        prompt_token_ids=[1, 2],
        output_token_ids=mel,
        payload=payload if rng.random() < 0.6 else nested(payload),
        seed=rng.choice([None, 1234]),
    )
    theirs = oracle(f"{P}.indextts2.talker2s2mel_full_payload")(
        None, dict(source.payload), worker_request(source)
    )
    (prompt,) = oracle(f"{P}.indextts2.talker2s2mel_token_only")([request_output(source)])
    ours = indextts2.talker2s2mel(source)
    assert_same(ours.payload, theirs)
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])


def test_indextts2_missing_conditioning_is_an_error_on_both_sides():
    from omnigen.glue import indextts2

    source = StageResult(
        request_id="idx",
        prompt_token_ids=[1],
        output_token_ids=[5, 8193],
        payload={"meta.use_gpt_latent": False},
    )
    with pytest.raises(ValueError, match="S_ref"):
        oracle(f"{P}.indextts2.talker2s2mel_full_payload")(None, dict(source.payload), worker_request(source))
    with pytest.raises(GlueError, match="S_ref"):
        indextts2.talker2s2mel(source)


# -- higgs_audio_v3 -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_higgs_audio_v3_talker2code2wav(seed: int):
    from omnigen.glue import higgs_audio_v3

    rng = random.Random(seed)
    steps = rng.randint(3, 20)
    codes = torch.randint(0, 1024, (steps, 8))
    for _ in range(rng.randint(0, 6)):
        codes[rng.randrange(steps), rng.randrange(8)] = rng.choice([1024, 1025, -1])
    source = StageResult(
        request_id=f"higgs-{seed}",
        prompt_token_ids=[1],
        output_token_ids=[0] * steps,
        payload={"codes.audio": codes.reshape(-1) if rng.random() < 0.3 else codes},
    )
    (prompt,) = oracle(f"{P}.higgs_audio_v3.talker2code2wav")(
        [request_output(source, nested(source.payload))]
    )
    if not prompt["prompt_token_ids"]:  # fewer steps than codebooks. DIFFERENCES["error_instead_of_none"]
        with pytest.raises(GlueError):
            higgs_audio_v3.talker2code2wav(source)
        return
    ours = higgs_audio_v3.talker2code2wav(source)
    assert_same(ours.prompt_token_ids, prompt["prompt_token_ids"])
    assert ours.payload == {} and prompt["additional_information"] is None


# -- moss_tts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_moss_tts_talker2codec(seed: int):
    from omnigen.glue import moss_tts

    rng = random.Random(seed)
    codes = torch.randint(0, 1025, (rng.randint(1, 15), rng.choice([8, 16, 32])))
    source = StageResult(
        request_id=f"moss-{seed}", prompt_token_ids=[1], output_token_ids=[0], payload={"codes.audio": codes}
    )
    # Called with its declared arguments (stage outputs with .multimodal_outputs, source indices).
    (theirs,) = oracle(f"{P}.moss_tts.talker2codec")(
        [SimpleNamespace(multimodal_outputs=nested(source.payload))], [0]
    )
    ours = moss_tts.talker2codec(source)
    assert_same(ours.prompt_token_ids, theirs["prompt_token_ids"])
    # DIFFERENCES["moss_multi_modal_data"]
    assert_same(theirs["multi_modal_data"], {"codes": {"audio": codes.transpose(0, 1).contiguous()}})
    assert ours.multi_modal_data is None and ours.payload == {}


def test_moss_tts_talker2codec_breaks_under_the_orchestrators_call():
    """vllm-omni's orchestrator calls input functions as ``f(source_outputs, prompt,
    requires_multimodal_data)`` (stage_engine_core_client.py:496); ``talker2codec`` declares
    ``(stage_list, engine_input_source, prompt, ...)`` (moss_tts.py:50), so it iterates the
    prompt as source indices. This is why omnigen's version takes the finished request itself."""
    codes = torch.randint(0, 1024, (4, 8))
    output = request_output(
        StageResult(request_id="m", prompt_token_ids=[1], output_token_ids=[0]), {"codes": {"audio": codes}}
    )
    with pytest.raises(TypeError):
        oracle(f"{P}.moss_tts.talker2codec")([output], {"prompt_token_ids": [1]}, False)


def test_differences_are_documented():
    assert all(isinstance(text, str) and text for text in DIFFERENCES.values())


def test_next_stage_input_shape():
    assert NextStageInput(prompt_token_ids=[0]).payload == {}
