"""A draft model through the whole bootstrap: ``bootstrap run --draft-model`` answers with the
same greedy tokens as without one and reports the acceptance in ``--json``; ``bootstrap serve``
speculates whenever a draft is configured and shows the acceptance in ``/metrics``; a draft
whose vocabulary differs is refused in ``resolve_classes`` naming both models and sizes."""

from __future__ import annotations

import json
import shutil

import httpx
from helpers.serve_process import ServeProcess, metric

from bootstrap.cli.main import main

PROMPT = "w5 w37 w33 w9 w64"


def run_json(capsys, *flags: str) -> dict:
    code = main(
        [
            "run",
            "--device",
            "cpu",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "20",
            "--temperature",
            "0",
            "--json",
            "--no-plan-cache",
            *flags,
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    return out


def test_run_with_a_draft_gives_the_same_greedy_tokens_and_reports_the_acceptance(checkpoint, capsys):
    plain = run_json(capsys, "--model", str(checkpoint))
    drafted = run_json(
        capsys, "--model", str(checkpoint), "--draft-model", str(checkpoint), "--num-speculative-tokens", "3"
    )
    assert drafted["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 20
    assert plain["speculation"] is None
    spec = drafted["speculation"]
    # the draft is the target itself: every proposal kept, up to 3 a step (fewer as max_tokens nears)
    assert spec["acceptance_rate"] == 1.0 and spec["accepted"] == spec["proposed"] > 0
    assert spec["acceptance_by_position"] == [1.0, 1.0, 1.0]
    assert (
        spec["mean_accepted_length"] == round(spec["accepted"] / spec["steps"], 4) and spec["mean_accepted_length"] > 2
    )
    assert set(drafted["plan"]["pools"]) == {"target", "draft"}


def test_serve_speculates_with_a_draft_and_its_metrics_say_how_well(checkpoint, tmp_path):
    server = ServeProcess(
        tmp_path / "serve.log", "--model", str(checkpoint), "--draft-model", str(checkpoint), "--no-plan-cache"
    )
    try:
        server.wait_state("ready")
        reply = httpx.post(
            f"{server.url}/v1/completions",
            timeout=60,
            json={"model": str(checkpoint), "prompt": PROMPT, "max_tokens": 16, "temperature": 0},
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 16
        page = httpx.get(f"{server.url}/metrics").text
        assert metric(page, "bootstrap_spec_draft_tokens_proposed") > 0
        assert metric(page, "bootstrap_spec_acceptance_rate", position="all") == 1.0
        assert metric(page, "bootstrap_spec_acceptance_rate", position="3") == 1.0  # k = 4 by default
    finally:
        server.stop()


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused_before_any_weight_loads(
    checkpoint, tmp_path, capsys
):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["w5"], vocab["w6"] = vocab["w6"], vocab["w5"]  # the same 256 tokens, two of them swapped
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    code = main(
        [
            "run",
            "--device",
            "cpu",
            "--model",
            str(checkpoint),
            "--draft-model",
            str(other),
            "--prompt",
            PROMPT,
            "--no-plan-cache",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "resolve_classes" in err and "2 tokens have other ids" in err
    assert f"{str(other)!r}'s tokenizer (256 tokens) is not the target {str(checkpoint)!r}'s" in err
    assert "load_model" not in err.split("resolve_classes", 1)[1]  # it stopped there, before the weights
