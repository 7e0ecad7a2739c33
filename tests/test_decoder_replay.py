"""SpecDecoder's public loop inside the replay protocol (``bench/decoder_replay.py``): on real
sessions, ``open_session`` / ``append(text=...)`` / ``propose`` / ``commit`` / ``close_*``
emit exactly the trajectory (checked at every step inside the lane), capture the files the
agent read into the workspace, and reach the harness's own agspec lane's acceptance."""

import dataclasses
import sys
from pathlib import Path

import pytest

from agspec_gpu.capture import capture_tool_output
from agspec_gpu.replay import ReplayConfig, run_replay, tokenize_sessions
from agspec_gpu.tokenizer import load_tokenizer
from agspec_gpu.trajectories import load_sessions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import decoder_replay  # noqa: E402  (bench/ is not a package)

DEV = Path("/work/shared/data/trajectories/dev")


def sessions():
    """The first aider session, and a mini-swe-agent session cut after the assistant message
    that follows its first file read whose capture needs the command (``nl``/``sed``)."""
    if not DEV.is_dir():
        pytest.skip("needs the dev trajectories")
    aider = load_sessions(DEV / "aider__chat_history.jsonl.gz", limit=1)[0]
    mini = load_sessions(DEV / "mini_swe_agent__gemini-3-pro-preview.jsonl.gz", limit=1)[0]
    m = mini.messages
    read = next(i for i in range(1, len(m))
                if m[i].role == "tool" and m[i - 1].role == "assistant" and
                capture_tool_output(m[i - 1].content, m[i].content) and
                not capture_tool_output(None, m[i].content))
    nxt = next(i for i in range(read + 1, len(m)) if m[i].role == "assistant")
    return [aider, dataclasses.replace(mini, messages=m[:nxt + 1])], m[read - 1].content, \
        m[read].content


def test_decoder_lane_emits_the_trajectory_and_matches_the_harness():
    tok = load_tokenizer("cl100k")
    picked, command, output = sessions()
    corpus = tokenize_sessions(picked, tok)
    lanes = []

    def factory():
        lanes.append(decoder_replay.decoder_lane("decoder", tok, 2, True)())
        return lanes[-1]

    report = run_replay(corpus, ["agspec", ("decoder", factory)], tok,
                        ReplayConfig(batch_size=2))
    tau = {r["drafter"]: r["tau"] for r in report.rows if r["agent"] == "all"}
    steps = {r["drafter"]: r["steps"] for r in report.rows if r["agent"] == "all"}
    assert steps["decoder"] > 100
    # the same drafter and corpora: the same acceptance up to when files join the workspace
    assert tau["decoder"] == pytest.approx(tau["agspec"], rel=0.03), tau
    shown = {f.path for f in capture_tool_output(command, output)}
    assert shown and shown <= set(lanes[0].captured), (shown, lanes[0].captured)
