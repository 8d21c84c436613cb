"""``serve.mode=ray`` without a cluster: its settings, what is refused and how, the ``ray``
transport's handles, and that nothing imports Ray before ray mode runs (issue 38).

The cluster itself (replicas on nodes, a replica killed, shutdown) is tests/e2e/test_pipeline_ray.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from omnigen import api, pipeline
from omnigen.pipeline_commands import serve_overrides
from omnigen.serving.settings import SettingsError, read_settings


def _settings(overrides: list[str]):
    overrides = serve_overrides("omnigen_tiny", overrides)
    cfg = pipeline.compose_config("omnigen_tiny", overrides)
    return read_settings(cfg, api.served_model("omnigen_tiny", overrides))


def test_importing_omnigen_does_not_import_ray():
    code = (
        "import sys\n"
        "import omnigen.cli, omnigen.serving.pipeline, omnigen.serving.http, omnigen.serving.streaming\n"
        "import omnigen.runtime.transport as t\n"
        "t.transport_for('inline'); t.transport_for('shm').close()\n"
        "assert 'ray' not in sys.modules, 'ray imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_per_stage_keys_merge_over_every_stages_and_are_typed_on_the_command_line():
    from omnigen.serving.ray_stages import RayOptions, StagePlacement

    settings = _settings(
        [
            "serve.mode=ray",
            "serve.ray.address=10.0.0.1:6379",
            "serve.ray.replica.num_cpus=0.5",
            "serve.ray.replica.resources.any_host=1",
            "serve.ray.stages.talker.replicas=2",
            "serve.ray.stages.talker.resources={talker_host: 1}",
            "serve.ray.env_vars.VLLM_CPU_KVCACHE_SPACE=1",
        ]
    )
    options = RayOptions.from_config(settings.ray)
    assert options.address == "10.0.0.1:6379"
    assert options.env_vars == {"VLLM_CPU_KVCACHE_SPACE": "1"}, "a number is written as text"
    # A stage's keys replace every stage's (resources too: the talker needs only its host).
    assert options.stage("talker") == StagePlacement(replicas=2, num_cpus=0.5, resources={"talker_host": 1})
    assert options.stage("code2wav") == StagePlacement(num_cpus=0.5, resources={"any_host": 1.0})


def test_a_whole_map_is_taken_on_the_command_line_as_one_of_its_keys_is():
    from omnigen.serving.ray_stages import RayOptions

    settings = _settings(
        [
            "serve.mode=ray",
            "serve.ray.replica.resources={speech_host: 1}",
            "serve.ray.stages.talker.resources={talker_host: 1}",
            "serve.engine={max_num_seqs: 4}",
        ]
    )
    options = RayOptions.from_config(settings.ray)
    assert options.stage("code2wav").resources == {"speech_host": 1}
    assert options.stage("talker").resources == {"talker_host": 1}
    assert all(kwargs["max_num_seqs"] == 4 for kwargs in settings.engine_kwargs.values())


def test_bad_ray_keys_are_named_with_the_fix():
    with pytest.raises(SettingsError) as info:
        _settings(
            [
                "serve.mode=ray",
                "serve.ray.stages.talkr.replicas=2",
                "serve.ray.stages.code2wav.replica=2",
                "serve.ray.stages.talker.replicas=0",
                "serve.ray.replica.num_cpus=-1",
                "serve.ray.stages.talker.resources={gpu_host: 0}",
                "serve.ray.placement_timeout_s=0",
            ]
        )
    message = str(info.value)
    assert (
        "serve.ray.stages.talkr: omnigen_tiny has no stage 'talkr'; its stages: talker, code2wav" in message
    )
    assert "serve.ray.stages.code2wav.replica: not a replica key; use one of label_selector" in message
    assert "serve.ray.stages.talker.replicas: 0 must be a whole number >= 1" in message
    assert "serve.ray.replica.num_cpus: -1.0 must be a number >= 0" in message
    assert "serve.ray.stages.talker.resources.gpu_host: 0 must be a positive number" in message
    assert "serve.ray.placement_timeout_s: 0.0 must be a positive number of seconds" in message


def test_ray_keys_in_another_mode_are_refused_not_ignored():
    with pytest.raises(SettingsError, match=r"serve.ray.stages: read in serve.mode=ray only \(mode is mp\)"):
        _settings(["serve.ray.stages.talker.replicas=2"])
    assert _settings(["serve.mode=ray"]).ray is not None
    assert _settings([]).ray is None


def test_the_ray_transport_outside_ray_mode_names_the_key():
    from omnigen.serving.pipeline import Pipeline

    with pytest.raises(ValueError, match=r"model.stages.talker.transport: ray .* set serve.mode=ray"):
        Pipeline.from_model(
            api.served_model("omnigen_tiny", ["model.stages.talker.transport=ray"]),
            {"talker": "unused", "code2wav": "unused"},
            mode="mp",
        )
    with pytest.raises(ValueError, match=r"serve.ray\) is read in mode='ray' only"):
        Pipeline.from_model("omnigen_tiny", {"talker": "x", "code2wav": "y"}, mode="inproc", ray={})


def test_overrides_that_keep_the_generated_workers_are_taken_others_refused():
    from omnigen.serving.pipeline import Pipeline
    from omnigen.serving.ray_stages import RayModeError

    # An edge's transport is a serving key: the committed worker serves it, in every mode.
    kept = api.served_model("omnigen_tiny", ["model.stages.talker.transport=ray"])
    assert kept.stage("talker").transport == "ray" and not kept.stage("talker").in_memory
    assert kept.stage("talker").worker_cls == "omnigen.generated.omnigen_tiny.talker.OmnigenTinyTalkerWorker"
    # The model's sampler changes the talker's generated module: a variant of this process only.
    variant = api.served_model("omnigen_tiny", ["model.stages.talker.sampler=model"])
    assert variant.stage("talker").in_memory and not variant.stage("code2wav").in_memory
    assert variant.stage("talker").worker_cls.startswith("omnigen._variants.omnigen_tiny.talker_")
    models = {"talker": "unused", "code2wav": "unused"}
    with pytest.raises(
        RayModeError, match=r"change omnigen_tiny's generated omnigen_tiny/talker.py.*omnigen build"
    ):
        Pipeline.from_model(variant, models, mode="ray", ray={"address": "127.0.0.1:1"})
    with pytest.raises(ValueError, match=r"generated omnigen_tiny/talker.py: build them into conf/"):
        Pipeline.from_model(variant, models, mode="mp")


def test_a_ray_handle_is_refused_without_ray_and_by_the_other_transports():
    from omnigen.runtime.transport import TRANSPORT_KEY, TransportError, transport_for, transport_for_handle

    ray_transport = transport_for("ray")
    assert ray_transport.name == "ray"
    with pytest.raises(TransportError, match="needs Ray \\(serve.mode=ray\\)"):
        ray_transport.put("req-1", {"x": 1})
    handle = {TRANSPORT_KEY: "ray", "version": 1, "key": "req-1", "object_id": "00ff", "size": 3}
    with pytest.raises(TransportError, match="holds no Ray object"):
        transport_for_handle(handle).take(dict(handle))
    with pytest.raises(TransportError, match="a 'ray' handle given to the inline transport"):
        transport_for("inline").get(handle)
