"""Differential test: omnigen's streaming window functions against vllm-omni 0.30's async-chunk
functions, and the real code2wav classes decoding the windows (issue 35).

vllm-omni streams a take into one long-lived code2wav request: its connector calls the stage's
``talker2code2wav_async_chunk`` once per talker step (the step's codes, ``is_finished`` on the
last), keeping the request's frames in the adapter (``code_prompt_token_ids``, ``put_req_chunk``,
counted up after each chunk it sends), and each chunk it returns replaces code2wav's prompt.
omnigen sends one code2wav request per window (``omnigen.serving.streaming``): the driver cuts
windows with ``WindowCutter`` from the stream config and the window function makes each request
from the payload so far. Here both run over the same seeded takes, omnigen's producer publishing
at every step, so the windows fall where vllm-omni's chunks do; for each chunk, the codes (and the
left-context metadata) must be equal, and the windows of a whole take must hold exactly the full
payload's codes. The stream configs' numbers must be vllm-omni's deployment's.

Then the real code2wav classes decode the windows on plain vLLM's terms (no async-chunk state):
which samples belong to the left context, who drops them, and how the streamed audio compares
with the full payload's.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml

from omnigen.glue.types import StageResult, Window, frames_counter
from omnigen.serving.streaming import WindowCutter
from omnigen.spec import StreamSpec

if importlib.util.find_spec("vllm_omni") is None:
    pytest.skip(
        "vllm-omni (the comparison oracle) is not installed: it is tied to vLLM 0.30 (requirements/vllm-0.30)",
        allow_module_level=True,
    )
pytestmark = pytest.mark.oracle

from tests.oracle.test_glue_oracle import assert_same, oracle, plain  # noqa: E402

P = "vllm_omni.model_executor.stage_input_processors"
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = Path(importlib.util.find_spec("vllm_omni").origin).parent / "deploy"

DIFFERENCES = {
    "finished_per_window": (
        "vllm-omni's meta.finished marks the last chunk of its one code2wav request; every omnigen "
        "window is a whole request, so its meta.finished is always true"
    ),
    "qwen3_omni_left_context_after_initial": (
        "with an initial chunk, vllm-omni's talker2code2wav_async_chunk counts the left context of "
        "the chunks after the second from the frames after the initial chunk (min(length - chunk, "
        "left) with length less the initial chunk); omnigen's windows reach back left_context_frames "
        "whatever came before. Equal while left_context_frames <= chunk_frames (the deployment's 25/25)"
    ),
}


def deploy_extra(name: str) -> dict[str, Any]:
    """The connector ``extra`` of a vllm-omni deployment (the async-chunk knobs)."""
    deploy = yaml.safe_load((DEPLOY / name).read_text())
    (connector,) = deploy["connectors"].values()
    return dict(connector["extra"])


def configured_stream(model: str, stage: str) -> dict[str, Any]:
    """``stages.<stage>.stream`` of ``conf/model/<model>.yaml``, as written."""
    return yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["stages"][stage]["stream"]


def spec_of(stream: dict[str, Any]) -> StreamSpec:
    return StreamSpec(
        window=stream["window"],
        chunk_frames=stream["chunk_frames"],
        left_context_frames=stream["left_context_frames"],
        initial_chunk_frames=stream["initial_chunk_frames"],
        coalesce=stream.get("coalesce", True),
    )


class ChunkAdapter:
    """The per-request state vllm-omni's chunk transfer adapter keeps for an async-chunk function
    (``chunk_transfer_adapter.py``): the frames so far, the chunks sent, the connector's knobs."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.code_prompt_token_ids: dict[str, list[Any]] = defaultdict(list)
        self.put_req_chunk: dict[str, int] = defaultdict(int)
        self.connector = SimpleNamespace(config={"extra": dict(extra)})

    def run(self, function: Any, request: Any, steps: list[Any]) -> list[dict[str, Any]]:
        """Each step's multimodal output through ``function`` (``is_finished`` on the last); the
        chunks it sends, as code2wav gets them."""
        chunks = []
        for index, output in enumerate(steps):
            chunk = function(self, output, request, is_finished=index == len(steps) - 1)
            if chunk is not None:
                self.put_req_chunk[request.external_req_id] += 1  # after a successful put
                chunks.append(plain(chunk))
        return chunks


def windows_of(stream: StreamSpec, window_fn: Any, sources: list[StageResult]) -> list[tuple[Window, Any]]:
    """omnigen's windows of a take whose producer published ``sources`` (the last finished)."""
    cutter = WindowCutter(stream)
    frames_of = frames_counter(window_fn)
    made = []
    for index, source in enumerate(sources):
        for window in cutter.take(frames_of(source), index == len(sources) - 1):
            made.append((window, window_fn(source, window)))
    return made


@pytest.fixture
def one_thread():
    # The decoders' convolutions on a shared CPU: one thread is faster and always the same sums.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- qwen3_omni ---------------------------------------------------------------------------------

QWEN3_OMNI_LENGTHS = [1, 3, 4, 5, 17, 28, 29, 30, 53, 54, 55, 79, 80, 104, 131]
QWEN3_OMNI_STOP = 2150
"""The talker's codec EOS (pipeline.py's stop id)."""


def qwen3_omni_config() -> dict[str, Any]:
    return configured_stream("qwen3_omni", "talker")


def test_qwen3_omni_stream_config_is_vllm_omnis_deployment():
    extra = deploy_extra("qwen3_omni_moe.yaml")
    stream = qwen3_omni_config()
    assert stream["window"] == "omnigen.glue.qwen3_omni.talker2code2wav_window"
    assert stream["initial_chunk_frames"] == extra["initial_codec_chunk_frames"] == 4
    assert stream["chunk_frames"] == extra["codec_chunk_frames"] == 25
    assert stream["left_context_frames"] == extra["codec_left_context_frames"] == 25
    assert not stream.get("ramp")


def qwen3_omni_hf_config(**code2wav: Any) -> Any:
    """The tiny real-shaped checkpoint's config (code2wav: 8 samples a frame), with the released
    codebook and code groups, which code2wav's forward reads; ``code2wav`` overrides its fields."""
    from omnigen_testing.real.cases import qwen3_omni_talker as tiny

    config = tiny.hf_config(code_vocab=2048, code_groups=16)
    for key, value in code2wav.items():
        setattr(config.code2wav_config, key, value)
    return config


def qwen3_omni_take(
    rng: random.Random, frames: int, hf_config: Any
) -> tuple[torch.Tensor, list[StageResult]]:
    """A talker take of ``frames`` codec frames, and the payload omnigen's producer publishes
    after each step: the runner's prefill rows (zeros), then one row per step, with the output
    ids the rows align with (their layer-0 codes; a take that ran to its length)."""
    codes = torch.randint(
        0, 2048, (frames, 16), generator=torch.Generator().manual_seed(rng.randrange(2**31))
    )
    prefill = torch.zeros((rng.randint(1, 9), 16), dtype=torch.long)
    sources = [
        StageResult(
            request_id="omni",
            prompt_token_ids=[0] * prefill.shape[0],
            output_token_ids=codes[:step, 0].tolist(),
            payload={"codes.audio": torch.cat([prefill, codes[:step]])},
            finish_reason="length" if step == frames else None,
            hf_config=hf_config,
        )
        for step in range(1, frames + 1)
    ]
    return codes, sources


def qwen3_omni_chunks(rng: random.Random, codes: torch.Tensor, prefill_rows: int) -> list[dict[str, Any]]:
    """vllm-omni's chunks of the same take: its prefill step (all-zero codes, skipped), one frame a
    step, and the finish either with the last frame or one step later without codes."""
    steps = [{"codes": {"audio": torch.zeros((prefill_rows, 16), dtype=torch.long)}}]
    steps += [{"codes": {"audio": codes[i : i + 1]}} for i in range(codes.shape[0])]
    if rng.random() < 0.5:
        steps.append({"codes": {"audio": torch.zeros((0, 16), dtype=torch.long)}})
    request = SimpleNamespace(
        external_req_id="omni", sampling_params=SimpleNamespace(stop_token_ids=[QWEN3_OMNI_STOP])
    )
    adapter = ChunkAdapter(deploy_extra("qwen3_omni_moe.yaml"))
    return adapter.run(oracle(f"{P}.qwen3_omni.talker2code2wav_async_chunk"), request, steps)


@pytest.mark.parametrize("frames", QWEN3_OMNI_LENGTHS)
def test_qwen3_omni_windows_are_vllm_omnis_chunks(frames: int):
    from omnigen.glue.qwen3_omni import talker2code2wav, talker2code2wav_window

    rng = random.Random(frames)
    codes, sources = qwen3_omni_take(rng, frames, qwen3_omni_hf_config())
    theirs = qwen3_omni_chunks(rng, codes, len(sources[0].prompt_token_ids))
    ours = windows_of(spec_of(qwen3_omni_config()), talker2code2wav_window, sources)
    assert [len(chunk["codes"]["audio"]) for chunk in theirs] == [
        len(made.request.prompt_token_ids) for _, made in ours
    ]
    for (window, made), chunk in zip(ours, theirs, strict=True):
        where = f"window {window.index} [{window.start}, {window.end})"
        assert_same(made.request.payload["codes"]["audio"], chunk["codes"]["audio"], where)
        assert made.request.prompt_token_ids == chunk["codes"]["audio"].tolist(), where
        left = chunk["meta"]["left_context_size"]
        assert made.request.payload["meta"]["left_context_size"] == left == window.left_context, where
        assert bool(made.request.payload["meta"]["finished"])  # DIFFERENCES["finished_per_window"]
    assert ours[-1][0].last

    # The windows' own frames, in order, are the full payload's codes.
    whole = torch.tensor(talker2code2wav(sources[-1]).payload["codes"]["audio"]).reshape(16, -1)
    pieces = [
        made.request.payload["codes"]["audio"].reshape(16, -1)[:, window.left_context :]
        for window, made in ours
    ]
    assert torch.equal(torch.cat(pieces, dim=1), whole)


def test_qwen3_omni_left_context_after_an_initial_chunk_reaches_back_further():
    """DIFFERENCES["qwen3_omni_left_context_after_initial"], with a left context past a chunk."""
    from omnigen.glue.qwen3_omni import talker2code2wav_window

    extra = {"initial_codec_chunk_frames": 4, "codec_chunk_frames": 25, "codec_left_context_frames": 72}
    rng = random.Random(7)
    codes, sources = qwen3_omni_take(rng, 60, qwen3_omni_hf_config())
    request = SimpleNamespace(external_req_id="omni", sampling_params=SimpleNamespace(stop_token_ids=[]))
    steps = [{"codes": {"audio": codes[i : i + 1]}} for i in range(60)]
    theirs = ChunkAdapter(extra).run(oracle(f"{P}.qwen3_omni.talker2code2wav_async_chunk"), request, steps)
    stream = StreamSpec(window="w", chunk_frames=25, left_context_frames=72, initial_chunk_frames=4)
    ours = windows_of(stream, talker2code2wav_window, sources)
    assert [w.left_context for w, _ in ours] == [0, 4, 29, 54]
    assert [chunk["meta"]["left_context_size"] for chunk in theirs] == [0, 4, 25, 50]


# The real code2wav (vllm-omni's Qwen3OmniMoeCode2Wav) with seeded random weights, decoding as the
# stage's forward has it decode (qwen3_omni.py, code2wav branch and generate_audio): each
# request's flat codes as a (16, frames) row of a zero-padded batch, then on plain vLLM
# (model_config.async_chunk unset) chunked_decode(chunk_size=300, left_context_size=25), which
# reads no request metadata, and under vllm-omni's async chunk chunked_decode_streaming with each
# request's meta.left_context_size. (The stage's forward itself cannot be imported here: its
# module imports the thinker's image processor, which needs torchvision.)


def qwen3_omni_code2wav(hf_config: Any) -> Any:
    cls = oracle("vllm_omni.model_executor.models.qwen3_omni.qwen3_omni_code2wav.Qwen3OmniMoeCode2Wav")
    torch.manual_seed(0)
    config = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config.code2wav_config))
    return cls(vllm_config=config).eval()


def qwen3_omni_decode(
    code2wav: Any, prompts: list[list[int]], payloads: list[dict], *, async_chunk: bool
) -> list:
    """One code2wav step over these requests (prompts and buffers); each request's audio, 1-D."""
    frames = [len(prompt) // 16 for prompt in prompts]
    batch = torch.zeros((len(prompts), 16, max(frames)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        batch[row, :, : frames[row]] = torch.tensor(prompt).reshape(16, -1)
    counts = [len(prompt) for prompt in prompts]
    with torch.no_grad():
        if async_chunk:
            left = [int(payload["meta"]["left_context_size"]) for payload in payloads]
            audio = code2wav.chunked_decode_streaming(batch, left_context_size=left, seq_token_counts=counts)
        else:
            audio = code2wav.chunked_decode(
                batch, chunk_size=300, left_context_size=25, seq_token_counts=counts
            )
    return [wav.reshape(-1) for wav in audio]


@pytest.mark.parametrize(
    "code2wav",
    [{}, {"upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 32, "hidden_size": 32}],
    ids=["tiny-checkpoint", "released-upsampling"],
)
def test_qwen3_omni_decoder_geometry_is_the_real_decoders(code2wav: dict, one_thread):
    from omnigen.glue.qwen3_omni import decoder_geometry

    hf_config = qwen3_omni_hf_config(**code2wav)
    model = qwen3_omni_code2wav(hf_config)
    upsample, tail = decoder_geometry(StageResult("r", [], [], hf_config=hf_config))
    assert upsample == model.total_upsample
    for frames in (1, 2, 7):
        with torch.no_grad():
            samples = model(torch.randint(0, 2048, (1, 16, frames))).shape[-1]
        assert samples == frames * upsample - tail
    assert (upsample, tail) == ((8, 6) if not code2wav else (1920, 555))


def test_qwen3_omni_code2wav_on_plain_vllm_trims_nothing_so_the_driver_drops(one_thread):
    """On plain vLLM the model decodes a window's every code (``chunked_decode``: it reads
    ``meta.left_context_size`` only under vllm-omni's async chunk), so the driver drops
    ``drop_samples``; what is left is, sample for sample, what vllm-omni's async-chunk decode makes
    of its chunk, and the windows' audio is as long as the full payload's."""
    from omnigen.glue.qwen3_omni import decoder_geometry, talker2code2wav, talker2code2wav_window

    hf_config = qwen3_omni_hf_config()
    model = qwen3_omni_code2wav(hf_config)
    rng = random.Random(3)
    codes, sources = qwen3_omni_take(rng, 80, hf_config)
    theirs = qwen3_omni_chunks(rng, codes, len(sources[0].prompt_token_ids))
    ours = windows_of(spec_of(qwen3_omni_config()), talker2code2wav_window, sources)
    upsample, tail = decoder_geometry(sources[-1])
    streamed = []
    for (window, made), chunk in zip(ours, theirs, strict=True):
        request = made.request
        (plain_audio,) = qwen3_omni_decode(
            model, [request.prompt_token_ids], [request.payload], async_chunk=False
        )
        frames = len(request.prompt_token_ids) // 16
        assert plain_audio.numel() == frames * upsample - tail  # nothing trimmed
        assert made.drop_samples == (window.left_context * upsample - tail if window.left_context else 0)
        (async_audio,) = qwen3_omni_decode(
            model, [chunk["codes"]["audio"].tolist()], [chunk], async_chunk=True
        )
        assert torch.equal(plain_audio[made.drop_samples :], async_audio), f"window {window.index}"
        assert plain_audio[made.drop_samples :].numel() == made.keep_samples  # alone, nothing cut
        streamed.append(plain_audio[made.drop_samples :])
    full = talker2code2wav(sources[-1])
    (whole,) = qwen3_omni_decode(model, [full.prompt_token_ids], [full.payload], async_chunk=False)
    streamed_audio = torch.cat(streamed)
    assert streamed_audio.numel() == whole.numel() == 80 * upsample - tail
    # The tiny checkpoint's decoder (one pre-transformer layer, sliding window 8, short convolutions)
    # sees less than the 25 frames of left context: streamed audio is the full payload's.
    torch.testing.assert_close(streamed_audio, whole, rtol=0, atol=1e-6)


def test_qwen3_omni_code2wav_pads_a_shorter_window_of_a_batch_and_keep_samples_cuts_it(one_thread):
    """Batched with a longer window, a window's audio on plain vLLM runs ``tail`` samples past
    its decode alone (its end is decoded against the batch's zero padding), which ``drop_samples``
    cannot cut: the window's ``keep_samples`` does, so its audio is the same batched or alone.
    vllm-omni's async-chunk decode cuts each row's end itself."""
    from omnigen.glue.qwen3_omni import decoder_geometry, talker2code2wav_window

    hf_config = qwen3_omni_hf_config()
    model = qwen3_omni_code2wav(hf_config)
    _, sources = qwen3_omni_take(random.Random(5), 60, hf_config)
    ours = windows_of(spec_of(qwen3_omni_config()), talker2code2wav_window, sources)
    short, long = ours[1][1].request, ours[2][1].request  # 29 and 50 frames
    upsample, tail = decoder_geometry(sources[-1])
    alone, _ = qwen3_omni_decode(model, [short.prompt_token_ids] * 2, [short.payload] * 2, async_chunk=False)
    batched, _ = qwen3_omni_decode(
        model,
        [short.prompt_token_ids, long.prompt_token_ids],
        [short.payload, long.payload],
        async_chunk=False,
    )
    frames = len(short.prompt_token_ids) // 16
    assert alone.numel() == frames * upsample - tail
    assert batched.numel() == frames * upsample
    made = ours[1][1]
    own = slice(made.drop_samples, made.drop_samples + made.keep_samples)
    assert alone[made.drop_samples :].numel() == made.keep_samples
    torch.testing.assert_close(batched[own], alone[made.drop_samples :], rtol=0, atol=1e-6)
    torch.testing.assert_close(batched[: alone.numel()], alone, rtol=0, atol=1e-6)  # batched float sums
    in_async_chunk, _ = qwen3_omni_decode(
        model,
        [short.prompt_token_ids, long.prompt_token_ids],
        [short.payload, long.payload],
        async_chunk=True,
    )
    assert in_async_chunk.numel() == frames * upsample - short.payload["meta"]["left_context_size"] * upsample


def test_differences_are_documented():
    assert all(isinstance(text, str) and text for text in DIFFERENCES.values())


# -- higgs_audio_v3 -----------------------------------------------------------------------------

HIGGS_LENGTHS = [7, 8, 9, 11, 12, 13, 20, 36, 37, 38, 41, 61, 62, 66, 90, 117]
"""Talker steps (delay-pattern rows) of a take: 8 rows make one frame, 12 the first window's."""


def higgs_config() -> dict[str, Any]:
    return configured_stream("higgs_audio_v3", "talker")


def test_higgs_stream_config_is_vllm_omnis_deployment():
    from omnigen.glue.higgs_audio_v3 import RIGHT_HOLDBACK_FRAMES

    for deploy in ("higgs_multimodal_qwen3.yaml", "higgs_multimodal_qwen3_low_latency.yaml"):
        extra = deploy_extra(deploy)
        stream = higgs_config()
        assert stream["window"] == "omnigen.glue.higgs_audio_v3.talker2code2wav_window"
        assert stream["initial_chunk_frames"] == extra["initial_codec_chunk_frames"] == 1
        assert stream["chunk_frames"] == extra["codec_chunk_frames"] == 25
        assert stream["left_context_frames"] == extra["codec_left_context_frames"] == 25
        assert RIGHT_HOLDBACK_FRAMES == extra["codec_right_holdback_frames"] == 4
        assert not stream.get("ramp")


def higgs_take(rng: random.Random, steps: int) -> tuple[torch.Tensor, list[StageResult]]:
    """A talker take of ``steps`` delay-pattern rows (BOC/EOC and -1 here and there), and the
    payload omnigen's producer publishes after each step (one row a step)."""
    rows = torch.randint(0, 1024, (steps, 8), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    for _ in range(rng.randint(0, 6)):
        rows[rng.randrange(steps), rng.randrange(8)] = rng.choice([1024, 1025, -1])
    sources = [
        StageResult(
            request_id="higgs",
            prompt_token_ids=[1],
            output_token_ids=[0] * step,
            payload={"codes.audio": rows[:step]},
            finish_reason="stop" if step == steps else None,
        )
        for step in range(1, steps + 1)
    ]
    return rows, sources


def higgs_chunks(rng: random.Random, rows: torch.Tensor) -> list[dict[str, Any]]:
    """vllm-omni's chunks of the same take with new audio (a flush of only context is dropped:
    no omnigen window holds it): one row a step, the finish with the last row or one step after."""
    steps = [{"codes": {"audio": rows[i : i + 1]}} for i in range(rows.shape[0])]
    if rng.random() < 0.5:
        steps.append({"codes": {}})
    finished = {"at": len(steps) - 1, "step": 0}

    class Request:
        external_req_id = "higgs"

        @staticmethod
        def is_finished() -> bool:
            return finished["step"] == finished["at"]

    function = oracle(f"{P}.higgs_audio_v3.talker2code2wav_async_chunk")
    adapter = ChunkAdapter(deploy_extra("higgs_multimodal_qwen3.yaml"))
    chunks = []
    for index, output in enumerate(steps):
        finished["step"] = index
        chunk = function(adapter, output, Request, is_finished=index == len(steps) - 1)
        if chunk is not None:
            chunks.append(plain(chunk))
    new = [
        len(c["codes"]["audio"]) // 8 - c["meta"]["left_context_size"] - c["meta"]["right_holdback_size"]
        for c in chunks
        if c["codes"]["audio"].numel()
    ]
    return [c for c, n in zip([c for c in chunks if c["codes"]["audio"].numel()], new, strict=True) if n > 0]


@pytest.mark.parametrize("steps", HIGGS_LENGTHS)
def test_higgs_windows_are_vllm_omnis_chunks(steps: int):
    from omnigen.glue.higgs_audio_v3 import talker2code2wav, talker2code2wav_window

    rng = random.Random(steps)
    rows, sources = higgs_take(rng, steps)
    theirs = higgs_chunks(rng, rows)
    ours = windows_of(spec_of(higgs_config()), talker2code2wav_window, sources)
    assert len(ours) == len(theirs)
    for (window, made), chunk in zip(ours, theirs, strict=True):
        where = f"window {window.index} [{window.start}, {window.end})"
        assert made.request.prompt_token_ids == chunk["codes"]["audio"].tolist(), where
        meta = made.request.payload["meta"]
        assert meta["left_context_size"] == chunk["meta"]["left_context_size"] == window.left_context, where
        assert meta["right_holdback_size"] == chunk["meta"]["right_holdback_size"], where
        assert made.drop_samples == 0  # code2wav trims both ends itself
    if steps < 8:  # no frame at all: no window; the full payload's glue refuses the take
        assert ours == []
        return
    assert ours[-1][0].last
    # The windows' own frames, in order, are the full payload's codes.
    whole = torch.tensor(talker2code2wav(sources[-1]).prompt_token_ids).reshape(8, -1)
    pieces = []
    for _, made in ours:
        meta = made.request.payload["meta"]
        codes = torch.tensor(made.request.prompt_token_ids).reshape(8, -1)
        pieces.append(codes[:, meta["left_context_size"] : codes.shape[1] - meta["right_holdback_size"]])
    assert torch.equal(torch.cat(pieces, dim=1), whole)


@pytest.fixture
def higgs_code2wav(monkeypatch: pytest.MonkeyPatch, one_thread) -> Any:
    """vllm-omni's Higgs code2wav with the tiny checkpoint's codec (testing/checkpoints), float32."""
    from omnigen_testing.checkpoints import higgs_audio_v3 as checkpoint

    # What omnigen's provider does when it serves vllm-omni's classes on a torch without CUDA
    # (omnigen/providers/vllm_omni.py): the decoder asks it before every decode.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    config_cls = oracle("vllm_omni.transformers_utils.configs.higgs_audio_v3.HiggsAudioV3Config")
    cls = oracle(
        "vllm_omni.model_executor.models.higgs_audio_v3.higgs_audio_v3_code2wav.HiggsAudioV3Code2Wav"
    )
    model = cls(config=config_cls(**checkpoint.higgs_audio_v3_config()))
    state = {
        name: checkpoint._codec_value(name, shape, 0).float()
        for name, shape in checkpoint.codec_tensor_shapes(8).items()
    }
    model._load_from_bundled_state(state, torch.device("cpu"))
    return model


def higgs_decode(code2wav: Any, prompts: list[list[int]], payloads: list[dict]) -> list[torch.Tensor]:
    """code2wav's forward over one step of these requests (prompts, buffers): each one's audio."""
    output = code2wav.forward(
        input_ids=torch.tensor([code for prompt in prompts for code in prompt]),
        runtime_additional_information=payloads,
        seq_token_counts=[len(prompt) for prompt in prompts],
    )
    return output.multimodal_outputs["model_outputs"]


def test_higgs_code2wav_trims_its_windows_itself(higgs_code2wav):
    """The code2wav class trims ``left_context_size`` and ``right_holdback_size`` frames of samples
    itself on plain vLLM (it keeps no state between chunks), per request, so windows batched
    together decode as they do alone; the windows' audio is as long as the full payload's."""
    from omnigen.glue.higgs_audio_v3 import talker2code2wav, talker2code2wav_window

    rng = random.Random(11)
    rows, sources = higgs_take(rng, 70)
    ours = windows_of(spec_of(higgs_config()), talker2code2wav_window, sources)
    assert [(w.start, w.end) for w, _ in ours] == [(0, 1), (1, 26), (26, 51), (51, 62)]
    requests = [made.request for _, made in ours]
    alone = [higgs_decode(higgs_code2wav, [r.prompt_token_ids], [r.payload])[0] for r in requests]
    batched = higgs_decode(
        higgs_code2wav, [r.prompt_token_ids for r in requests], [r.payload for r in requests]
    )
    hop = higgs_code2wav.hop_length
    for (window, _), one, together in zip(ours, alone, batched, strict=True):
        assert one.numel() == (window.end - window.start) * hop
        assert torch.equal(together, one)
    full = talker2code2wav(sources[-1])
    (whole,) = higgs_decode(higgs_code2wav, [full.prompt_token_ids], [{}])
    streamed = torch.cat(alone)
    assert streamed.numel() == whole.numel() == 62 * hop
    # The codec is not causal and its right reach exceeds the deployment's 4 frames of holdback:
    # streamed audio leaves the full payload's only in the 5 frames before each seam (here by up
    # to 1.7e-3, against an rms of 0.14); the left context (25 frames) covers its left reach.
    per_frame = (streamed - whole).abs().reshape(-1, hop).amax(dim=1)
    near_seams = {frame for window, _ in ours[:-1] for frame in range(window.end - 5, window.end)}
    assert all(per_frame[frame] < 1e-5 for frame in range(62) if frame not in near_seams)
    assert 0 < float(per_frame.max()) < 5e-3
