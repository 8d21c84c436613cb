"""A short soak of ``omnigen serve`` through benchmarks/soak.py (the full one: run it by hand).

240 requests at 16 concurrent against the tiny talker -> code2wav server (a subprocess, as a user
starts it), the soak's mix: 5% malformed (every variant once), 5% clients that disconnect
mid-request, the rest valid; then SIGTERM with requests in flight. No valid request gets a 5xx,
no engine dies, every malformed request gets a 4xx, the runners hold no request's state and no
shared-memory segment is left, the resident memory stays within 1.5x of warm-up, and the server
exits 128+15 after shutting every engine down, leaving no process.
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import soak

pytestmark = pytest.mark.e2e

SETTINGS = dataclasses.replace(soak.SoakSettings(), requests=240, concurrency=16, load_deadline_s=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    log = tmp_path_factory.mktemp("soak") / "server.log"
    found = soak.soak(dataclasses.replace(SETTINGS, server_log=str(log)))
    print("\n" + soak.summary(found))  # the figures, with -s or in the failure report
    return found


def test_every_malformed_variant_was_sent_and_each_got_a_4xx(report):
    load = report["load"]
    assert set(load["malformed_by_variant"]) == set(soak.MALFORMED_VARIANTS)
    assert load["malformed_not_4xx"] == []
    for variant, statuses in load["malformed_by_variant"].items():
        assert all(400 <= int(status) < 500 for status in statuses), (variant, statuses)


def test_valid_requests_get_200_and_no_engine_dies(report):
    load, after = report["load"], report["after"]
    assert load["valid_5xx"] == 0, load["status_counts"]
    assert load["status_counts"]["valid"] == {"200": report["planned"]["valid"]}, load["status_counts"]
    assert load["valid_bad_body"] == [] and load["unfinished"] == 0 and load["no_request_id"] == 0
    assert after["engine_deaths_metric"] == 0
    assert after["health"] == {"status": 200, "body": {"status": "ok"}}


def test_disconnected_clients_leave_no_state_and_no_segment(report):
    load, after = report["load"], report["after"]
    # Each gave up before its answer, and the server aborted it in every stage.
    assert load["disconnects_timed_out"] == report["planned"]["disconnect"], load["status_counts"]
    assert after["server_aborts_logged"] >= 1
    assert after["final_request"]["status"] == 200
    assert after["leaked_state"] == {}
    assert after["segments_left"] == []


def test_resident_memory_stays_within_1_5x_of_warm_up(report):
    rss = report["rss"]
    print(f"RSS warm-up {rss['warmup_mib']} MiB -> end {rss['end_mib']} MiB: x{rss['ratio']}")
    assert rss["ratio"] is not None and rss["ratio"] < 1.5, rss


def test_sigterm_with_requests_in_flight_leaves_nothing(report):
    sigterm = report["sigterm"]
    assert sigterm["in_flight_at_sigterm"] > 0
    assert sigterm["in_flight_hung"] == [] and sigterm["in_flight_not_clean"] == [], sigterm
    assert sigterm["processes_left"] == [], sigterm
    assert sigterm["segments_left"] == []
    assert sigterm["exit_status"] == 128 + 15, sigterm  # SIGTERM, after the engines shut down
    assert sigterm["engines_shut_down_logged"]


def test_the_soak_found_no_problem(report):
    assert report["problems"] == []
