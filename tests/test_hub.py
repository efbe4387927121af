"""Hub names (ORG/NAME) as model, tokenizer and data paths, on a fabricated Hugging Face cache
under a temporary HF_HOME with the offline flags on: huggingface_hub's snapshot_download and
transformers' / datasets' own loading read it, and nothing touches the network."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import TINY_RECIPE, assert_ok, run_accord, run_accord_here, write_recipe

MODEL, DATASET = "tiny-org/tiny-llama", "tiny-org/sums"
MODEL_COMMIT, DATA_COMMIT, NEW_COMMIT = "1" * 40, "2" * 40, "3" * 40
ROWS = [{"question": f"{i}+{i}=", "answer": str(2 * i)} for i in range(80)]


def _repo(hub: Path, kind: str, name: str, commit: str) -> Path:
    """A repository's snapshot folder as huggingface_hub lays out its cache, `main` at `commit`."""
    repo = hub / f"{kind}s--{name.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    return snapshot


def fake_model(hub: Path, commit: str = MODEL_COMMIT) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from accord.models.build import build_byte_tokenizer

    folder = _repo(hub, "model", MODEL, commit)
    tokenizer = build_byte_tokenizer()
    config = {k: v for k, v in TINY_RECIPE["model"]["config"].items() if k != "architecture"}
    LlamaForCausalLM(LlamaConfig(**config, vocab_size=len(tokenizer))).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def fake_dataset(hub: Path, commit: str = DATA_COMMIT) -> None:
    """A dataset repository with one subset (`sums`) of two splits, declared in its README's YAML."""
    folder = _repo(hub, "dataset", DATASET, commit)
    (folder / "data").mkdir()
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: sums\n  data_files:\n  - split: train\n    path: data/train.jsonl\n"
        "  - split: test\n    path: data/test.jsonl\n---\n"
    )
    for split, rows in (("train", ROWS[:64]), ("test", ROWS[64:])):
        (folder / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def hub_env(home: Path) -> dict[str, str]:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def hub_recipe(out: Path) -> dict:
    fields = {"prompt": "question", "completion": "answer"}
    return TINY_RECIPE | {
        "model": {"path": MODEL},
        "data": {
            "train": [{"path": DATASET, "config": "sums", "split": "train", "fields": fields}],
            "eval": [{"path": DATASET, "config": "sums", "split": "test", "fields": fields}],
            "max_length": 32,
            "cache_dir": TINY_RECIPE["data"]["cache_dir"],
        },
        "batch": {"global_batch_size": 16, "micro_batch_size": 4},
        "train": {"max_steps": 4, "log_every": 2},
        "output": {"dir": str(out)},
    }


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """This process's huggingface_hub and datasets pointed at an empty cache, offline (they read
    the environment once, at import)."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    (home / "hub").mkdir(parents=True)
    return home / "hub"


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    """One 2-process run on a hub model and a hub dataset (subset and splits), offline."""
    root = tmp_path_factory.mktemp("hub")
    fake_model(root / "hf" / "hub")
    fake_dataset(root / "hf" / "hub")
    recipe = write_recipe(root / "recipe.yaml", hub_recipe(root / "run"))
    proc = run_accord("train", recipe, cwd=root, env_extra=hub_env(root / "hf"), timeout=300)
    return proc, root


@pytest.mark.subprocess
@pytest.mark.distributed
def test_trains_on_hub_model_and_dataset_offline_from_the_cache(hub_run):
    proc, root = hub_run
    assert_ok(proc)
    assert (root / "run" / "final" / "config.json").is_file()


@pytest.mark.subprocess
@pytest.mark.distributed
def test_recipe_yaml_records_the_commits_read(hub_run):
    proc, root = hub_run
    assert_ok(proc)
    recorded = yaml.safe_load((root / "run" / "recipe.yaml").read_text())
    assert recorded["engine"]["processes"] == 2
    assert recorded["model"]["path"] == MODEL and recorded["model"]["revision"] == MODEL_COMMIT
    assert [s["revision"] for s in recorded["data"]["train"] + recorded["data"]["eval"]] == [DATA_COMMIT] * 2


def test_a_hub_name_offline_and_not_cached_is_one_line_naming_hf_download(offline_hub, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", hub_recipe(tmp_path / "run"))
    proc = run_accord_here("train", recipe)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if MODEL in line]
    assert len(lines) == 1 and f"hf download {MODEL}`" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "Traceback" not in proc.stderr


def test_resuming_after_the_branch_moved_is_one_line_and_exit_2(offline_hub, tmp_path):
    fake_dataset(offline_hub, NEW_COMMIT)  # main has moved since the run began on DATA_COMMIT
    raw = hub_recipe(tmp_path / "run") | {"model": TINY_RECIPE["model"], "resume": "auto"}
    del raw["data"]["eval"]
    raw["data"]["train"][0]["revision"] = DATA_COMMIT
    write_recipe((tmp_path / "run").mkdir() or tmp_path / "run" / "recipe.yaml", raw)  # what the run recorded
    raw["data"]["train"][0]["revision"] = "main"
    proc = run_accord_here("train", write_recipe(tmp_path / "r.yaml", raw))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if NEW_COMMIT in line]
    assert len(lines) == 1 and DATA_COMMIT in lines[0] and "data.train[0].revision" in lines[0], proc.stderr


def test_a_private_repository_without_a_token_says_to_log_in(offline_hub, monkeypatch):
    """The hub's answer to a private repository without a token (401, RepositoryNotFound), turned
    into its exception by huggingface_hub itself, where snapshot_download would ask the hub."""
    import httpx2 as httpx  # the HTTP client huggingface_hub uses
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import hf_raise_for_status

    from accord.recipe.hub import HubError, snapshot

    def private(self, repo_id, **kwargs):
        url = f"https://huggingface.co/api/models/{repo_id}"
        request = httpx.Request("GET", url)
        hf_raise_for_status(httpx.Response(401, headers={"X-Error-Code": "RepositoryNotFound"}, request=request))

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "repo_info", private)
    with pytest.raises(HubError, match=r"model.path: someone/private: .*private: log in .*HF_TOKEN") as e:
        snapshot("someone/private", None, "model", "model.path")
    assert "\n" not in str(e.value)


def test_resume_refuses_a_branch_that_moved_unless_the_recipe_names_the_new_commit(offline_hub, tmp_path):
    from accord.recipe.hub import HubError, pin
    from accord.recipe.schema import Recipe

    fake_dataset(offline_hub)
    fake_dataset(offline_hub, NEW_COMMIT)  # main moved to a new commit since the run started
    recorded = {"data": {"train": [{"path": DATASET, "revision": DATA_COMMIT}]}}

    def recipe(revision):
        return Recipe.model_validate(
            TINY_RECIPE | {"data": {"train": [{"path": DATASET, "revision": revision}]}, "output": {"dir": "x"}}
        )

    assert pin(recipe(None), recorded).data.train[0].revision == DATA_COMMIT  # a resume keeps its commit
    with pytest.raises(HubError, match=rf"data.train\[0\]: .*'main' is now commit {NEW_COMMIT}.*read {DATA_COMMIT}"):
        pin(recipe("main"), recorded)
    assert pin(recipe(NEW_COMMIT), recorded).data.train[0].revision == NEW_COMMIT
    assert pin(recipe("main"), None).data.train[0].revision == NEW_COMMIT  # a fresh run reads main


def test_a_split_that_does_not_exist_names_the_splits_that_do(offline_hub):
    from accord.data.sources import DataError, load_source
    from accord.recipe.hub import pin
    from accord.recipe.schema import Recipe

    fake_dataset(offline_hub)
    source = {"path": DATASET, "config": "sums", "split": "validation"}
    recipe = pin(Recipe.model_validate(TINY_RECIPE | {"data": {"train": [source]}, "output": {"dir": "x"}}))
    with pytest.raises(DataError, match=r"no split 'validation' \(splits: train, test\)"):
        load_source(recipe.data.train[0], ("question",))


def test_a_local_folder_of_the_hub_name_wins(offline_hub, tmp_path, monkeypatch):
    from accord.recipe.hub import is_hub_name, local_path

    monkeypatch.chdir(tmp_path)
    assert is_hub_name(MODEL)
    (tmp_path / MODEL).mkdir(parents=True)
    assert not is_hub_name(MODEL) and local_path(MODEL) == Path(MODEL)
    assert not is_hub_name("data/missing.jsonl") and is_hub_name("Qwen/Qwen2.5-0.5B")


def test_a_hub_dataset_not_in_the_cache_offline_names_the_download_command(offline_hub):
    from accord.data.sources import DataError, load_source
    from accord.recipe.schema import SourceConfig

    command = "hf download HuggingFaceH4/ultrachat_200k --repo-type dataset"
    with pytest.raises(DataError, match=f"not in the Hugging Face cache .*HF_HUB_OFFLINE.*`{command}`"):
        load_source(SourceConfig(path="HuggingFaceH4/ultrachat_200k"), ("prompt",))


def test_the_nodes_other_processes_read_the_commits_its_first_process_fetched(offline_hub, tmp_path, capsys):
    """Under an outer launcher only local rank 0 fetches; the others wait for its handoff and
    read its commits, even where the cache's main has moved on meanwhile."""
    import threading

    from accord.recipe.hub import pin
    from accord.recipe.schema import Recipe

    fake_dataset(offline_hub)
    recipe = Recipe.model_validate(TINY_RECIPE | {"data": {"train": [DATASET]}, "output": {"dir": "x"}})
    handoff = tmp_path / "handoff.json"
    waiting: list = []
    follower = threading.Thread(target=lambda: waiting.append(pin(recipe, None, handoff, leads=False, timeout_s=30)))
    follower.start()
    leader = pin(recipe, None, handoff, leads=True)
    fake_dataset(offline_hub, NEW_COMMIT)  # main moves after the first process fetched
    follower.join(timeout=30)
    assert leader.data.train[0].revision == waiting[0].data.train[0].revision == DATA_COMMIT
    assert recipe.data.train[0].revision is None  # pin returns a copy
    assert "waiting for this node's first process to fetch tiny-org/sums" in capsys.readouterr().err
