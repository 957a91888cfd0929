"""Capture from a training loop: off by default, harmless, exact, redacted, filtered."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trajstore.examples import tiny_grpo as tiny

from trajstore.capture import CaptureConfig, CaptureConfigError, CaptureManager
from trajstore.capture.manager import NULL_STEP, STAGING
from trajstore.cli import main as cli_main
from trajstore.store.api import Store

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SECRET = "sk-live-Zq9XWv3SECRETb7Tn"


def cli(*args: str) -> subprocess.CompletedProcess:
    """`trajstore *args` run in this process (`trajstore.cli.main`), its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def enabled(out: Path, **kw) -> CaptureConfig:
    return CaptureConfig(enabled=True, output_dir=out, run="t", **kw)


def one_step(cap: CaptureManager, rollout_id: int = 0, step_id: int = 0, **tensors) -> bool:
    """A one-micro-batch step of two samples (3 + 2 response tokens)."""
    step_tensors = {
        "log_probs": torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3]),
        "old_log_probs": torch.tensor([-1.1, -0.4, -2.0, -0.2, -0.3]),
        "advantages": torch.tensor([0.7, 0.7, 0.7, -0.7, -0.7]),
        "entropy": torch.tensor([1.0, 1.1, 0.9, 1.2, 1.3]),
        "loss_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]),
        **tensors,
    }
    samples = [
        {
            "sample_id": "a",
            "group_index": 0,
            "response_length": 3,
            "total_length": 5,
            "reward": 0.7,
        },
        {
            "sample_id": "b",
            "group_index": 0,
            "response_length": 2,
            "total_length": 4,
            "reward": -0.7,
        },
    ]
    with cap.step(rollout_id, step_id) as st:
        st.add(0, samples=samples, **step_tensors)
    return st is not NULL_STEP


def payload(bundle: Path, name: str) -> torch.Tensor:
    return torch.load(bundle / "payloads" / f"{name}.pt", weights_only=True)


# --------------------------------------------------------------------------- configuration


def test_capture_is_off_without_the_switch(tmp_path):
    cap = CaptureManager.from_env(environ={"TRAJSTORE_CAPTURE_DIR": str(tmp_path)})
    assert not cap.enabled
    assert cap.step(0, 0) is NULL_STEP
    assert cap.rollout(0, []) is False
    cap.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"TRAJSTORE_CAPTURE_STEPS": "120-0"}, "TRAJSTORE_CAPTURE_STEPS"),
        ({"RELAX_REPLAY_CAPTURE_STEPS": "1:x"}, "RELAX_REPLAY_CAPTURE_STEPS"),
        ({"TRAJSTORE_CAPTURE_ROLLOUTS": "3,seven"}, "TRAJSTORE_CAPTURE_ROLLOUTS"),
        ({"TRAJSTORE_CAPTURE": "maybe"}, "TRAJSTORE_CAPTURE"),
        ({"TRAJSTORE_CAPTURE_QUEUE_SIZE": "0"}, "TRAJSTORE_CAPTURE_QUEUE_SIZE"),
        ({"TRAJSTORE_CAPTURE_BLOCK": "sometimes"}, "TRAJSTORE_CAPTURE_BLOCK"),
        ({"TRAJSTORE_CAPTURE_REDACT": "prompt=rot13"}, "TRAJSTORE_CAPTURE_REDACT"),
        ({"TRAJSTORE_CAPTURE": "1"}, "TRAJSTORE_CAPTURE_DIR"),
        (
            {"TRAJSTORE_CAPTURE_DIR": "/a", "RELAX_REPLAY_CAPTURE_DIR": "/b"},
            "RELAX_REPLAY_CAPTURE_DIR",
        ),
        ({"TRAJSTORE_RUN": "../escape"}, "run name"),
        ({"TRAJSTORE_CAPTURE_STPES": "120:0"}, "unknown capture variable TRAJSTORE_CAPTURE_STPES"),
        ({"TRAJSTORE_CAPTURES": "1"}, "unknown capture variable TRAJSTORE_CAPTURES"),
    ],
)
def test_malformed_env_var_is_an_error_at_construction(env, names):
    with pytest.raises(CaptureConfigError, match=names.replace("_", ".")):
        CaptureManager.from_env(environ=env)


@pytest.mark.parametrize("where", ["output_dir", "store_dir"])
def test_a_destination_that_is_a_file_is_an_error_at_construction(tmp_path, where):
    (tmp_path / "a-file").write_text("kept")
    with pytest.raises(
        CaptureConfigError, match=f"{where} .*a-file: exists and is not a directory"
    ):
        CaptureManager(CaptureConfig(enabled=True, **{where: tmp_path / "a-file"}))
    with pytest.raises(CaptureConfigError, match="a-file: exists and is not a directory"):
        CaptureManager(CaptureConfig(enabled=True, **{where: tmp_path / "a-file" / "sub"}))
    assert (tmp_path / "a-file").read_text() == "kept"


def test_an_unusable_destination_is_not_checked_while_capture_is_off(tmp_path):
    (tmp_path / "a-file").write_text("kept")
    assert not CaptureConfig(enabled=False, output_dir=tmp_path / "a-file").enabled


def test_unknown_capture_variable_error_names_the_known_ones():
    with pytest.raises(CaptureConfigError) as err:
        CaptureConfig.from_env({"TRAJSTORE_CAPTURE_STPES": "120:0"})
    assert "TRAJSTORE_CAPTURE_STEPS" in str(err.value) and "TRAJSTORE_CAPTURE_DIR" in str(err.value)


def test_other_variables_of_either_family_are_not_checked():
    # the producer's RELAX_REPLAY_* family has variables of its own; other TRAJSTORE_* too
    cfg = CaptureConfig.from_env({"RELAX_REPLAY_CAPTURE_EXTRA": "x", "TRAJSTORE_STORE": "/s"})
    assert not cfg.enabled


def test_a_capture_dir_with_a_tilde_is_under_home(tmp_path, monkeypatch):
    # an env file does not expand "~": capture wrote into a literal ./~/caps of the job's cwd
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = CaptureConfig.from_env({"TRAJSTORE_CAPTURE": "1", "TRAJSTORE_CAPTURE_DIR": "~/caps"})
    assert cfg.output_dir == tmp_path / "caps"


def test_public_producer_spellings_are_accepted(tmp_path):
    cfg = CaptureConfig.from_env(
        {
            "RELAX_REPLAY_CAPTURE": "1",
            "RELAX_REPLAY_CAPTURE_DIR": str(tmp_path),
            "RELAX_REPLAY_CAPTURE_STEPS": "0:0, 3:1",
            "RELAX_REPLAY_CAPTURE_ROLLOUTS": "2",
        }
    )
    assert cfg.enabled and cfg.output_dir == tmp_path
    assert cfg.steps == {(0, 0), (3, 1)} and cfg.rollouts == {2}


# --------------------------------------------------------------------------- the tiny loop


def train(seed: int, capture: CaptureManager | None, rollouts: int = 2):
    loop = tiny.TinyGRPO(seed, capture=capture)
    loop.train(rollouts)
    return loop


def test_capture_changes_no_parameter_and_replays_clean(tmp_path):
    off = train(7, None)
    cap = CaptureManager(enabled(tmp_path), recompute=tiny.TinyGRPO(0).recompute_config())
    on = train(7, cap)
    stats = cap.close()
    for (name, a), (_, b) in zip(
        off.model.state_dict().items(), on.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert (stats.written, stats.dropped, stats.errors) == (6, 0, 0)
    for sel in ("--step=0:0", "--step=0:1", "--step=1:0", "--step=1:1"):
        r = cli("replay", str(tmp_path), sel, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        stages = {s["stage"]: s["status"] for s in json.loads(r.stdout)["bundles"][0]["stages"]}
        assert stages["loss.policy"] == "pass" and stages["advantage.estimate"] == "pass"
    for sel in ("--rollout=0", "--rollout=1"):
        r = cli("replay", str(tmp_path), sel, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        stages = {s["stage"]: s["status"] for s in json.loads(r.stdout)["bundles"][0]["stages"]}
        for st in ("reward.raw", "reward.post_process", "advantage.kl", "advantage.estimate"):
            assert stages[st] == "pass", st


def test_step_expected_loss_is_the_sum_over_micro_batches(tmp_path):
    cap = CaptureManager(enabled(tmp_path), recompute=tiny.TinyGRPO(0).recompute_config())
    loop = tiny.TinyGRPO(3, capture=cap)
    ro = loop.rollout(0)
    totals = loop.train_step(ro, 0)
    cap.close()
    expected = json.loads((tmp_path / "replay-0-0" / "expected.json").read_text())["loss.policy"]
    index = json.loads((tmp_path / "replay-0-0" / "index.json").read_text())
    assert index["identity"]["micro_batch_ids"] == ["mb-0000", "mb-0001"]
    assert set(expected) == set(totals)
    for k, v in totals.items():
        assert expected[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k


def test_in_place_update_after_add_does_not_change_the_bundle(tmp_path):
    cap = CaptureManager(enabled(tmp_path))
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3])
    adv_buffer = torch.tensor([0.7, 0.7, 0.7, -0.7, -0.7, 9.0, 9.0])
    st = cap.step(0, 0)
    st.add(
        0,
        samples=[
            {"sample_id": "a", "group_index": 0, "response_length": 3, "total_length": 3},
            {"sample_id": "b", "group_index": 0, "response_length": 2, "total_length": 2},
        ],
        log_probs=lp,
        old_log_probs=lp,
        advantages=adv_buffer[:5],  # a view into a reused buffer
    )
    lp.add_(100.0)  # the trainer reuses its buffers before the writer runs
    adv_buffer.zero_()
    st.end()
    cap.close()
    bundle = tmp_path / "replay-0-0"
    assert torch.equal(payload(bundle, "log_probs"), torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3]))
    assert torch.equal(payload(bundle, "advantages"), torch.tensor([0.7, 0.7, 0.7, -0.7, -0.7]))


def test_only_requested_steps_and_rollouts_are_written(tmp_path):
    cap = CaptureManager.from_env(
        environ={
            "TRAJSTORE_CAPTURE": "1",
            "TRAJSTORE_CAPTURE_DIR": str(tmp_path),
            "TRAJSTORE_CAPTURE_STEPS": "0:1,1:0",
            "TRAJSTORE_CAPTURE_ROLLOUTS": "1",
        },
        recompute=tiny.TinyGRPO(0).recompute_config(),
    )
    train(1, cap)
    stats = cap.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "replay-0-1",
        "replay-1-0",
        "replay-rollout-1",
    ]
    assert stats.skipped == 3


# --------------------------------------------------------------------------- secrets


def test_secret_in_prompt_env_and_config_is_written_nowhere(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    args = argparse.Namespace(
        eps_clip=0.2,
        entropy_coef=0.0,
        api_key=SECRET,
        load=f"/ckpt/{SECRET}/iter_0000100",
        reward_endpoint=f"http://rm.internal/{SECRET}",
    )
    cap = CaptureManager(enabled(tmp_path), recompute=args)
    samples = [
        {
            "sample_id": "a",
            "group_index": 0,
            "response_length": 2,
            "total_length": 4,
            "prompt": f"my key is {SECRET}",
            "response": SECRET,
            "label": SECRET,
            "tool_output": SECRET,
            "source": f"/data/{SECRET}.jsonl",
            "endpoint": f"http://{SECRET}",
            "metadata": {"token": SECRET},
        },
        {
            "sample_id": "b",
            "group_index": 0,
            "response_length": 1,
            "total_length": 3,
            "prompt": f"my key is {SECRET}",
        },
    ]
    assert cap.rollout(
        0,
        samples,
        raw_rewards=torch.tensor([1.0, 0.0]),
        rewards=torch.tensor([0.7, -0.7]),
        advantages=torch.tensor([0.7, 0.7, -0.7]),
        weight_lineage={"rollout_weight": f"/ckpt/{SECRET}/iter_99", "actor_weight": "w-100"},
    )
    stats = cap.close()
    assert stats.written == 1 and stats.errors == 0
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) >= 6
    for p in files:
        data = p.read_bytes()
        assert SECRET.encode() not in data, p
        assert b"SECRET" not in data, p
    index = json.loads((tmp_path / "replay-rollout-0" / "index.json").read_text())
    manifest = json.loads((tmp_path / "replay-rollout-0" / "manifest.json").read_text())
    assert index["config"] == {"entropy_coef": 0.0, "eps_clip": 0.2}
    assert index["samples"][0]["prompt_hash"].startswith("sha256:")
    assert index["samples"][0]["label_hash"].startswith("sha256:")
    assert (
        manifest["redaction"]["prompt"] == "hash" and manifest["redaction"]["tool_output"] == "drop"
    )


def test_truncate_and_drop_rules_are_applied_and_recorded(tmp_path):
    cfg = enabled(tmp_path, redaction="prompt=truncate:5,response=drop")
    cap = CaptureManager(cfg)
    cap.rollout(
        0,
        [
            {
                "sample_id": "a",
                "group_index": 0,
                "response_length": 1,
                "total_length": 2,
                "prompt": "hello world",
                "response": "bye",
            }
        ],
        advantages=torch.tensor([0.0]),
    )
    cap.close()
    rec = json.loads((tmp_path / "replay-rollout-0" / "index.json").read_text())["samples"][0]
    assert rec["prompt"] == "hello" and "response" not in rec and "response_hash" not in rec
    manifest = json.loads((tmp_path / "replay-rollout-0" / "manifest.json").read_text())
    assert manifest["redaction"]["prompt"] == "truncate:5"


# --------------------------------------------------------------------------- harmless


def test_full_queue_drops_and_counts_instead_of_waiting(tmp_path):
    cap = CaptureManager(enabled(tmp_path, queue_size=1))
    for s in range(40):
        one_step(cap, 0, s)
    stats = cap.close()
    assert stats.dropped > 0
    assert stats.written + stats.dropped == 40
    assert len(list(tmp_path.iterdir())) == stats.written


def test_blocking_queue_writes_everything(tmp_path):
    cap = CaptureManager(enabled(tmp_path, queue_size=1, block=True))
    for s in range(10):
        one_step(cap, 0, s)
    stats = cap.close()
    assert (stats.written, stats.dropped) == (10, 0)


def test_writer_error_is_counted_not_raised(tmp_path):
    blocker = tmp_path / "not-a-dir"
    cap = CaptureManager(CaptureConfig(enabled=True, output_dir=blocker, run="t"))
    blocker.write_text("x")  # the destination breaks after start-up (its check passed)
    assert one_step(cap)
    stats = cap.close()
    assert (stats.written, stats.errors) == (0, 1)


def test_bad_input_to_add_is_counted_not_raised(tmp_path):
    cap = CaptureManager(enabled(tmp_path))
    st = cap.step(0, 0)
    st.add(
        0,
        samples=[{"sample_id": "a", "response_length": 1}],
        log_probs=object(),
        old_log_probs=torch.zeros(1),
        advantages=torch.zeros(1),
    )
    assert st.end() is False
    assert cap.close().errors == 1


#: five steps, then a normal exit without close(): the exit hook must flush. The tests
#: folder goes first on sys.path: verl and TransferQueue install a top-level ``tests``
#: package into site-packages, which ``from tests.test_capture import`` would find instead.
EXIT_CODE = (
    f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r});"
    "from test_capture import one_step;"
    "from trajstore.capture import CaptureManager;"
    "cap = CaptureManager.from_env();"
    "[one_step(cap, 0, s) for s in range(5)]"
)


def test_interpreter_exit_flushes_the_queue(tmp_path):
    env = {
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_DIR": str(tmp_path),
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run(
        [sys.executable, "-c", EXIT_CODE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"replay-0-{s}" for s in range(5)]
    assert all((p / "COMPLETE").exists() for p in tmp_path.iterdir())


def test_interpreter_exit_publishes_into_a_store(tmp_path):
    """Store mode at exit: the ingest's thread pools must still take work when the exit
    hook flushes (they refuse it once Python's thread shutdown has begun)."""
    store_dir = tmp_path / "store"
    Store.open(store_dir).close()
    env = {
        "TRAJSTORE_CAPTURE": "1",
        "TRAJSTORE_CAPTURE_STORE": str(store_dir),
        "TRAJSTORE_RUN": "atexit",
        "PATH": "/usr/bin:/bin",
    }
    r = subprocess.run(
        [sys.executable, "-c", EXIT_CODE], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert "cannot schedule new futures" not in r.stderr
    staged = store_dir / STAGING / "atexit"
    assert sorted(p.name for p in staged.iterdir() if p.name.startswith("replay-")) == []
    with Store.open(store_dir) as store:
        steps = sorted((row["rollout_id"], row["step_id"]) for row in store.bundles(run="atexit"))
    assert steps == [(0, s) for s in range(5)]


# --------------------------------------------------------------------------- store mode


def test_store_mode_ingests_completed_bundles(tmp_path):
    store_dir = tmp_path / "store"
    Store.open(store_dir)  # a store must exist before a trainer writes into it
    cap = CaptureManager(CaptureConfig(enabled=True, store_dir=store_dir, run="runA"))
    assert one_step(cap, 4, 2)
    stats = cap.close()
    assert (stats.written, stats.ingested, stats.errors) == (1, 1, 0)
    r = cli("replay", "--store", str(store_dir), "--step", "4:2", "--run", "runA")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (store_dir / ".capture-staging" / "runA" / "replay-4-2").exists()
