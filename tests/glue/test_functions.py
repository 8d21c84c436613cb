"""Behaviour of each glue function on small hand-built inputs (no vllm-omni: the differential
test against it is tests/oracle/test_glue_oracle.py)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from omnigen.glue import (
    GLUE,
    GlueError,
    StageResult,
    higgs_audio_v3,
    indextts2,
    mimo_audio,
    minicpmo_4_5,
    moss_tts,
    qwen2_5_omni,
    qwen3_omni,
    qwen3_tts,
)
from omnigen_testing import tiny_glue


def result(**fields) -> StageResult:
    fields.setdefault("request_id", "req-0")
    fields.setdefault("prompt_token_ids", [1, 2, 3])
    fields.setdefault("output_token_ids", [])
    return StageResult(**fields)


# -- qwen3_tts ----------------------------------------------------------------------------------


def test_qwen3_tts_codes_are_filtered_cropped_and_codebook_major():
    codes = torch.tensor([[-1, -1], [0, 0], [1, 2], [3, 4], [5, 2048], [6, 7]])
    # Three real frames (1,2), (3,4), (6,7); four output ids: three codes and the stop code.
    out = qwen3_tts.talker2code2wav(result(payload={"codes.audio": codes}, output_token_ids=[9, 9, 9, 2150]))
    assert out.payload["codes"]["audio"].tolist() == [1, 3, 6, 2, 4, 7]
    assert out.payload["codes"]["audio"].dtype == torch.long
    assert out.prompt_token_ids == [0] * 6
    assert out.payload["meta"]["finished"].item() is True
    assert "left_context_size" not in out.payload["meta"]


def test_qwen3_tts_keeps_the_last_frames_when_more_frames_than_codes():
    codes = torch.tensor([[1, 1], [2, 2], [3, 3]])
    out = qwen3_tts.talker2code2wav(
        result(payload={"codes": {"audio": codes}}, output_token_ids=[5, 5, 2150])
    )
    assert out.payload["codes"]["audio"].tolist() == [2, 3, 2, 3]


def test_qwen3_tts_prepends_reference_codes_and_says_how_many():
    codes = torch.tensor([[1, 1], [2, 2]])
    ref = torch.tensor([7, 8, 9, 10, 11, 12])  # three flat reference frames of Q=2
    payload = {"codes.audio": codes, "codes.ref": [ref], "meta.ref_code_len": torch.tensor([0, 2])}
    out = qwen3_tts.talker2code2wav(result(payload=payload, output_token_ids=[5, 5, 2150]))
    assert out.payload["codes"]["audio"].tolist() == [7, 9, 1, 2, 8, 10, 1, 2]
    assert out.payload["meta"]["left_context_size"] == 2
    assert len(out.prompt_token_ids) == 8


@pytest.mark.parametrize(
    "payload", [{}, {"codes.audio": torch.empty(0, 16)}, {"codes.audio": torch.zeros(3, 16)}]
)
def test_qwen3_tts_without_a_frame_sends_one_placeholder_frame(payload):
    out = qwen3_tts.talker2code2wav(result(payload=payload, output_token_ids=[2150]))
    assert out.payload["codes"]["audio"].tolist() == [1] * 16
    assert out.prompt_token_ids == [0] * 16


def test_qwen3_tts_passes_the_callers_voice():
    prompt = {"additional_information": {"speaker": ["Vivian"], "language": ["English"], "other": [1]}}
    out = qwen3_tts.talker2code2wav(
        result(payload={"codes.audio": torch.tensor([[1, 2]])}, output_token_ids=[3, 4], user_prompt=prompt)
    )
    assert out.payload["speaker"] == ["Vivian"] and out.payload["language"] == ["English"]
    assert "other" not in out.payload


def test_qwen3_tts_flat_codes_are_an_error():
    with pytest.raises(GlueError, match="req-0.*codes.audio must be"):
        qwen3_tts.talker2code2wav(result(payload={"codes.audio": torch.tensor([1, 2, 3])}))


# -- qwen3_omni ---------------------------------------------------------------------------------

IM, SYS, USER, ASSISTANT = qwen3_omni.IM_START, qwen3_omni.SYSTEM, qwen3_omni.USER, qwen3_omni.ASSISTANT


def test_talker_prompt_length_counts_user_turns_and_the_reply_prefix():
    prompt = [IM, SYS, 5, 5, IM, USER, 6, 6, 6, IM, ASSISTANT]
    assert qwen3_omni.talker_prompt_length(prompt, [*prompt, 7, 7]) == 5 + 9
    # An assistant turn that is not the last one is not counted; a trailing user turn runs to the end.
    prompt = [IM, USER, 1, IM, ASSISTANT, 2, IM, USER, 3]
    assert qwen3_omni.talker_prompt_length(prompt, [*prompt, 4]) == 3 + 4
    assert qwen3_omni.talker_prompt_length([1, 2], [1, 2, 3]) == 0


def thinker_result(rows: int, **fields) -> StageResult:
    prompt = [IM, USER, 6, 6, IM, ASSISTANT]
    payload = {
        "hidden_states.layer_0": torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2),
        "hidden_states.layer_3": -torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2),
        "embed.tts_bos": [torch.ones(1, 2)],
    }
    fields.setdefault("payload", payload)
    return result(
        prompt_token_ids=prompt,
        output_token_ids=[10, 11, 12],
        hf_config=SimpleNamespace(talker_config=SimpleNamespace(accept_hidden_layer=3)),
        **fields,
    )


def test_qwen3_omni_thinker2talker_payload_and_prompt():
    out = qwen3_omni.thinker2talker(thinker_result(rows=8))
    assert out.payload["embed"]["prefill"].shape == (7, 2)  # the last sampled token's row dropped
    assert torch.equal(out.payload["hidden_states"]["output"], -torch.arange(14.0).reshape(7, 2))
    assert torch.equal(out.payload["embed"]["tts_bos"], torch.ones(1, 2))
    assert "tts_eos" not in out.payload["embed"]
    assert out.payload["ids"] == {
        "all": [IM, USER, 6, 6, IM, ASSISTANT, 10, 11, 12],
        "prompt": [IM, USER, 6, 6, IM, ASSISTANT],
    }
    assert out.prompt_token_ids == [0] * (4 + 9)


def test_qwen3_omni_thinker2talker_keeps_a_single_row_and_reads_hidden_for_embeddings():
    payload = {"hidden": torch.ones(1, 2), "hidden_states.layer_3": torch.zeros(1, 2)}
    out = qwen3_omni.thinker2talker(thinker_result(rows=1, payload=payload))
    assert torch.equal(out.payload["embed"]["prefill"], torch.ones(1, 2))
    assert out.payload["hidden_states"]["output"].shape == (1, 2)


def test_qwen3_omni_thinker2talker_voice_request_first_then_prompt():
    source = thinker_result(
        rows=8,
        input_payload={"speaker": ["Ethan "]},
        user_prompt={"additional_information": {"speaker": ["Aiden"], "language": ["Chinese"]}},
    )
    out = qwen3_omni.thinker2talker(source)
    assert out.payload["speaker"] == "ethan" and out.payload["language"] == ["Chinese"]


def test_qwen3_omni_thinker2talker_needs_the_accepted_layer():
    source = dataclasses.replace(thinker_result(rows=8), hf_config=None)
    with pytest.raises(GlueError, match="accept_hidden_layer"):
        qwen3_omni.thinker2talker(source)
    assert qwen3_omni.thinker2talker(source, accept_hidden_layer=3).payload["hidden_states"][
        "output"
    ].shape == (7, 2)
    with pytest.raises(GlueError, match="hidden_states.layer_9"):
        qwen3_omni.thinker2talker(source, accept_hidden_layer=9)


def test_qwen3_omni_talker2code2wav_keeps_rows_of_codec_tokens():
    codes = torch.tensor([[9, 9], [1, 2], [3, 4], [5, 6], [7, 8]])
    # Rows align with the output ids from the end; the bos (4197) and stop (2150) rows go.
    out = qwen3_omni.talker2code2wav(
        result(payload={"codes.audio": codes}, output_token_ids=[4197, 100, 101, 2150])
    )
    assert out.payload["codes"]["audio"] == [3, 5, 4, 6]
    # code2wav decodes its prompt ids as the codes (vllm-omni's scheduler puts them there).
    assert out.prompt_token_ids == [3, 5, 4, 6]


def test_qwen3_omni_talker2code2wav_errors():
    with pytest.raises(GlueError, match="no codes.audio"):
        qwen3_omni.talker2code2wav(result(payload={}))
    with pytest.raises(GlueError, match="no codec row"):
        qwen3_omni.talker2code2wav(
            result(payload={"codes.audio": torch.tensor([[1, 2]])}, output_token_ids=[4198])
        )


# -- qwen2_5_omni -------------------------------------------------------------------------------


def test_qwen2_5_omni_thinker2talker_splits_and_drops_the_stop_token():
    hidden = torch.arange(6, dtype=torch.bfloat16).reshape(6, 1)  # 3 prompt rows + 3 reply rows
    source = result(payload={"hidden": hidden}, output_token_ids=[7, 8, 9, 151645], finish_reason="stop")
    out = qwen2_5_omni.thinker2talker(source)
    assert out.payload["embed"]["prefill"].dtype == torch.float32
    assert out.payload["embed"]["prefill"].flatten().tolist() == [0, 1, 2]
    assert out.payload["hidden_states"]["output"].flatten().tolist() == [3, 4, 5]
    assert out.payload["hidden_states"]["output_shape"] == [3, 1]
    assert out.payload["ids"] == {"prompt": [1, 2, 3], "output": [7, 8, 9]}
    assert out.prompt_token_ids == [8293, 8292, 8292, 8292, 8294]
    assert out.multi_modal_data is None


def test_qwen2_5_omni_thinker2talker_length_finish_and_stop_string_keep_the_last_token():
    hidden = torch.zeros(9, 1)
    for finish, stop in (("length", None), ("stop", "</s>")):
        out = qwen2_5_omni.thinker2talker(
            result(
                payload={"hidden": hidden}, output_token_ids=[7, 8], finish_reason=finish, stop_reason=stop
            )
        )
        assert out.payload["ids"]["output"] == [7, 8]
        assert out.payload["hidden_states"]["output"].shape == (2, 1)  # cut to prompt + reply rows


def test_qwen2_5_omni_thinker2talker_forwards_multimodal_data_on_request():
    data = {"audio": [torch.zeros(2)]}
    source = result(payload={"hidden": torch.zeros(3, 1)}, user_prompt={"multi_modal_data": data})
    assert qwen2_5_omni.thinker2talker(source, requires_multimodal_data=True).multi_modal_data is data


def test_qwen2_5_omni_thinker2talker_errors():
    with pytest.raises(GlueError, match="no 'hidden'"):
        qwen2_5_omni.thinker2talker(result(payload={}))
    with pytest.raises(GlueError, match="prefill not captured"):
        qwen2_5_omni.thinker2talker(result(payload={"hidden": torch.zeros(2, 1)}))


@pytest.mark.parametrize(
    ("ids", "codes"),
    [
        ([8293, 5, 6, 8292, 7, 8294], [5, 6, 7]),
        ([5, 6, -1, -1], [5, 6, 6, 6]),  # async placeholders stand for codes
        ([5, 8294], [5]),
        ([5, 9000, 8292], [5]),
    ],
)
def test_qwen2_5_omni_codec_ids(ids, codes):
    out = qwen2_5_omni.talker2code2wav(result(output_token_ids=ids))
    assert out.payload["codes"]["audio"] == codes
    assert out.prompt_token_ids == [0] * len(codes)


def test_qwen2_5_omni_talker2code2wav_without_codes_is_an_error():
    with pytest.raises(GlueError, match="no codec id"):
        qwen2_5_omni.talker2code2wav(result(output_token_ids=[8293, 8294]))
    with pytest.raises(GlueError, match="sampled no token"):
        qwen2_5_omni.talker2code2wav(result(output_token_ids=[]))


# -- mimo_audio ---------------------------------------------------------------------------------


def test_mimo_audio_pads_each_group_and_flattens_column_major():
    group = torch.arange(1, 33).reshape(1, 1, 8, 4)
    codes = torch.cat([group, torch.zeros(1, 1, 8, 4, dtype=torch.long), group + 100])
    out = mimo_audio.llm2code2wav(result(payload={"codes.audio": codes}))
    flat = out.payload["codes"]["audio"]
    assert len(flat) == 2 * 36 == len(out.prompt_token_ids)
    # First group, first column: the pad, then the column's eight codes.
    assert flat[:9] == [mimo_audio.CODEC_PAD, 1, 5, 9, 13, 17, 21, 25, 29]
    assert flat[36:38] == [mimo_audio.CODEC_PAD, 101]


def test_mimo_audio_caps_the_code2wav_prompt():
    codes = torch.ones(600, 1, 8, 4, dtype=torch.long)
    out = mimo_audio.llm2code2wav(result(payload={"codes.audio": codes}))
    assert len(out.payload["codes"]["audio"]) == mimo_audio.MAX_CODE2WAV_TOKENS == len(out.prompt_token_ids)


def test_mimo_audio_all_zero_codes_are_an_error():
    with pytest.raises(GlueError, match="all zeros"):
        mimo_audio.llm2code2wav(result(payload={"codes.audio": torch.zeros(2, 1, 8, 4)}))


# -- minicpmo_4_5 -------------------------------------------------------------------------------


def test_minicpmo_llm2tts_conditions_on_the_tts_span():
    prompt = [11, 12, minicpmo_4_5.TTS_BOS]
    output = [21, 22, minicpmo_4_5.TTS_EOS, 23]
    latent = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # prompt + reply - 1 rows
    source = result(prompt_token_ids=prompt, output_token_ids=output, payload={"latent": latent}, text="hi")
    out = minicpmo_4_5.llm2tts(source)
    assert out.payload["ids"]["tts"] == [21, 22]
    assert out.payload["hidden_states"]["tts"] == [[6.0, 7.0], [8.0, 9.0]]
    assert out.prompt_token_ids == [0] * (2 + 2)
    assert out.payload["meta"] == {"next_stage_prompt_len": 4, "replace_streaming_prompt": True}
    assert out.payload["llm_output_text"] == ["hi"] and out.payload["global_request_id"] == ["req-0"]


def test_minicpmo_llm2tts_without_bos_uses_the_reply_and_the_reference_voice():
    source = result(
        prompt_token_ids=[11, 12],
        output_token_ids=[21, 22, minicpmo_4_5.IM_END],
        payload={"latent": torch.ones(1, 4, 3)},
        user_prompt={"multi_modal_data": {"audio": (torch.ones(2, 5), 16000)}},
    )
    out = minicpmo_4_5.llm2tts(source)
    assert out.payload["ids"]["tts"] == [21, 22]
    assert out.payload["codes"]["ref"] == [1.0] * 5 and out.payload["meta"]["ref_audio_sr"] == 16000


def test_minicpmo_llm2tts_without_a_span_prompts_with_the_reply():
    source = result(prompt_token_ids=[11, 12], output_token_ids=[21], payload={"latent": torch.ones(1, 3)})
    out = minicpmo_4_5.llm2tts(source)  # the only row is the prompt's: no hidden row for the reply
    assert out.prompt_token_ids == [21]
    assert "tts" not in out.payload["ids"]


def test_minicpmo_llm2tts_errors():
    with pytest.raises(GlueError, match="no latent"):
        minicpmo_4_5.llm2tts(result(payload={}))
    with pytest.raises(GlueError, match="full-duplex"):
        minicpmo_4_5.llm2tts(result(payload={"latent": torch.ones(1, 2), "ids.prompt": [1]}))


def test_minicpmo_tts2code2wav_prepends_silence_and_replaces_the_buffer():
    codes = torch.tensor([[5], [6], [7]])
    source = result(
        payload={"codes.audio": codes},
        input_payload={"codes": {"ref": [0.5, 0.25]}, "meta": {"ref_audio_sr": 16000}},
    )
    out = minicpmo_4_5.tts2code2wav(source)
    assert out.payload["codes"]["audio"].tolist() == [4218, 4218, 4218, 5, 6, 7]
    assert out.payload["codes"]["ref"].tolist() == [0.5, 0.25]
    meta = out.payload["meta"]
    assert meta["replace_runtime_additional_information"] is True and meta["left_context_size"] == 3
    assert meta["code_flat_numel"] == 6 and meta["codec_chunk_frames"] == 3 and meta["ref_audio_sr"] == 16000
    assert out.prompt_token_ids == [0] * 6
    assert minicpmo_4_5.tts2code2wav(source, left_context_frames=0).payload["codes"]["audio"].tolist() == [
        5,
        6,
        7,
    ]


def test_minicpmo_tts2code2wav_without_codes_is_an_error():
    with pytest.raises(GlueError, match="no codec code"):
        minicpmo_4_5.tts2code2wav(result(payload={"codes.audio": torch.empty(0, 1)}))


# -- indextts2 ----------------------------------------------------------------------------------


def s2mel_meta() -> dict:
    return {"meta.S_ref": torch.ones(1, 2), "meta.ref_mel": torch.ones(1, 3), "meta.style": torch.ones(4)}


def test_indextts2_code_only_cuts_at_the_stop_code():
    payload = {"meta.use_gpt_latent": False, **s2mel_meta()}
    out = indextts2.talker2s2mel(result(payload=payload, output_token_ids=[4, 5, 8193, 6], seed=7))
    assert out.payload["mel_codes"].tolist() == [[4, 5]]
    assert out.payload["code_lens"].tolist() == [2]
    assert out.payload["use_gpt_latent"] is False and "latent" not in out.payload
    assert out.payload["duration_factor"] == 1.0 and out.payload["seed"] == 7
    assert out.prompt_token_ids == [0]


def test_indextts2_latent_is_cut_with_the_codes():
    latent = torch.arange(6.0).reshape(1, 3, 2)
    payload = {
        "meta.use_gpt_latent": True,
        "codes.mel": torch.tensor([[1, 8193, 2]]),
        "hidden_states.latent": latent,
    }
    out = indextts2.talker2s2mel(result(payload={**payload, **s2mel_meta(), "meta.duration_factor": 1.5}))
    assert out.payload["latent"].tolist() == [[[0.0, 1.0]]]
    assert out.payload["duration_factor"] == 1.5


def test_indextts2_errors():
    with pytest.raises(GlueError, match="use_gpt_latent"):
        indextts2.talker2s2mel(result(payload={}))
    bad = {
        "meta.use_gpt_latent": True,
        "codes.mel": torch.tensor([1, 2]),
        "hidden_states.latent": torch.ones(3, 2),
    }
    with pytest.raises(GlueError, match="2 mel codes but 3 latent rows"):
        indextts2.talker2s2mel(result(payload={**bad, **s2mel_meta()}))
    without_style = {"meta.use_gpt_latent": False, "meta.S_ref": torch.ones(1), "meta.ref_mel": torch.ones(1)}
    with pytest.raises(GlueError, match="meta.style"):
        indextts2.talker2s2mel(result(payload=without_style, output_token_ids=[1]))


# -- higgs_audio_v3, moss_tts, omnigen_tiny -----------------------------------------------------


def test_higgs_undoes_the_delay_pattern():
    q = higgs_audio_v3.NUM_CODEBOOKS
    frames = 3
    delayed = torch.full((frames + q - 1, q), 1024)  # BOC before, EOC after each codebook's run
    for i in range(q):
        delayed[i : i + frames, i] = torch.arange(frames) + 10 * i
    out = higgs_audio_v3.talker2code2wav(result(payload={"codes.audio": delayed}))
    # Codebook-major, the ramp-down frame dropped: codebook i gives 10i, 10i + 1.
    assert out.prompt_token_ids == [code for i in range(q) for code in (10 * i, 10 * i + 1)]
    assert out.payload == {}


def test_higgs_replaces_non_audio_codes_with_zero_and_needs_the_delay():
    delayed = torch.full((9, 8), 1025)
    out = higgs_audio_v3.talker2code2wav(result(payload={"codes.audio": delayed.reshape(-1)}))
    assert out.prompt_token_ids == [0] * 8
    with pytest.raises(GlueError, match="delay pattern"):
        higgs_audio_v3.talker2code2wav(result(payload={"codes.audio": torch.zeros(7, 8)}))


def test_higgs_prompt_bound_is_the_longest_take_of_a_budget():
    """The declared bound is the longest code2wav prompt a talker budget can give, and 9 tokens
    the fewest that give one: the talker publishes no codes at its prefill step, so a request of
    ``tokens`` sampled tokens has at most ``tokens - 1`` delay-pattern rows (the pipeline test
    tests/e2e/test_real_higgs_audio_v3.py checks that count against vllm-omni's runner)."""
    from omnigen.glue.types import min_producer_tokens, next_prompt_bound

    glue = higgs_audio_v3.talker2code2wav
    bound = next_prompt_bound(glue)
    assert bound is not None and min_producer_tokens(glue) == higgs_audio_v3.NUM_CODEBOOKS + 1
    for tokens in range(min_producer_tokens(glue), 40):
        takes = [
            len(
                glue(result(payload={"codes.audio": torch.zeros(rows, 8, dtype=torch.long)})).prompt_token_ids
            )
            for rows in range(higgs_audio_v3.NUM_CODEBOOKS, tokens)
        ]
        assert bound(tokens, {}, None) == max(takes), tokens


def test_moss_codes_become_the_codebook_major_prompt():
    codes = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert moss_tts.talker2codec(result(payload={"codes.audio": codes})).prompt_token_ids == [
        1,
        4,
        2,
        5,
        3,
        6,
    ]
    with pytest.raises(GlueError):
        moss_tts.talker2codec(result(payload={}))


def test_omnigen_tiny_uses_the_tiny_models_prompt_function():
    from omnigen_testing.tiny_omni import talker_to_code2wav

    codes = torch.tensor([[-1, -1], [1, 2], [3, 0]])
    out = tiny_glue.talker2code2wav(result(payload={"codes": {"audio": codes}}))
    assert out.prompt_token_ids == talker_to_code2wav({"codes.audio": codes})
    # The frames (no placeholder rows) travel as the payload too: the tiny code2wav checks them.
    assert out.payload.keys() == {"codes"} and torch.equal(out.payload["codes"]["audio"], codes[1:])


def test_omnigen_tiny_thinker_ids_become_the_talker_prompt_and_its_hidden_rows_the_payload():
    from omnigen_testing.tiny_omni import TALKER_TEXT_BASE, TALKER_TEXT_IDS, thinker_to_talker

    hidden = torch.arange(12, dtype=torch.float32).reshape(6, 2)  # 3 prompt + 4 output - 1 rows
    out = tiny_glue.thinker2talker(result(payload={"hidden": hidden}, output_token_ids=[0, 7, 399, 511]))
    assert out.prompt_token_ids == thinker_to_talker([0, 7, 399, 511]) == [10, 17, 409, 121]
    assert all(TALKER_TEXT_BASE <= t < TALKER_TEXT_BASE + TALKER_TEXT_IDS for t in out.prompt_token_ids)
    # Nested, as the talker's runner merges it into the request's buffer (CONTRACT 4.2).
    assert out.payload.keys() == {"thinker"} and out.payload["thinker"].keys() == {"hidden"}
    assert torch.equal(out.payload["thinker"]["hidden"], hidden)
    assert out.multi_modal_data is None


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"payload": {"hidden": torch.zeros(3, 2)}, "output_token_ids": []}, "no token"),
        ({"payload": {}, "output_token_ids": [5]}, "hidden rows"),
        ({"payload": {"hidden": torch.zeros(3)}, "output_token_ids": [5]}, "hidden rows"),
    ],
)
def test_omnigen_tiny_thinker_without_tokens_or_hidden_rows_fails_the_request(fields, reason):
    with pytest.raises(
        GlueError, match=rf"omnigen_testing\.tiny_glue\.thinker2talker: request 'req-0': .*{reason}"
    ):
        tiny_glue.thinker2talker(result(**fields))


# -- every function -----------------------------------------------------------------------------

SOURCES = {
    "omnigen.glue.qwen3_tts.talker2code2wav": lambda: result(
        payload={"codes.audio": torch.tensor([[1, 2], [3, 4]]), "codes.ref": [torch.tensor([[5, 6]])]},
        output_token_ids=[1, 2, 3],
    ),
    "omnigen.glue.qwen3_omni.thinker2talker": lambda: thinker_result(rows=8),
    "omnigen.glue.qwen3_omni.talker2code2wav": lambda: result(
        payload={"codes.audio": torch.tensor([[1, 2], [3, 4]])}, output_token_ids=[5, 6]
    ),
    "omnigen.glue.qwen2_5_omni.thinker2talker": lambda: result(
        payload={"hidden": torch.zeros(4, 2)}, output_token_ids=[7, 8]
    ),
    "omnigen.glue.qwen2_5_omni.talker2code2wav": lambda: result(output_token_ids=[5, 6, 8294]),
    "omnigen.glue.mimo_audio.llm2code2wav": lambda: result(payload={"codes.audio": torch.ones(2, 1, 8, 4)}),
    "omnigen.glue.minicpmo_4_5.llm2tts": lambda: result(
        output_token_ids=[21, 22], payload={"latent": torch.ones(4, 2)}
    ),
    "omnigen.glue.minicpmo_4_5.tts2code2wav": lambda: result(
        payload={"codes.audio": torch.tensor([[5], [6]])}
    ),
    "omnigen.glue.indextts2.talker2s2mel": lambda: result(
        payload={"meta.use_gpt_latent": False, **s2mel_meta()}, output_token_ids=[4, 8193]
    ),
    "omnigen.glue.higgs_audio_v3.talker2code2wav": lambda: result(payload={"codes.audio": torch.zeros(9, 8)}),
    "omnigen.glue.moss_tts.talker2codec": lambda: result(payload={"codes.audio": torch.tensor([[1, 2]])}),
    "omnigen_testing.tiny_glue.talker2code2wav": lambda: result(
        payload={"codes.audio": torch.tensor([[1, 2]])}
    ),
    "omnigen_testing.tiny_glue.thinker2talker": lambda: result(
        payload={"hidden": torch.ones(4, 2)}, output_token_ids=[3, 4]
    ),
}


# omnigen's ports, and the tiny test models' glue (a config's own functions, by dotted path).
FUNCTIONS = {
    **GLUE,
    "omnigen_testing.tiny_glue.talker2code2wav": tiny_glue.talker2code2wav,
    "omnigen_testing.tiny_glue.thinker2talker": tiny_glue.thinker2talker,
}


def test_every_function_has_a_case_here():
    assert set(SOURCES) == set(FUNCTIONS)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_inputs_are_left_alone_and_outputs_are_plain_cpu_values(name):
    source = SOURCES[name]()
    before = copy.deepcopy(source.payload)
    out = FUNCTIONS[name](source)
    assert all(isinstance(token, int) for token in out.prompt_token_ids) and out.prompt_token_ids
    for key, value in before.items():
        held = source.payload[key]
        assert all(torch.equal(a, b) for a, b in zip(_tensors(held), _tensors(value), strict=True)), key
    sent = list(_tensors(out.payload))
    inputs = list(_tensors(source.payload))
    assert all(tensor.device.type == "cpu" for tensor in sent)
    # The next stage never shares storage with the producer's buffers: a consumer may write its buffer.
    shared = [
        t for t in sent for s in inputs if t.untyped_storage().data_ptr() == s.untyped_storage().data_ptr()
    ]
    assert not shared, f"{name}: a sent tensor aliases the producer's payload"


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_requests_are_independent(name):
    # The driver calls a function once per finished request; two calls never share results.
    first, second = FUNCTIONS[name](SOURCES[name]()), FUNCTIONS[name](SOURCES[name]())
    assert (
        first.prompt_token_ids == second.prompt_token_ids
        and first.prompt_token_ids is not second.prompt_token_ids
    )
    assert first.payload is not second.payload
