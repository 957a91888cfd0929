"""slime's debug dumps in and out of a store: `ingest --from slime`, replay, `export --to slime`.

The dumps are written as slime writes them (`trajstore.examples.slime_dumps`: slime's
``Sample.to_dict()`` field by field, ``torch.save``, the train dump's ``dp_shards``
layout); what slime reads back is judged by `load_debug_rollout_data` below, a plain
transcription of slime's own (slime/observability/rollout_data_utils.py
``load_debug_rollout_data``, slime/utils/types.py ``Sample.from_dict``, THUDM/slime
624b824). The replay's numbers are judged by the transcriptions of slime's math below
(slime/ray/rollout.py ``_post_process_rewards``; slime/utils/ppo_utils.py
``compute_approx_kl``, ``get_grpo_returns``, ``get_reinforce_plus_plus_returns``,
``get_reinforce_plus_plus_baseline_advantages``; slime/utils/distributed_utils.py
``distributed_masked_whiten``), never by trajstore's code.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from trajstore.examples import slime_dumps

from trajstore.cli import main
from trajstore.store import Store

pytestmark = pytest.mark.integration

# --------------------------------------------------------------------------- slime, transcribed


@dataclass
class SpecInfo:
    spec_accept_token_num: int = 0
    spec_draft_token_num: int = 0
    spec_verify_ct: int = 0
    completion_token_num: int = 0

    @staticmethod
    def from_dict(data: dict) -> SpecInfo:
        return SpecInfo(**{f.name: data.get(f.name, 0) for f in fields(SpecInfo)})


@dataclass
class PrefixCacheInfo:
    cached_tokens: int = 0
    total_prompt_tokens: int = 0

    @staticmethod
    def from_dict(data: dict) -> PrefixCacheInfo:
        return PrefixCacheInfo(**{f.name: data.get(f.name, 0) for f in fields(PrefixCacheInfo)})


class Status(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(eq=False)
class Sample:
    """slime/utils/types.py ``Sample``: its fields and defaults, in order."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list = field(default_factory=list)
    multimodal_inputs: Any = None
    multimodal_train_inputs: Any = None
    multimodal_train_input_id: Any = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: Any = None
    weight_versions: list = field(default_factory=list)
    rollout_log_probs: Any = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: Any = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: Any = None
    custom_rm_path: Any = None
    train_metadata: Any = None
    session_id: Any = None
    non_generation_time: float = 0.0
    spec_info: SpecInfo = field(default_factory=SpecInfo)
    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    @staticmethod
    def from_dict(data: dict) -> Sample:
        data = dict(data)
        data["status"] = Status(data["status"])
        data["spec_info"] = SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = PrefixCacheInfo.from_dict(data.get("prefix_cache_info", {}))
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample


def load_debug_rollout_data(path_template: str, *, rollout_id: int) -> list[Sample]:
    """slime's reader, as ``--load-debug-rollout-data`` runs it (weights_only=False)."""
    data = torch.load(path_template.format(rollout_id=rollout_id), weights_only=False)["samples"]
    return [Sample.from_dict(sample) for sample in data]


def same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where `a` and `b` differ: types, tensor dtypes, shapes and values, dict key order."""
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return (
            [] if ok else [f"{where}: tensor {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"]
        )
    if isinstance(a, np.ndarray):
        ok = a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        return [] if ok else [f"{where}: ndarray differs"]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} != {len(b)}"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in same(x, y, f"{where}[{i}]")
        ]
    if hasattr(a, "__dataclass_fields__"):
        return [
            d
            for f in fields(a)
            for d in same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        ] + same(
            {k: v for k, v in vars(a).items() if k not in a.__dataclass_fields__},
            {k: v for k, v in vars(b).items() if k not in b.__dataclass_fields__},
            f"{where}(extra)",
        )
    if isinstance(a, float) and np.isnan(a) and np.isnan(b):
        return []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def oracle_rewards(raw: list[float], groups: list[int], args: dict) -> list[float]:
    """slime/ray/rollout.py ``_post_process_rewards``, over the samples of each group."""
    estimator = args["advantage_estimator"]
    if not (
        estimator in ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
        and args["rewards_normalization"]
    ):
        return list(raw)
    out = [0.0] * len(raw)
    for g in sorted(set(groups)):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = torch.tensor([raw[i] for i in idx], dtype=torch.float)
        r = r - r.mean()
        if estimator in ("grpo", "gspo", "cispo") and args["grpo_std_normalization"]:
            r = r / (r.std() + 1e-6)
        for i, v in zip(idx, r.tolist(), strict=True):
            out[i] = v
    return out


def oracle_kl(log_probs: torch.Tensor, ref: torch.Tensor, args: dict) -> torch.Tensor:
    """slime/utils/ppo_utils.py ``compute_approx_kl`` as compute_advantages_and_returns calls it."""
    if args["kl_coef"] == 0:
        return torch.zeros_like(log_probs, dtype=torch.float32)
    d = log_probs.float() - ref.float()
    kind = args["kl_loss_type"]
    if kind == "k1":
        return d
    if kind == "k2":
        return d**2 / 2.0
    kl = (-d).exp() - 1 + d
    return torch.clamp(kl, -10, 10) if kind == "low_var_kl" else kl


def oracle_advantages(
    rewards: list[float], kl: list[torch.Tensor], masks: list[torch.Tensor], args: dict
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """slime's returns and advantages per estimator, then the masked whitening."""
    estimator, coef = args["advantage_estimator"], args["kl_coef"]
    if estimator in ("grpo", "gspo", "cispo"):
        ret = [torch.full_like(k, float(np.float32(r))) for r, k in zip(rewards, kl, strict=True)]
        adv = list(ret)
    elif estimator == "reinforce_plus_plus":
        ret = []
        for r, k, m in zip(rewards, kl, masks, strict=True):
            token = (-coef * (k * m)).tolist()
            token[int(torch.nonzero(m)[-1])] += r
            g, out = 0.0, []
            for value in reversed(token):
                g = value + args["gamma"] * g
                out.append(g)
            ret.append(torch.tensor(out[::-1], dtype=torch.float32))
        adv = list(ret)
    else:
        adv = [
            torch.full_like(k, float(np.float32(r))) - coef * k
            for r, k in zip(rewards, kl, strict=True)
        ]
        ret = adv
    if args["normalize_advantages"]:
        v, m = torch.cat(adv).double(), torch.cat(masks).double()
        mean = (v * m).sum() / m.sum()
        var = ((v - mean) ** 2 * m).sum() / (m.sum() - 1)
        flat = ((v - mean) / torch.sqrt(var + 1e-8)).float()
        adv = list(torch.split(flat, [a.numel() for a in adv]))
    return adv, ret


# --------------------------------------------------------------------------- helpers


def cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def ingest(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, str]:
    """``trajstore ingest --from slime ARGS...``"""
    return cli(capsys, "ingest", "--from", "slime", *args)


def generate(out: Path, *args: Any) -> Path:
    assert slime_dumps.main([str(out), *map(str, args)]) == 0
    return out


GEN = (
    "--rollouts",
    2,
    "--steps",
    2,
    "--dp",
    2,
    "--eval",
    "--kl-coef",
    0.05,
    "--kl-loss-type",
    "k3",
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two rollouts of 4 prompts x 4 samples, 2 DP ranks, 2 optimizer steps each, routes
    [T-1, 4, 2], evaluation dumps; GRPO with a k3 reward-side KL."""
    return generate(tmp_path_factory.mktemp("slime") / "dump", *GEN)


@pytest.fixture(scope="module")
def stored(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("store") / "s"
    args = [run_dir, "--store", store, "--run", "sl", "--config", run_dir / "args.txt"]
    assert main(["ingest", "--from", "slime", *map(str, args)]) == 0
    return store


def load(path: Path) -> Any:
    return torch.load(path, weights_only=False)


# --------------------------------------------------------------------------- ingest


def test_ingest_publishes_a_rollout_bundle_per_dump_and_a_step_bundle_per_optimizer_step(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s"
    code, out, err = ingest(
        capsys,
        run_dir,
        "--store",
        store,
        "--run",
        "sl",
        "--config",
        run_dir / "args.txt",
        "--json",
    )
    assert code == 0, err
    keys = sorted(k for o in json.loads(out) for k in o["keys"])
    assert keys == [
        "sl-eval/rollout-0/a1",
        "sl-eval/rollout-1/a1",
        "sl/rollout-0/a1",
        "sl/rollout-1/a1",
        "sl/step-0-0/a1",
        "sl/step-0-1/a1",
        "sl/step-1-0/a1",
        "sl/step-1-1/a1",
    ]
    code, out, _ = cli(
        capsys, "query", "bundles", "--store", store, "--run", "sl", "--format", "json"
    )
    assert code == 0
    counts = {r["key"]: r["num_samples"] for r in json.loads(out)}
    assert counts["sl/rollout-0/a1"] == 16 and counts["sl/step-0-0/a1"] == 8


def test_a_step_holds_its_micro_batches_in_the_order_each_rank_ran_them(
    run_dir: Path, stored: Path
) -> None:
    train = load(run_dir / "train_data" / "1.pt")
    want = []  # step 1 of the dump's own layout: rank by rank, micro-batch by micro-batch
    for shard in train["dp_shards"]:
        per_step = shard["num_microbatches"]
        for k, mb in enumerate(shard["micro_batch_indices"][per_step[0] :]):
            want += [
                (f"r1-s{shard['partition'][j]}", f"mb-d{shard['data_parallel_rank']}-{k:04d}")
                for j in mb
            ]
    with Store.open(stored) as store:
        (step,) = store.step("sl", 1, 1)
        got = [(s.sample_id, s.micro_batch_id) for s in step.index.samples]
        assert got == want
        by_id = {s["rollout_position"]: s for s in train["samples"]}
        lp = step.payload("log_probs")
        first = step.index.samples[0]
        pos = int(first.sample_id.split("-s")[1])
        assert np.array_equal(lp[: first.response_length], by_id[pos]["log_probs"].numpy())


def test_a_groups_prompt_tokens_and_routes_are_stored_once(stored: Path) -> None:
    with Store.open(stored) as store:
        (rollout,) = store.rollout("sl", 0)
        samples = rollout.index.samples
        for name in ("tokens", "rollout_routed_experts"):
            rec = rollout.record(name)
            assert rec.heads is not None  # the prompt is windowed apart from the response
            by_group: dict[int, set] = {}
            for i, s in enumerate(samples):
                prompt = s.total_length - s.response_length
                windows = -(-prompt // rec.chunk_tokens)
                by_group.setdefault(s.group_index, set()).add(rec.chunks[i][:windows])
            assert all(len(v) == 1 for v in by_group.values()), name
        # the step bundles' copies of the same samples are the same objects
        (step,) = store.step("sl", 0, 0)
        ids = {s.sample_id: i for i, s in enumerate(samples)}
        rec_r, rec_s = rollout.record("tokens"), step.record("tokens")
        for j, s in enumerate(step.index.samples):
            assert rec_s.chunks[j] == rec_r.chunks[ids[s.sample_id]]


def test_a_train_dump_without_its_rollout_dump_is_refused_naming_it(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = ingest(
        capsys,
        run_dir / "train_data" / "0.pt",
        "--store",
        tmp_path / "s",
    )
    assert code == 2
    assert "rollout dump of rollout 0 is not among the paths" in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_a_train_dump_read_after_its_rollout_was_converted_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Dumps are converted one rollout at a time, grouped by the number in their names
    (slime names both dumps by the rollout id); a train dump named otherwise comes too late."""
    shutil.copy(run_dir / "rollout_data" / "0.pt", tmp_path / "0.pt")
    shutil.copy(run_dir / "train_data" / "0.pt", tmp_path / "train.pt")  # no number: last
    code, _, err = ingest(
        capsys, tmp_path / "0.pt", tmp_path / "train.pt", "--store", tmp_path / "s"
    )
    assert code == 2 and "came after its rollout dump" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("field", ["rollout_routed_experts", "rollout_log_probs"])
def test_an_array_out_of_step_with_the_tokens_is_refused_naming_the_sample(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """Routes need one row per input position (len(tokens) - 1), log-probs one value per
    response token: slime refuses a sample that breaks either, and so does the ingest."""
    doc = load(run_dir / "rollout_data" / "0.pt")
    doc["samples"][6][field] = doc["samples"][6][field][:-1]
    torch.save(doc, tmp_path / "0.pt")
    code, _, err = ingest(capsys, tmp_path / "0.pt", "--store", tmp_path / "s")
    assert code == 2 and f"0.pt: sample 6: {field} has" in err, err
    assert not (tmp_path / "s").exists()


def test_path_templates_pick_the_files_slime_wrote(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = ingest(
        capsys,
        "--store",
        tmp_path / "s",
        "--json",
        f"{run_dir}/rollout_data/{{rollout_id}}.pt",
        f"{run_dir}/train_data/{{rollout_id}}.pt",
    )
    assert code == 0, err
    assert len(json.loads(out)) == 8  # 2 rollouts, 4 steps, 2 evaluation rollouts
    code, _, err = ingest(
        capsys,
        "--store",
        tmp_path / "s",
        f"{run_dir}/nothing/{{rollout_id}}.pt",
    )
    assert code == 2 and "matches no file" in err


# --------------------------------------------------------------------------- safe loading


class Shell:
    """Runs a command when unpickled (``torch.load(weights_only=False)`` would)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("where", ["metadata", "sample", "top"])
def test_a_dump_that_runs_code_when_unpickled_is_refused_and_nothing_is_written(
    run_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """Rollout 1's dump is the bad one: rollout 0's bundles, already staged, go too."""
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setenv("TMPDIR", str(staging))
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    dumps = tmp_path / "dumps"
    shutil.copytree(run_dir, dumps)
    marker = tmp_path / "pwned"
    doc = load(dumps / "rollout_data" / "1.pt")
    if where == "metadata":
        doc["samples"][3]["metadata"] = {"x": Shell(marker)}
    elif where == "sample":
        doc["samples"][3] = Shell(marker)
    else:
        doc = Shell(marker)
    torch.save(doc, dumps / "rollout_data" / "1.pt")
    code, _, err = ingest(
        capsys,
        dumps,
        "--store",
        tmp_path / "s",
        "--config",
        dumps / "args.txt",
    )
    assert code == 2
    assert err.startswith("trajstore: error: ") and err.count("\n") == 1
    assert "1.pt: refused" in err and "system" in err and "nothing was written" in err
    assert not marker.exists()  # the pickle's code never ran
    assert not (tmp_path / "s").exists()  # the store was not even created
    assert list(staging.iterdir()) == []  # nor is anything left in the temp directory


def test_a_pickled_object_of_any_class_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = load(run_dir / "rollout_data" / "0.pt")
    doc["samples"][0]["metadata"] = {"obj": Status.COMPLETED}  # an enum member: a class
    torch.save(doc, tmp_path / "0.pt")
    code, _, err = ingest(capsys, tmp_path / "0.pt", "--store", tmp_path / "s")
    assert code == 2 and "Status" in err and not (tmp_path / "s").exists()


def _member_span(path: Path, member_suffix: str) -> tuple[int, int]:
    """(start, size) of a zip member's bytes in the file."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(member_suffix))
    data = path.read_bytes()
    name_len, extra_len = np.frombuffer(
        data[info.header_offset + 26 : info.header_offset + 30], "<u2"
    )
    return info.header_offset + 30 + int(name_len) + int(extra_len), info.file_size


@pytest.mark.parametrize("member", ["data.pkl", "data/0"])
def test_a_flipped_byte_in_a_dump_is_refused(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], member: str
) -> None:
    """torch.save's zip keeps a CRC-32 per member; torch.load does not check it."""
    path = tmp_path / "0.pt"
    shutil.copy(run_dir / "train_data" / "0.pt", path)
    start, size = _member_span(path, member)
    data = bytearray(path.read_bytes())
    data[start + size // 2] ^= 0x01  # same size, one bit
    path.write_bytes(bytes(data))
    if member == "data/0":  # torch itself reads the flipped tensor without a word
        torch.load(path, weights_only=True)
    code, _, err = ingest(
        capsys,
        path,
        run_dir / "rollout_data" / "0.pt",
        "--store",
        tmp_path / "s",
    )
    assert code == 2 and "CRC-32" in err and err.count("\n") == 1
    assert not (tmp_path / "s").exists()


def test_a_flipped_byte_in_the_store_stops_the_export(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s"
    assert ingest(capsys, run_dir / "rollout_data" / "0.pt", "--store", store)[0] == 0
    with Store.open(store) as s:
        (rollout,) = s.rollout("default", 0)
        chunk_hash = rollout.record("rollout_routed_experts").chunks[0][0]
        chunk = s.objs.get(chunk_hash)
    (pack,) = (store / "packs").glob("*.pack")
    data = bytearray(pack.read_bytes())
    data[data.find(chunk) + 7] ^= 0x01
    pack.write_bytes(bytes(data))
    code, _, err = cli(
        capsys, "export", "--store", store, "--rollout", 0, "--to", "slime", tmp_path / "out"
    )
    assert code == 2 and chunk_hash in err
    assert not list((tmp_path / "out").glob("*.pt")) if (tmp_path / "out").exists() else True


# --------------------------------------------------------------------------- export


def test_export_writes_dumps_slime_reads_into_equal_samples(
    run_dir: Path, stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, printed, err = cli(
        capsys,
        "export",
        "--store",
        stored,
        "--run",
        "sl",
        "--rollout-from",
        0,
        "--rollout-to",
        1,
        "--to",
        "slime",
        out,
    )
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "rollout_0.pt",
        "rollout_1.pt",
        "train_0.pt",
        "train_1.pt",
    ]
    for r in (0, 1):
        ours = load_debug_rollout_data(str(out / "rollout_{rollout_id}.pt"), rollout_id=r)
        theirs = load_debug_rollout_data(
            str(run_dir / "rollout_data" / "{rollout_id}.pt"), rollout_id=r
        )
        assert len(ours) == len(theirs) == 16
        assert [d for a, b in zip(ours, theirs, strict=True) for d in same(a, b)] == []
        assert ours[0].rollout_routed_experts.dtype == torch.int32
        assert type(ours[0].rollout_log_probs[0]) is float
        # the train dump: every key, tensor dtype and layout as the trainer wrote it
        assert same(load(out / f"train_{r}.pt"), load(run_dir / "train_data" / f"{r}.pt")) == []
    code, _, err = cli(
        capsys,
        "export",
        "--store",
        stored,
        "--run",
        "sl-eval",
        "--rollout",
        1,
        "--to",
        "slime",
        out,
    )
    assert code == 0, err
    assert same(load(out / "eval_1.pt"), load(run_dir / "rollout_data" / "eval_1.pt")) == []


def test_an_exported_run_ingested_again_is_unchanged(
    run_dir: Path, stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Store -> slime files -> store is a fixed point: the same content, no new attempt."""
    out = tmp_path / "out"
    assert (
        cli(
            capsys, "export", "--store", stored, "--run", "sl", "--rollout", 0, "--to", "slime", out
        )[0]
        == 0
    )
    code, printed, err = ingest(
        capsys,
        out,
        "--store",
        stored,
        "--run",
        "sl",
        "--config",
        run_dir / "args.txt",
        "--json",
    )
    assert code == 0, err
    assert [o["status"] for o in json.loads(printed)] == ["unchanged"] * 3


def test_fields_slime_adds_or_trajstore_does_not_model_come_back(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = load(run_dir / "rollout_data" / "0.pt")
    doc["dump_note"] = ("a", 1)
    s = doc["samples"][2]
    s["reward"] = {"acc": np.float64(1.0), "nan": float("nan"), 3: b"\x00\xff"}
    s["metadata"] = {"z": {1, 2}, "a": np.arange(3, dtype=np.int16), "$slime": None}
    s["rollout_top_p_token_ids"] = torch.tensor([5, 6, 7], dtype=torch.int32)
    s["new_field_of_a_later_slime"] = [torch.tensor(1.5, dtype=torch.bfloat16), None]
    doc["samples"][5]["loss_mask"] = None  # slime's "all tokens count"
    doc["samples"][6]["response_length"] = np.int64(doc["samples"][6]["response_length"])
    torch.save(doc, tmp_path / "0.pt")
    store, out = tmp_path / "s", tmp_path / "out"
    assert ingest(capsys, tmp_path / "0.pt", "--store", store)[0] == 0
    assert cli(capsys, "export", "--store", store, "--rollout", 0, "--to", "slime", out)[0] == 0
    assert same(load(out / "rollout_0.pt"), doc) == []


def test_export_refuses_to_overwrite_and_names_what_is_missing(
    stored: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "train_1.pt").write_bytes(b"keep")
    code, _, err = cli(
        capsys, "export", "--store", stored, "--run", "sl", "--rollout", 1, "--to", "slime", out
    )
    assert code == 2 and "train_1.pt: already exists" in err
    assert sorted(p.name for p in out.iterdir()) == ["train_1.pt"]
    assert (out / "train_1.pt").read_bytes() == b"keep"
    code, _, err = cli(
        capsys, "export", "--store", stored, "--run", "sl", "--rollout", 7, "--to", "slime", out
    )
    assert code == 2 and "no rollout 7" in err
    code, _, err = cli(capsys, "export", "--store", stored, "--run", "sl", "--to", "slime", out)
    assert code == 2 and "--rollout" in err
    code, _, err = cli(capsys, "export", "--store", stored, "--rollout", 0, "--to", "verl", out)
    assert code == 2 and "unknown format 'verl'" in err


def test_ingest_and_export_through_s3(
    run_dir: Path, s3_env: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = s3_env.fresh_url("slime")
    code, _, err = ingest(
        capsys,
        run_dir / "rollout_data" / "1.pt",
        run_dir / "train_data" / "1.pt",
        "--store",
        url,
        "--config",
        run_dir / "args.txt",
    )
    assert code == 0, err
    code, _, err = cli(
        capsys, "export", "--store", url, "--rollout", 1, "--to", "slime", tmp_path / "out"
    )
    assert code == 0, err
    assert same(load(tmp_path / "out" / "train_1.pt"), load(run_dir / "train_data" / "1.pt")) == []
    assert (
        same(load(tmp_path / "out" / "rollout_1.pt"), load(run_dir / "rollout_data" / "1.pt")) == []
    )


# --------------------------------------------------------------------------- replay


def _args_of(run: Path) -> dict:
    from trajstore.integrations.slime.config import read_args

    return read_args(str(run / "args.txt"))


def _check_dump_against_oracle(run: Path, rollout_id: int) -> None:
    """The stand-in's train dump holds what slime's math gives (the oracle above)."""
    args = _args_of(run)
    rollout = load(run / "rollout_data" / f"{rollout_id}.pt")["samples"]
    train = load(run / "train_data" / f"{rollout_id}.pt")["samples"]
    raw = [s["reward"] for s in rollout]
    post = oracle_rewards(raw, [s["group_index"] for s in rollout], args)
    rewards = [post[t["rollout_position"]] for t in train]
    np.testing.assert_allclose([t["rewards"] for t in train], rewards, rtol=1e-6, atol=1e-6)
    kl = [oracle_kl(t["log_probs"], t["ref_log_probs"], args) for t in train]
    for t, k in zip(train, kl, strict=True):
        torch.testing.assert_close(t["kl"], k, rtol=1e-5, atol=1e-6)
    adv, ret = oracle_advantages(rewards, kl, [t["loss_masks"].float() for t in train], args)
    for t, a, r in zip(train, adv, ret, strict=True):
        torch.testing.assert_close(t["advantages"], a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t["returns"], r, rtol=1e-5, atol=1e-5)


SETTINGS = {
    "grpo-k3": ("--estimator", "grpo", "--kl-coef", 0.05, "--kl-loss-type", "k3"),
    "gspo-low-var": ("--estimator", "gspo", "--kl-coef", 0.1, "--kl-loss-type", "low_var_kl"),
    "grpo-no-std-whitened": (
        "--estimator",
        "grpo",
        "--disable-grpo-std-normalization",
        "--normalize-advantages",
        "--steps",
        1,
    ),
    "reinforce++": (
        "--estimator",
        "reinforce_plus_plus",
        "--kl-coef",
        0.2,
        "--kl-loss-type",
        "k2",
        "--gamma",
        0.9,
    ),
    "reinforce++-baseline": (
        "--estimator",
        "reinforce_plus_plus_baseline",
        "--kl-coef",
        0.1,
        "--kl-loss-type",
        "k1",
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_replay_recomputes_slimes_rewards_kl_and_advantages(
    setting: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = () if "--steps" in SETTINGS[setting] else ("--steps", 2)
    run = generate(
        tmp_path / "dump", "--rollouts", 1, "--binary-rewards", *steps, *SETTINGS[setting]
    )
    _check_dump_against_oracle(run, 0)
    store = tmp_path / "s"
    assert ingest(capsys, run, "--store", store, "--config", run / "args.txt")[0] == 0
    code, out, err = cli(capsys, "replay", "--store", store, "--all", "--json")
    assert code == 0, out + err
    code, out, _ = cli(capsys, "replay", "--store", store, "--step", "0:0", "--json")
    report = json.loads(out)
    status = {s["stage"]: s["status"] for s in report["bundles"][0]["stages"]}
    assert status["advantage.kl"] == status["advantage.estimate"] == "pass"
    assert report["linkage"]["status"] == (
        "pass" if setting.startswith("g") and "whitened" not in setting else "skipped"
    )
    code, out, _ = cli(capsys, "replay", "--store", store, "--rollout", "0", "--json")
    status = {s["stage"]: s["status"] for s in json.loads(out)["bundles"][0]["stages"]}
    assert status["reward.post_process"] == "pass"


def _edit_train(run: Path, rollout_id: int, edit: Any) -> None:
    path = run / "train_data" / f"{rollout_id}.pt"
    doc = load(path)
    edit(doc)
    torch.save(doc, path)


def test_replay_names_the_sample_and_token_of_a_changed_kl_and_advantage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = generate(tmp_path / "dump", "--rollouts", 1, "--kl-coef", 0.1, "--kl-loss-type", "k3")
    by_pos = {t["rollout_position"]: t for t in load(run / "train_data" / "0.pt")["samples"]}

    def edit(doc: dict) -> None:
        for t in doc["samples"]:
            if t["rollout_position"] == 5:
                t["kl"][2] += 0.5
            if t["rollout_position"] == 9:
                t["advantages"][1] += 0.25

    _edit_train(run, 0, edit)
    store = tmp_path / "s"
    assert ingest(capsys, run, "--store", store, "--config", run / "args.txt")[0] == 0
    code, out, _ = cli(capsys, "replay", "--store", store, "--step", "0:0", "--json")
    assert code == 1
    stages = {s["stage"]: s for s in json.loads(out)["bundles"][0]["stages"]}
    (kl,) = stages["advantage.kl"]["divergences"]
    assert (kl["sample_id"], kl["field"], kl["token_offset"]) == ("r0-s5", "kl", 2)
    assert by_pos[9]["advantages"].shape[0] > 1
    found = {
        (d["sample_id"], d["field"], d["token_offset"])
        for d in stages["advantage.estimate"]["divergences"]
    }
    assert ("r0-s9", "advantages", 1) in found


def test_rewards_normalized_over_the_batch_instead_of_each_group_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """slime normalizes over the whole batch when a rollout's sample count is not
    n * rollout_batch_size: the rewards it trained on diverge from their groups'."""
    run = generate(tmp_path / "dump", "--rollouts", 1, "--fault-reward", 0)
    store = tmp_path / "s"
    assert ingest(capsys, run, "--store", store, "--config", run / "args.txt")[0] == 0
    code, out, _ = cli(capsys, "replay", "--store", store, "--rollout", "0", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["first_divergent_stage"] == "reward.post_process"
    code, out, _ = cli(capsys, "replay", "--store", store, "--step", "0:0", "--json")
    report = json.loads(out)
    assert code == 1 and report["linkage"]["status"] == "fail"
    assert report["root_bundle_key"] == "default/rollout-0/a1"


def test_what_is_not_replayable_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = generate(tmp_path / "dump", "--rollouts", 1, "--normalize-advantages", "--steps", 2)
    store = tmp_path / "s"
    assert ingest(capsys, run, "--store", store, "--run", "noargs")[0] == 0
    assert (
        ingest(
            capsys,
            run,
            "--store",
            store,
            "--run",
            "whiten",
            "--config",
            run / "args.txt",
        )[0]
        == 0
    )
    (tmp_path / "ppo.json").write_text(json.dumps({"advantage-estimator": "ppo"}))
    assert (
        ingest(
            capsys,
            run,
            "--store",
            store,
            "--run",
            "ppo",
            "--config",
            tmp_path / "ppo.json",
        )[0]
        == 0
    )

    def reasons(run_name: str) -> dict[str, tuple[str, str]]:
        code, out, _ = cli(
            capsys, "replay", "--store", store, "--run", run_name, "--step", "0:0", "--json"
        )
        return {
            s["stage"]: (s["status"], s["reason"]) for s in json.loads(out)["bundles"][0]["stages"]
        }

    assert reasons("noargs")["advantage.estimate"][1].startswith(
        "unsupported: slime's arguments were not given"
    )
    assert "whitens over every optimizer step" in reasons("whiten")["advantage.estimate"][1]
    assert "critic's values" in reasons("ppo")["advantage.estimate"][1]
    assert "records no loss" in reasons("ppo")["loss.policy"][1]
    code, _, _ = cli(
        capsys,
        "replay",
        "--store",
        store,
        "--run",
        "noargs",
        "--step",
        "0:0",
        "--stage",
        "advantage.estimate",
    )
    assert code == 1  # a named stage that cannot run is never a pass


def test_router_compare_reads_slime_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s"
    for mode in ("baseline", "r3"):
        run = generate(
            tmp_path / mode, "--rollouts", 1, "--train-routes", "--mode", mode, "--seed", 3
        )
        assert (
            ingest(
                capsys,
                run,
                "--store",
                store,
                "--run",
                mode,
                "--config",
                run / "args.txt",
            )[0]
            == 0
        )
    code, out, err = cli(
        capsys,
        "router",
        "compare",
        "--store",
        store,
        "--run",
        "baseline",
        "--run",
        "r3",
        "--format",
        "json",
    )
    assert code == 0, err
    (step,) = json.loads(out)["steps"]
    rows = step["runs"]
    # the same count from the dump: valid (token, layer) whose expert sets differ
    train = load(tmp_path / "baseline" / "train_data" / "0.pt")["samples"]
    rollout = load(tmp_path / "baseline" / "rollout_data" / "0.pt")["samples"]
    differ = total = 0
    for t in train:
        r_routes = rollout[t["rollout_position"]]["rollout_routed_experts"]
        mask = t["loss_masks"]
        prompt = t["total_lengths"] - t["response_lengths"]
        for j in range(t["response_lengths"] - 1):  # the last token routed nothing
            if mask[j]:
                for layer in range(r_routes.shape[1]):
                    a = set(r_routes[prompt + j, layer].tolist())
                    b = set(t["train_routed_experts"][prompt + j, layer].tolist())
                    differ += a != b
                    total += 1
    assert rows["baseline"]["valid_token_layers"] == total
    assert rows["baseline"]["route_mismatch_rate"] == pytest.approx(differ / total)
    assert rows["r3"]["route_mismatch_rate"] == 0 and differ > 0


def test_a_dense_runs_sampler_against_trainer_drift_is_compared(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No routes (a dense model), no config.router: `router compare` still measures the
    trainer's log_probs against SGLang's rollout_log_probs on the loss tokens."""
    run = generate(tmp_path / "dense", "--rollouts", 1, "--layers", 0, "--steps", 1)
    store = tmp_path / "s"
    for name in ("a", "b"):
        assert ingest(capsys, run, "--store", store, "--run", name)[0] == 0
    code, out, err = cli(
        capsys,
        "router",
        "compare",
        "--store",
        store,
        "--run",
        "a",
        "--run",
        "b",
        "--format",
        "json",
    )
    assert code == 0, err
    (step,) = json.loads(out)["steps"]
    row = step["runs"]["a"]
    assert row["metric_error"] == ["missing_route"] and row["route_mismatch_rate"] is None
    diffs = []  # |log_probs - rollout_log_probs| over the loss tokens, from the dump
    for t in load(run / "train_data" / "0.pt")["samples"]:
        d = (t["log_probs"].double() - t["rollout_log_probs"].double()).abs()
        diffs += d[t["loss_masks"].bool()].tolist()
    assert row["logprob_abs_diff"] == pytest.approx(float(np.mean(diffs)), rel=1e-6)
